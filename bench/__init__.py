"""Benchmarks: each script measures our code and a baseline in the same run and prints the ratio."""

from __future__ import annotations

import os
import platform


def hardware_line(device: str = "cpu") -> str:
    """One line naming the machine a benchmark ran on (CPU model, cores, RAM, torch, threads, load; the GPU)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    line = (f"hardware: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}, load average "
            f"{os.getloadavg()[0]:.1f} at start")
    if device.startswith("cuda"):
        line += f", GPU {torch.cuda.get_device_name(device)}"
    else:  # which way the CPU recipes' bf16 settings go (models.layers.native_cpu_bf16)
        from models.layers import native_cpu_bf16

        line += ", native bf16 products" if native_cpu_bf16() else ", no native bf16 products (bf16 autocast runs fp32)"
    return line
