"""One way to build an `accelerate.Accelerator` that works on GPU nodes and on CPU-only machines alike.

On CPU-only machines accelerate needs help (measured with accelerate 1.15 and DeepSpeed 0.19): under a launcher
the process group must use gloo, DDP needs ``cpu=True``, and DeepSpeed must NOT get ``cpu=True`` (it would be
skipped) but does need the gloo backend or every rank believes it is alone. DeepSpeed also refuses ``prepare``
without a dataloader unless ``train_micro_batch_size_per_gpu`` is set, so it is filled from ``micro_batch_size``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from core.entry import launched
from models.layers import cpu_bf16_emulated


def _deepspeed_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def build_accelerator(
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int = 1,
    log_with: Any = None,
    project_dir: str | None = None,
    micro_batch_size: int = 1,
    max_grad_norm: float | None = None,
) -> Accelerator:
    """An Accelerator for the current launch (none, DDP or DeepSpeed; CUDA or CPU-only).

    ``mixed_precision`` None takes the launcher's setting (the accelerate config), else "no"; an explicit value
    ("no" | "bf16" | "fp16") overrides it. bf16 works on CPU; where the CPU has no native bf16 products it becomes
    "no", with a warning (``models.layers.cpu_bf16_emulated``). ``micro_batch_size`` is the per-device batch
    DeepSpeed is told about when its config leaves ``train_micro_batch_size_per_gpu`` on "auto".
    ``max_grad_norm`` (0: none) becomes DeepSpeed's ``gradient_clipping``: under DeepSpeed the engine clips inside
    its step and ``Accelerator.clip_grad_norm_`` only reports the norm, so the training setting must reach it.
    """
    cpu_only = not torch.cuda.is_available()
    if cpu_only and (mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")) == "bf16" and \
            cpu_bf16_emulated("training.mixed_precision=bf16"):
        mixed_precision = "no"
    kwargs: dict[str, Any] = {}
    if cpu_only and launched():
        # Without an explicit gloo backend a CPU DeepSpeed run sets up no process group (every rank alone),
        # and DDP with cpu=True could pick MPI.
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    if cpu_only and not _deepspeed_requested():
        kwargs["cpu"] = True
    if cpu_only and _deepspeed_requested() and os.environ.get("DLLM_DS_SHM_COMM", "0") != "1":
        _skip_deepspeed_shm_comm()
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=log_with,
        project_dir=project_dir,
        **kwargs,
    )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _fill_deepspeed_config(accelerator, micro_batch_size, max_grad_norm)
    return accelerator


def _skip_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend on plain gloo collectives instead of its shared-memory allreduce kernel.

    That kernel is JIT-compiled at process-group start (~45-100 s on a fresh machine), only speeds up CPU
    collectives (CPU DeepSpeed runs are tests and demos here) and needs AVX-512 for bf16. Set
    ``DLLM_DS_SHM_COMM=1`` to use it anyway. GPU runs never build it.
    """
    try:  # importlib: `import deepspeed.comm.torch` would bind the `torch` package re-exported by deepspeed.comm
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None


def _fill_deepspeed_config(accelerator: Accelerator, micro_batch_size: int, max_grad_norm: float | None) -> None:
    plugin = accelerator.state.deepspeed_plugin
    cfg = plugin.deepspeed_config
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    if max_grad_norm is not None:
        launcher = cfg.get("gradient_clipping")
        if launcher not in (None, "auto") and float(launcher) != max_grad_norm and accelerator.is_main_process:
            print(f"note: DeepSpeed clips gradients at training.max_grad_norm={max_grad_norm:g}, not at the "
                  f"accelerate config's gradient_clipping {launcher}", flush=True)
        cfg["gradient_clipping"] = float(max_grad_norm)
    zero = cfg.get("zero_optimization", {})
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload not in (None, "none") and "zero_force_ds_cpu_optimizer" not in cfg:
        # Let torch optimizers run with ZeRO-Offload (slower than DeepSpeedCPUAdam, but needs no compiled ops).
        cfg["zero_force_ds_cpu_optimizer"] = False


def gather_objects(accelerator: Any, items: list) -> list:
    """Every process's ``items`` (picklable objects) concatenated in rank order, on every process."""
    if accelerator is None or accelerator.num_processes == 1:
        return list(items)
    from accelerate.utils import gather_object

    return list(gather_object(list(items)))
