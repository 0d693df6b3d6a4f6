"""Checkpoints of a trainer: whole weights for ``from_pretrained`` plus the state a run resumes from.

``<dir>/policy/``  the model (safetensors, config, tokenizer): the whole 16-bit weights under ZeRO-3, saved once;
``<dir>/trainer/`` optimizer (sharded under ZeRO), RNG states, and ``loop.json`` (step counters, LR schedule, the
                   launch it was saved under); ``<dir>/DONE`` marks a complete checkpoint. A trainer sharing
                   another's Accelerator (RL's value model outside DeepSpeed) keeps only ``loop.json`` there.
The weights are stored once: ``trainer/`` holds no second copy of them (a run resumes its weights from ``policy/``),
except under DeepSpeed, whose engine writes its own partitioned model states beside the optimizer's.
A checkpoint saved by another number of processes (or another launcher) resumes its weights only: the optimizer
state starts fresh, and the run says so.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelerate.utils import DistributedType

from core.files import RunDirError, fsync_tree, run_dir_entries, write_atomic
from jobs.dist import barrier, is_main
from models.lora import write_base_fingerprint


def check_fresh_run_dir(root: Path, overwrite: bool) -> None:
    """A fresh training run needs an empty run directory (its lock aside): refuse a used one unless ``overwrite``.
    Jobs empty it with :func:`empty_run_dir` only once every other setup check has passed, so a mistake found
    while setting up never costs the old run."""
    if run_dir_entries(root) and not overwrite:
        raise RunDirError(f"run directory {root} is not empty; resume it with experiment.start_from_scratch="
                          "false, or replace it with experiment.overwrite=true")


def empty_run_dir(root: Path, accelerator: Any) -> None:
    """Remove everything in the run directory but its lock (the main process; collective: every process waits)."""
    if is_main(accelerator):
        for p in run_dir_entries(root):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    barrier(accelerator)


@contextmanager
def _without_model_weights(acc: Any):
    """accelerate's save_state / load_state minus the model weights (``policy/`` holds them); DeepSpeed keeps its
    engine checkpoint whole."""
    if acc.distributed_type == DistributedType.DEEPSPEED:
        yield
        return
    handles = [acc.register_save_state_pre_hook(lambda models, weights, out: weights.clear()),
               acc.register_load_state_pre_hook(lambda models, inp: models.clear())]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def save_checkpoint(trainer: Any, ckpt: Path, extra: dict | None = None, accelerator_state: bool = True) -> None:
    """Write a complete checkpoint of ``trainer`` (collective: every process calls it). ``accelerator_state`` False:
    the trainer shares its Accelerator with one whose checkpoint saves it (the Accelerator's state holds every
    optimizer it prepared), so ``trainer/`` keeps the loop state only."""
    acc, model = trainer.accelerator, trainer.model
    state = acc.get_state_dict(model)  # whole weights under ZeRO-3 (collective)
    main = is_main(acc)
    if main:
        acc.unwrap_model(model).save_pretrained(ckpt / "policy", state_dict=state, safe_serialization=True)
        write_base_fingerprint(acc.unwrap_model(model), ckpt / "policy")  # LoRA: which base the adapter is for
        trainer.adapter.tokenizer.save_pretrained(ckpt / "policy")
    if accelerator_state:
        with _without_model_weights(acc):
            acc.save_state(str(ckpt / "trainer"))
    barrier(acc)  # every process's files (its RNG state, its optimizer shard) are written before DONE says so
    if main:
        (ckpt / "trainer").mkdir(parents=True, exist_ok=True)
        write_atomic(ckpt / "trainer" / "loop.json", json.dumps({
            "rl_step": trainer.rl_step, "schedule": trainer.schedule.state_dict(),
            "num_processes": acc.num_processes, "distributed_type": str(acc.distributed_type), **(extra or {})}))
        fsync_tree(ckpt)
        write_atomic(ckpt / "DONE", "")
    barrier(acc)


def is_complete(ckpt: Path) -> bool:
    return (ckpt / "DONE").is_file()


def load_checkpoint(trainer: Any, ckpt: Path, accelerator_state: bool = True) -> dict:
    """Restore optimizer, RNG and schedule state (the weights come from ``policy/`` when the model is loaded);
    returns ``loop.json``. ``accelerator_state`` False: the loop state only (see :func:`save_checkpoint`)."""
    acc = trainer.accelerator
    loop = json.loads((ckpt / "trainer" / "loop.json").read_text())
    same = (loop.get("num_processes"), loop.get("distributed_type")) == (acc.num_processes,
                                                                         str(acc.distributed_type))
    if same and accelerator_state:
        with _without_model_weights(acc):
            acc.load_state(str(ckpt / "trainer"))
    elif not same and is_main(acc):
        print(f"note: {ckpt} was saved by {loop.get('num_processes')} process(es) "
              f"({loop.get('distributed_type')}); resuming the weights with a fresh optimizer state", flush=True)
    trainer.rl_step = int(loop["rl_step"])
    trainer.schedule.load_state_dict(loop["schedule"])
    return loop


def check_resumed_config(root: Path, cfg: Any, resumable: tuple[str, ...],
                         former_defaults: dict[str, Any] | None = None) -> None:
    """Refuse to resume ``root`` under a config that differs from its ``config.yaml`` except in ``resumable`` keys
    (one line naming the first key that differs): a resumed run is the run it continues, and its optimizer,
    schedule and data state were saved for that config. ``former_defaults``: keys whose default became null (the
    same setting), with the value an earlier version wrote for it."""
    import yaml

    from core.loader import all_keys, defaults_tree
    from core.schema import to_dict

    saved_path = root / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        tree = yaml.safe_load(saved_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise RunDirError(f"cannot resume {root}: its config.yaml is unreadable ({' '.join(str(err).split())[:120]}); "
                          "restore it, or start again with experiment.overwrite=true") from None
    if not isinstance(tree, dict):
        raise RunDirError(f"cannot resume {root}: its config.yaml holds no config; restore it, or start again with "
                          "experiment.overwrite=true")
    saved, now = _flatten(tree), _flatten(to_dict(cfg))
    settings = set(all_keys(type(cfg), sections=False))
    foreign = sorted(k for k in saved if saved[k] is not None and _unknown_setting(k, settings))
    if foreign:  # an SFT run's folder under rl.py, say (or a run of a version with other settings)
        raise RunDirError(f"cannot resume {root}: its config.yaml has {foreign[0]!r}, a setting this job does not "
                          "know; if it is another kind of run (RL, SFT, eval), choose another experiment.project")
    # a key newer than the run's config.yaml (added by a later version) matches when it keeps its default
    defaults = _flatten(defaults_tree(type(cfg)))
    saved.update({k: defaults[k] for k in now if k not in saved and k in defaults})
    for key, value in (former_defaults or {}).items():
        if saved.get(key) == value and now.get(key) is None:
            saved[key] = None
    for key in sorted(set(saved) | set(now)):
        if key not in resumable and saved.get(key) != now.get(key):
            raise RunDirError(f"cannot resume {root}: '{key}' was {saved.get(key)!r} and is now {now.get(key)!r} "
                              f"(only {', '.join(resumable)} may change)")


def _unknown_setting(key: str, settings: set[str]) -> bool:
    """``key`` (flattened) names no setting, nor an entry of a mapping-valued one (``system.env.X``)."""
    parts = key.split(".")
    return not any(".".join(parts[:i]) in settings for i in range(1, len(parts) + 1))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def remove_checkpoint(ckpt: Path) -> None:
    """Delete a checkpoint folder, its DONE marker first: a kill midway leaves a checkpoint that says it is
    incomplete (resume falls back past it), never one that says complete with files gone."""
    (ckpt / "DONE").unlink(missing_ok=True)
    if ckpt.is_dir():
        shutil.rmtree(ckpt)


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why checkpoint ``ckpt`` cannot be resumed (a file missing, truncated or unreadable), or None.

    Cheap: safetensors headers are checked against the file size, torch archives are opened through their central
    directory (at the end of the file, so a truncated archive fails) without reading the tensors.
    """
    import torch
    from safetensors import safe_open

    if not is_complete(ckpt):
        return "no DONE marker"
    policy, trainer = ckpt / "policy", ckpt / "trainer"
    if not list(policy.glob("*.safetensors")):
        return f"{policy} holds no weights"
    config = policy / ("adapter_config.json" if (policy / "adapter_config.json").is_file() else "config.json")
    for path in (config, trainer / "loop.json"):  # a LoRA run's policy/ is its adapter (peft's format)
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as err:
            return f"{path.relative_to(ckpt)}: {type(err).__name__}: {err}"
    for path in sorted(ckpt.rglob("*")):
        if not path.is_file():
            continue
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as fh:
                    fh.keys()
            elif path.suffix in (".bin", ".pt", ".pkl"):  # torch.save archives (accelerate's RNG states too)
                torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception as err:  # noqa: BLE001 - any failure to read means "not resumable"; the caller says which
            return f"{path.relative_to(ckpt)}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None
