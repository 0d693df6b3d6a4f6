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
from data.formats import DataFormatError, load_dataset_file
from data.prompts import prompt_ids
from reward.math import is_truncated, score_math_batch
from reward.puzzles import score_puzzle
from reward.sandbox import CodeJob, SandboxConfig, SandboxFailure, code_from_response, run_many
from sample.engine import PromptTooLongError
from sample.generate import Rollout, generate, longest_prompt
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
    if not path.is_file() and Path(name).exists():  # a folder, or a file of another format, given by its path
        raise DataFormatError(f"dataset {name}: RL and eval data is a .json or .jsonl file (or the name of one "
                              f"under {data_dir}/, without its .json)")
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
        return (f"built-in: {', '.join(BUILTIN)}; downloadable (python -m tools.download_data --dataset NAME): "
                f"{', '.join(DATASETS)}")
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


def prompt_lengths(adapter: Adapter, tasks: list[dict], data_type: str, start_with_think: bool = False) -> list[int]:
    """Each task's prompt length in tokens, rendered as ``rollout_tasks`` renders it."""
    return [len(prompt_ids(adapter, task, data_type, start_with_think)) for task in tasks]


def prompt_room(section: str, adapter: Adapter, params: SamplingParams) -> tuple[int | None, str]:
    """The longest prompt the sampler takes with these settings below the model's positions (None: the model sets
    no limit) and those words for a message; a one-line error when the settings leave no room for any prompt."""
    longest = longest_prompt(adapter, params)
    if longest is None:
        return None, ""
    positions = adapter.position_limit
    if longest < 1:
        raise PromptTooLongError(f"{section}.max_tokens ({params.max_tokens}) leaves no room for a prompt below the "
                                 f"model's {positions} positions")
    room = (f"a block of {params.block_size or adapter.block_size}" if adapter.attention == "block" else
            f"a response canvas of {positions - longest} ({section}.max_tokens in whole blocks)")
    return longest, f"the model's positions ({positions}, less {room}: prompts up to {longest} tokens)"


def check_prompts_fit(section: str, adapter: Adapter, tasks: list[dict], data_type: str,
                      runs: list[SamplingParams], name: str) -> None:
    """Every prompt of ``tasks`` fits the model's positions with each of these sampler settings, checked before any
    sampling: one line saying how many do not (the sampler stops at the first of them, after the tasks before it;
    a resumed RL run at its first evaluation)."""
    lengths: dict[bool, list[int]] = {}
    for params in runs:
        longest, said = prompt_room(section, adapter, params)
        if longest is None:
            continue
        think = params.start_with_think
        lengths[think] = lengths.get(think) or prompt_lengths(adapter, tasks, data_type, think)
        if over := [n for n in lengths[think] if n > longest]:
            fix = "drop those rows" if adapter.attention == "block" else \
                f"lower {section}.max_tokens or drop those rows"
            raise PromptTooLongError(f"{len(over)} of {len(tasks)} prompts of {name} (up to {max(over)} tokens) do "
                                     f"not fit {said}: {fix}")


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
    """Set and return every sample's score in [0, 1]: answer correctness (math/option; a row with a ``verifier``,
    i.e. a built-in puzzle, accepts any right answer) or the pass fraction of its tests (code), against
    ``tasks[traj.task_index]``.

    ``truncation_margin`` (RL only) scores responses within the margin of ``max_tokens`` 0, whatever the data type
    (a truncated program is not run). A program the sandbox itself failed to run scores 0 and is marked
    ``meta["sandbox_error"]``: not a verdict on the program (``unscored_count`` counts them).
    """
    rows = [tasks[t.task_index] for t in rollout]
    limit = max_tokens if truncation_margin is not None else None
    scores = [0.0] * len(rollout)
    live = []
    for i, t in enumerate(rollout):
        if is_truncated(len(t.response_ids), limit, truncation_margin or 0):
            t.meta["truncated"] = True  # scored 0 by the length rule, not by its answer (a program: never run)
        else:
            live.append(i)
    if data_type == "code":
        _score_programs(rollout, rows, live, scores, execute or SandboxConfig(), progress)
    else:
        _score_answers(rollout, rows, live, scores, data_type)
    for traj, score in zip(rollout, scores, strict=True):
        traj.score = float(score)
    return scores


def _score_answers(rollout: list, rows: list[dict], live: list[int], scores: list[float], data_type: str) -> None:
    """Fill ``scores[i]``, i in ``live``: puzzles by their verifier, the rest by the math/option checker."""
    plain = []
    for i in live:
        if data_type == "math" and "verifier" in rows[i]:
            scores[i] = score_puzzle(rollout[i].text, rows[i])
        else:
            plain.append(i)
    if plain:
        checked = score_math_batch([rollout[i].text for i in plain], [rows[i]["ground_truth_answer"] for i in plain],
                                   data_type=data_type, truncation_margin=None)
        for i, score in zip(plain, checked, strict=True):
            scores[i] = score


def _score_programs(rollout: list, rows: list[dict], live: list[int], scores: list[float], cfg: SandboxConfig,
                    progress: bool) -> None:
    """Fill ``scores[i]``, i in ``live``, with the pass fraction of each program's tests in the sandbox."""
    jobs = [CodeJob.from_task(rows[i], code_from_response(rollout[i].text, rows[i].get("prefix", "")) or "",
                              cfg.time_limit) for i in live]
    results = run_many(jobs, config=cfg, progress=progress) if jobs else []
    for i, result in zip(live, results, strict=True):
        broken = [t.detail for t in result.tests if t.reason == "sandbox_error"]
        if broken:
            rollout[i].meta["sandbox_error"] = broken[0] or "sandbox_error"
        scores[i] = result.pass_fraction


def unscored_count(trajs: list) -> int:
    """Samples whose score is no verdict: the sandbox failed to run their program."""
    return sum("sandbox_error" in t.meta for t in trajs)


def check_sandbox_failures(trajs: list) -> None:
    """Raise ``SandboxFailure`` when the sandbox failed on more than half of the programs it was given (truncated
    responses are not run): a broken sandbox must stop the job, never become rewards of 0 that a policy learns
    from. A few failures (e.g. the host briefly out of processes) leave their samples marked, for the caller to
    drop or count."""
    bad = [t for t in trajs if "sandbox_error" in t.meta]
    ran = sum(not t.meta.get("truncated") for t in trajs)  # truncated programs were never given to the sandbox
    if bad and 2 * len(bad) > ran:
        detail = bad[0].meta["sandbox_error"].strip().splitlines() or ["no detail"]
        raise SandboxFailure(f"the code sandbox failed to run {len(bad)} of {ran} programs (first: "
                             f"{detail[-1][:200]}); check execute.isolation and the host's process limits")


def seeded(params: Any, seed: int | None) -> Any:
    """A copy of sampler settings with ``seed`` set."""
    return replace(params, seed=seed)
