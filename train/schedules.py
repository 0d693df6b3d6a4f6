"""Learning-rate schedules with a real floor, advanced exactly once per training step (the trainer's ``train_step``).

The reference's cosine (Gen-Verse/dLLM-RL models/lr_schedulers.py) ignores ``min_lr_scale`` and is advanced
``num_processes`` times per call by
accelerate's scheduler wrapper, so on 8 GPUs it passes its minimum early and rises again. Here the factor is a pure
function of the training step, the LR is written into the optimiser's parameter groups directly (no accelerate
wrapper, so nothing is multiplied by the world size), and after ``total_steps`` the factor stays at the floor.
"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


def lr_factor(name: str, step: int, total_steps: int | None = None, warmup_steps: int = 0,
              min_lr_scale: float = 0.0) -> float:
    """Multiplier of the base LR for training step ``step`` (0-based, the step about to be taken).

    Warmup (all but ``constant``) ramps linearly (step+1)/warmup_steps; ``linear``/``cosine`` then decay from 1 to
    ``min_lr_scale`` at ``total_steps`` and stay there.
    """
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler {name!r} is not one of {SCHEDULES}")
    if not 0.0 <= min_lr_scale <= 1.0:
        raise ValueError(f"min_lr_scale must be in [0, 1], got {min_lr_scale}")
    if name == "constant":
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant_with_warmup":
        return 1.0
    if not total_steps:
        raise ValueError(f"lr_scheduler {name!r} needs total_steps (number of training steps)")
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    decay = 1.0 - progress if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_scale + (1.0 - min_lr_scale) * decay


class LRSchedule:
    """Sets ``lr = base_lr * factor(step)`` on every parameter group; ``step()`` advances once."""

    def __init__(self, optimizer: Any, name: str = "constant", total_steps: int | None = None,
                 warmup_steps: int = 0, min_lr_scale: float = 0.0):
        self.optimizer = optimizer
        self.name, self.total_steps = name, total_steps
        self.warmup_steps, self.min_lr_scale = warmup_steps, min_lr_scale
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.step_count = 0
        lr_factor(name, 0, total_steps, warmup_steps, min_lr_scale)  # validate now, not mid-run
        self.apply()

    def factor(self) -> float:
        return lr_factor(self.name, self.step_count, self.total_steps, self.warmup_steps, self.min_lr_scale)

    def apply(self) -> float:
        """Write the current step's LR into the optimiser; returns the LR of the first group."""
        f = self.factor()
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * f
        return self.base_lrs[0] * f

    def step(self) -> None:
        self.step_count += 1
        self.apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.base_lrs = int(state["step_count"]), list(state["base_lrs"])
        self.apply()
