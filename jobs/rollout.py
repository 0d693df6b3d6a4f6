"""Rollout + scoring shared by eval.py and the RL loop: tasks -> prompts -> trajectories -> per-sample scores.

This sits at the job level because it combines data/, sample/ and reward/, which must not import each other
(imports point down, from jobs to the packages they combine).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.loader import ConfigError, as_written
from core.schema import SettingError, replace
from data.builtin import BUILTIN, builtin_kind, builtin_tasks
from data.formats import load_dataset_file
from data.prompts import prompt_ids
from reward.math import score_math_batch
from reward.sandbox import CodeJob, SandboxConfig, code_from_response, run_many
from sample.generate import Rollout, generate
from sample.params import SamplingParams

if TYPE_CHECKING:
    from models.registry import Adapter


def load_tasks(name: str, data_type: str, seed: int = 0, n_builtin: int | None = None,
               data_dir: str = "data") -> list[dict]:
    """Rows of a dataset: a built-in task (``builtin:arithmetic``, ``builtin:code``) or ``data/{name}.json``."""
    kind = builtin_kind(name)
    if kind is not None:
        if kind != data_type:
            raise ValueError(f"dataset {name!r} is a {kind} task but data_type is {data_type!r}")
        return builtin_tasks(name, n_builtin, seed)
    path = Path(name) if name.endswith((".json", ".jsonl")) else Path(data_dir) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found; {_missing_dataset_hint(name, Path(data_dir))}")
    return load_dataset_file(path, data_type)


def _missing_dataset_hint(name: str, data_dir: Path) -> str:
    """Download a known benchmark; otherwise name the closest built-in, local or downloadable dataset."""
    from data.hub import DATASETS

    if name in DATASETS:
        return f"run: python -m tools.download_data --dataset {name}"
    local = [p.name.removesuffix(".json") for p in data_dir.glob("*.json")] if data_dir.is_dir() else []
    close = difflib.get_close_matches(name, [*BUILTIN, *local, *DATASETS], n=1, cutoff=0.6)
    if not close:
        return f"built-in: {', '.join(BUILTIN)}; downloadable: {', '.join(DATASETS)}"
    get = f" (python -m tools.download_data --dataset {close[0]})" if close[0] in DATASETS and close[0] not in local \
        else ""
    return f"closest: {close[0]!r}{get}"


def check_for_model(section: str, params: SamplingParams, adapter: Adapter) -> None:
    """The sampler rules that need the model (stop words, cache mode, steps vs blocks), as one-line errors."""
    try:
        params.check_for(adapter)
    except SettingError as err:
        key = as_written(f"{section}.{err.field}")
        raise ConfigError(f"key '{key}': {err}", key) from None


def rollout_tasks(adapter: Adapter, tasks: list[dict], data_type: str, params: Any, indices: list[int] | None = None,
                  progress: bool = True) -> Rollout:
    """Sample ``params.num_response_per_task`` responses to each task ``tasks[i]``, i in ``indices`` (default:
    all, in order). Response j of task i has ``task_index`` i, ``group_id`` "i" and ``sample_id`` "i-j";
    responses come in task order, a task's responses together."""
    k = params.num_response_per_task
    indices = list(range(len(tasks))) if indices is None else list(indices)
    prompts = [prompt_ids(adapter, tasks[i], data_type, params.start_with_think) for i in indices]
    rollout = generate(adapter, [p for p in prompts for _ in range(k)], params, progress=progress)
    for n, traj in enumerate(rollout):
        traj.task_index = indices[n // k]
        traj.group_id, traj.sample_id = str(traj.task_index), f"{traj.task_index}-{n % k}"
    return rollout


def score_rollout(rollout: list, tasks: list[dict], data_type: str, max_tokens: int | None = None,
                  truncation_margin: int | None = None, execute: SandboxConfig | None = None,
                  progress: bool = True) -> list[float]:
    """Set and return every sample's score in [0, 1]: answer correctness (math/option) or the pass fraction of its
    tests (code), against ``tasks[traj.task_index]``.

    ``truncation_margin`` (RL only) marks responses within the margin of ``max_tokens`` as wrong.
    """
    rows = [tasks[t.task_index] for t in rollout]
    if data_type == "math" and rows and all("verifier" in r for r in rows):  # built-in puzzles: any right answer
        from reward.math import is_truncated
        from reward.puzzles import score_puzzle

        limit = max_tokens if truncation_margin is not None else None
        scores = [0.0 if is_truncated(len(t.response_ids), limit, truncation_margin or 0) else score_puzzle(t.text, r)
                  for t, r in zip(rollout, rows, strict=True)]
    elif data_type in ("math", "option"):
        lengths = [len(t.response_ids) for t in rollout]
        scores = score_math_batch([t.text for t in rollout], [r["ground_truth_answer"] for r in rows],
                                  data_type=data_type, response_lengths=lengths,
                                  max_tokens=max_tokens if truncation_margin is not None else None,
                                  truncation_margin=truncation_margin or 0)
    else:
        cfg = execute or SandboxConfig()
        jobs = [CodeJob.from_task(row, code_from_response(t.text, row.get("prefix", "")) or "", cfg.time_limit)
                for t, row in zip(rollout, rows, strict=True)]
        scores = [r.pass_fraction for r in run_many(jobs, config=cfg, progress=progress)] if jobs else []
    for traj, score in zip(rollout, scores, strict=True):
        traj.score = float(score)
    return scores


def seeded(params: Any, seed: int | None) -> Any:
    """A copy of sampler settings with ``seed`` set."""
    return replace(params, seed=seed)
