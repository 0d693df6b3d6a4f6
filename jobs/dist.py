"""Collectives the jobs need across processes (no-ops in a single process)."""

from __future__ import annotations

from typing import Any


def rank_world(accelerator: Any) -> tuple[int, int]:
    if accelerator is None:
        return 0, 1
    return accelerator.process_index, accelerator.num_processes


def barrier(accelerator: Any) -> None:
    if accelerator is not None and accelerator.num_processes > 1:
        accelerator.wait_for_everyone()


def end_processes(accelerator: Any) -> None:
    """After a job that every process finished: wait for all of them, then take the process group down, so its
    worker threads are joined before the interpreter exits (left to interpreter teardown, gloo's threads were seen
    to abort a finished rank with "terminate called without an active exception")."""
    import torch.distributed as dist

    if accelerator is not None and accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
        accelerator.wait_for_everyone()
        dist.destroy_process_group()


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def is_main(accelerator: Any) -> bool:
    return accelerator is None or accelerator.is_main_process
