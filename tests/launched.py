"""How the scripts that the distributed tests start with `accelerate launch` end.

Once a rank's work and results are written, it leaves with `os._exit` after a barrier. A normal interpreter exit
destroys gloo's C++ worker threads during teardown, and once in many CI runs that aborted an already-finished rank
("terminate called without an active exception", SIGABRT), failing a test whose results were all correct. The
tests check training, not interpreter teardown, so the ranks skip it.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def assert_world_size(accelerator, expected: int) -> None:
    """Fail loudly when the run has a different number of processes than launched (e.g. a silent 1-process
    fallback of ``accelerate launch --cpu`` or a CPU run without a process group)."""
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"expected {expected} processes but accelerate sees {accelerator.num_processes} "
            f"(distributed_type={accelerator.distributed_type}); on CPU use `accelerate launch --multi_gpu "
            "--num_processes N` (or a MULTI_GPU / DEEPSPEED config) and build_accelerator()"
        )


def leave(accelerator) -> NoReturn:
    """Wait for every rank, flush stdio, exit 0 without interpreter teardown."""
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
