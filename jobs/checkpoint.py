"""Checkpoints of a trainer: whole weights for ``from_pretrained`` plus the state a run resumes from.

``<dir>/policy/``  the model (safetensors, config, tokenizer): the whole 16-bit weights under ZeRO-3, saved once;
``<dir>/trainer/`` optimizer (sharded under ZeRO), RNG states, and ``loop.json`` (step counters, LR schedule, the
                   launch it was saved under); ``<dir>/DONE`` marks a complete checkpoint.
A checkpoint saved by another number of processes (or another launcher) resumes its weights only: the optimizer
state starts fresh, and the run says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from core.files import RunDirError, write_atomic
from jobs.dist import barrier, is_main


def clear_for_fresh_run(root: Path, overwrite: bool, accelerator: Any) -> None:
    """A fresh training run needs an empty run directory: refuse a used one unless ``overwrite`` (then remove it)."""
    if root.is_dir() and any(root.iterdir()):
        if not overwrite:
            raise RunDirError(f"run directory {root} is not empty; resume it with experiment.start_from_scratch="
                              "false, or replace it with experiment.overwrite=true")
        if is_main(accelerator):
            shutil.rmtree(root)
        barrier(accelerator)


def save_checkpoint(trainer: Any, ckpt: Path, extra: dict | None = None) -> None:
    """Write a complete checkpoint of ``trainer`` (collective: every process calls it)."""
    acc, model = trainer.accelerator, trainer.model
    state = acc.get_state_dict(model)  # whole weights under ZeRO-3 (collective)
    main = is_main(acc)
    if main:
        acc.unwrap_model(model).save_pretrained(ckpt / "policy", state_dict=state, safe_serialization=True)
        trainer.adapter.tokenizer.save_pretrained(ckpt / "policy")
    acc.save_state(str(ckpt / "trainer"))
    if main:
        write_atomic(ckpt / "trainer" / "loop.json", json.dumps({
            "rl_step": trainer.rl_step, "schedule": trainer.schedule.state_dict(),
            "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type), **(extra or {})}))
        write_atomic(ckpt / "DONE", "")
    barrier(acc)


def is_complete(ckpt: Path) -> bool:
    return (ckpt / "DONE").is_file()


def load_checkpoint(trainer: Any, ckpt: Path) -> dict:
    """Restore optimizer, RNG and schedule state (the weights come from ``policy/`` when the model is loaded);
    returns ``loop.json``."""
    acc = trainer.accelerator
    loop = json.loads((ckpt / "trainer" / "loop.json").read_text())
    same = (loop.get("num_processes"), loop.get("distributed_type")) == (acc.num_processes,
                                                                         str(acc.distributed_type))
    if same:
        acc.load_state(str(ckpt / "trainer"))
    elif is_main(acc):
        print(f"note: {ckpt} was saved by {loop.get('num_processes')} process(es) "
              f"({loop.get('distributed_type')}); resuming the weights with a fresh optimizer state", flush=True)
    trainer.rl_step = int(loop["rl_step"])
    trainer.schedule.load_state_dict(loop["schedule"])
    return loop
