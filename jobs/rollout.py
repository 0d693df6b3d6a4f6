"""Rollout + scoring shared by eval.py (and the RL loop): tasks -> prompts -> trajectories -> per-sample scores.

This sits at the entry-script level because it combines data/, sample/ and reward/, which must not import each
other (DESIGN.md dependency direction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.formats import load_dataset_file
from data.prompts import prompt_ids
from data.tasks import arithmetic_task, code_task
from reward.math import score_math_batch
from reward.sandbox import CodeJob, SandboxConfig, code_from_response, run_many
from sample.generate import Rollout, generate
from sample.params import SamplingParams

BUILTIN_TASKS = {"builtin:arithmetic": ("math", arithmetic_task), "builtin:code": ("code", code_task)}


def load_tasks(name: str, data_type: str, seed: int = 0, n_builtin: int = 64, data_dir: str = "data") -> list[dict]:
    """Rows of a dataset: a built-in task (``builtin:arithmetic``, ``builtin:code``) or ``data/{name}.json``."""
    if name in BUILTIN_TASKS:
        kind, make = BUILTIN_TASKS[name]
        if kind != data_type:
            raise ValueError(f"dataset {name!r} is a {kind} task but data_type is {data_type!r}")
        return make(n_builtin, seed=seed)
    path = Path(name) if name.endswith((".json", ".jsonl")) else Path(data_dir) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found; run: python data/download_data.py --dataset {name}")
    return load_dataset_file(path, data_type)


def sampling_params(rollout: Any, seed: int | None) -> SamplingParams:
    """SamplingParams from a config's ``rollout`` (or ``evaluation``) section."""
    return SamplingParams(
        max_tokens=int(rollout.max_token), temperature=float(rollout.temperature), top_k=int(rollout.top_k),
        top_p=float(rollout.top_p), remasking_strategy=str(rollout.remasking_strategy),
        dynamic_threshold=float(rollout.dynamic_threshold), eb_threshold=float(rollout.eb_threshold),
        stop=list(rollout.stop_token_list or []), seed=seed, max_active=int(rollout.max_active),
        target=str(rollout.target), alg_temp=float(rollout.alg_temp),
        pad_target_penalty=float(rollout.pad_target_penalty), cache=str(rollout.cache or "prefix"),
        block_size=int(rollout.block_size), denoising_steps=int(rollout.denoising_steps_per_block),
        block_length=int(rollout.block_size), steps=None if rollout.steps is None else int(rollout.steps),
        further_horizon=int(rollout.further_horizon),
    )


def rollout_tasks(adapter: Any, tasks: list[dict], data_type: str, params: SamplingParams, k: int,
                  start_with_think: bool = False, progress: bool = True) -> Rollout:
    """Sample ``k`` responses per task; sample ``i*k + j`` is response j of task i (ids ``{i}-{j}``)."""
    prompts = [prompt_ids(adapter, row, data_type, start_with_think) for row in tasks]
    flat = [p for p in prompts for _ in range(k)]
    rollout = generate(adapter, flat, params, progress=progress)
    for n, traj in enumerate(rollout):
        traj.group_id, traj.sample_id = str(n // k), f"{n // k}-{n % k}"
    return rollout


def score_rollout(rollout: Rollout, tasks: list[dict], data_type: str, k: int, max_tokens: int | None = None,
                  truncation_margin: int | None = None, execute: Any = None) -> list[float]:
    """Per-sample score in [0, 1]: answer correctness (math/option) or the pass fraction of the tests (code).

    ``truncation_margin`` (RL only) marks responses within the margin of ``max_tokens`` as wrong (REFERENCE 5.2).
    """
    rows = [tasks[n // k] for n in range(len(rollout))]
    if data_type in ("math", "option"):
        lengths = [len(t.response_ids) for t in rollout]
        return score_math_batch([t.text for t in rollout], [r["ground_truth_answer"] for r in rows],
                                data_type=data_type, response_lengths=lengths,
                                max_tokens=max_tokens if truncation_margin is not None else None,
                                truncation_margin=truncation_margin or 0)
    jobs = [CodeJob.from_task(row, code_from_response(t.text, row.get("prefix", "")) or "")
            for t, row in zip(rollout, rows, strict=True)]
    workers = int(getattr(execute, "num_chunk", 4) or 4) if execute is not None else 4
    memory = int(getattr(execute, "memory_limit_mb", 1024) or 1024) if execute is not None else 1024
    results = run_many(jobs, max_workers=workers, config=SandboxConfig(memory_mb=memory), progress=True)
    return [r.pass_fraction for r in results]
