"""Evaluation: sample a benchmark with one or more sampler settings, score every response once, report accuracy,
pass@k and lengths, write trajectories and a trace page. Used by eval.py and by the RL loop's in-loop evaluation.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.files import RunDirError, StagedRun, disk_full, write_atomic
from core.loader import ConfigError
from jobs.config import config_text
from jobs.demo import ensure_demo_model
from jobs.dist import barrier, default_device, is_main, rank_world
from jobs.rollout import (
    check_for_model,
    check_prompts_fit,
    check_sandbox_failures,
    load_tasks,
    rollout_tasks,
    score_rollout,
    seeded,
    unscored_count,
)
from models.registry import ModelLoadError, load_model
from sample.trace_viewer import build_trace_html
from sample.trajectory import Trajectory, tokens_per_step, write_jsonl

if TYPE_CHECKING:
    from models.registry import Adapter

TRACE_SAMPLES = 16


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_scored(adapter: Adapter, tasks: list[dict], data_type: str, params: Any, execute: Any, seed: int | None,
                  accelerator: Any = None, progress: bool = True, **score_kw: Any) -> tuple[list[Trajectory], dict]:
    """Sample and score every task, each process its share of the tasks (whole prompt groups); returns all
    trajectories in task order (on every process) and the summed sampling stats."""
    from train.accelerator import gather_objects  # accelerate is imported only when a job samples

    rank, world = rank_world(accelerator)
    mine = list(range(rank, len(tasks), world))
    run_seed = None if seed is None else seed + 1_000_003 * rank
    rollout = rollout_tasks(adapter, tasks, data_type, seeded(params, run_seed), indices=mine, progress=progress)
    score_rollout(rollout, tasks, data_type, execute=execute, progress=progress, **score_kw)
    trajs = gather_objects(accelerator, list(rollout))
    trajs.sort(key=lambda t: (t.task_index, int(t.sample_id.rpartition("-")[2])))
    check_sandbox_failures(trajs)  # on the gathered whole, so that every process decides alike
    stats = gather_objects(accelerator, [rollout.stats.as_dict()])
    total = {k: sum(s[k] for s in stats) for k in ("forwards", "denoise_forwards", "generated_tokens")}
    total["wall_time"] = max(s["wall_time"] for s in stats)
    total["tokens_per_second"] = total["generated_tokens"] / total["wall_time"] if total["wall_time"] > 0 else 0.0
    total["tokens_per_forward"] = total["generated_tokens"] / total["forwards"] if total["forwards"] else 0.0
    return trajs, total


def evaluate(adapter: Adapter, tasks: list[dict], data_type: str, rollout_cfg: Any, execute: Any, seed: int | None,
             out_dir: Path | None, name: str, accelerator: Any = None, progress: bool = True) -> list[dict]:
    """One metrics dict per sampler setting of ``rollout_cfg.runs()``; trajectories and a trace page are written
    to ``out_dir`` (main process) when given."""
    runs = rollout_cfg.runs()
    for params in runs:
        check_for_model("rollout", params, adapter)
    k = rollout_cfg.num_response_per_task
    stem = name.replace("builtin:", "builtin_").replace("/", "_")
    results = []
    for i, params in enumerate(runs):
        start = time.perf_counter()
        trajs, stats = sample_scored(adapter, tasks, data_type, params, execute, seed, accelerator, progress)
        tag = f"{stem}" if len(runs) == 1 else f"{stem}-{i}"
        setting = {"remasking_strategy": params.remasking_strategy, "top_k": params.top_k,
                   "block_size": params.block_size}
        metrics = {"dataset": name, "setting": setting, "tasks": len(tasks), "responses": len(trajs),
                   # acc = mean over all responses (not pass@k), as the reference reports it; code: all tests pass
                   "acc": sum(t.correct for t in trajs) / max(len(trajs), 1),
                   "mean_score": sum(t.score for t in trajs) / max(len(trajs), 1),
                   "avg_length": sum(len(t.response_ids) for t in trajs) / max(len(trajs), 1),
                   "tokens_per_step": tokens_per_step(t.step_map for t in trajs),
                   "finish_reasons": _count(t.finish_reason for t in trajs),
                   "sandbox_errors": unscored_count(trajs),  # scored 0 above: the sandbox failed, not the program
                   "sampling": stats, "wall_s": time.perf_counter() - start}
        for kk in rollout_cfg.pass_k:
            correct = [sum(t.correct for t in trajs[j * k:(j + 1) * k]) for j in range(len(tasks))]
            metrics[f"pass@{kk}"] = sum(pass_at_k(k, c, kk) for c in correct) / max(len(tasks), 1)
        results.append(metrics)
        if out_dir is not None and is_main(accelerator):
            with scores_kept_on_full_disk(out_dir, results, name):
                write_jsonl(trajs, out_dir / f"trajectories-{tag}.jsonl")  # whole records (step maps included)
                if rollout_cfg.output_unmasking_history:
                    write_atomic(out_dir / f"trace-{tag}.html",
                                 build_trace_html(list(trajs[:TRACE_SAMPLES]), adapter.tokenizer))
    return results


@contextlib.contextmanager
def scores_kept_on_full_disk(where: Path, results: list[dict], name: str) -> Iterator[None]:
    """Around writing results to ``where``: a full disk is one line that still gives the scores."""
    try:
        yield
    except OSError as err:
        if not disk_full(err, where):
            raise
        scores = ", ".join(f"acc {r['acc']:.3f} ({r['setting']['remasking_strategy']}, top_k "
                           f"{r['setting']['top_k']}, block {r['setting']['block_size'] or '-'})" for r in results)
        raise RunDirError(f"no space left on the device while writing {where}; not saved: {scores} on "
                          f"{name}") from None


def summary_table(results: list[dict]) -> str:
    """A fixed-width table of the runs (one line per sampler setting)."""
    pass_keys = sorted({k for r in results for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    head = (f"{'strategy':<24}{'top_k':>6}{'block':>6}{'acc':>8}" + "".join(f"{k:>9}" for k in pass_keys)
            + f"{'length':>8}{'tok/step':>9}{'tok/s':>9}")
    lines = [head]
    for r in results:
        s, samp = r["setting"], r["sampling"]
        lines.append(f"{s['remasking_strategy']:<24}{s['top_k']:>6}{str(s['block_size'] or '-'):>6}{r['acc']:>8.3f}"
                     + "".join(f"{r[k]:>9.3f}" for k in pass_keys)
                     + f"{r['avg_length']:>8.1f}{r['tokens_per_step']:>9.2f}{samp['tokens_per_second']:>9.1f}")
    unscored = sum(r.get("sandbox_errors", 0) for r in results)
    if unscored:
        lines.append(f"note: the sandbox failed to run {unscored} of {sum(r['responses'] for r in results)} programs; "
                     "they count as wrong above (sandbox_error in their trajectories)")
    return "\n".join(lines)


def run_eval(cfg: Any, progress: bool = True) -> list[dict]:
    """eval.py: evaluate ``cfg.model`` on ``cfg.dataset.eval_dataset``; the run directory appears, complete,
    only at the end (config.yaml and results.jsonl written together). Under a multi-process launcher the tasks
    are shared out by rank and the main process writes the results, in dataset order."""
    from core.entry import launched

    cfg.system.apply()
    acc = None
    if launched():
        from train.accelerator import build_accelerator

        acc = build_accelerator()
    main = is_main(acc)
    run = StagedRun(Path(cfg.experiment.output_dir) / cfg.experiment.project, cfg.experiment.overwrite) if main \
        else None
    try:
        if main:
            ensure_demo_model(cfg.model)
        barrier(acc)
        device = acc.device if acc is not None else default_device()
        adapter = load_model(cfg.model, device=device)
        for params in cfg.rollout.runs():
            check_for_model("rollout", params, adapter)
        tasks = load_tasks(cfg.dataset.eval_dataset, cfg.dataset.data_type, seed=cfg.experiment.seed,
                           n_builtin=cfg.dataset.builtin_size)
        check_prompts_fit("rollout", adapter, tasks, cfg.dataset.data_type, cfg.rollout.runs(),
                          cfg.dataset.eval_dataset)
        results = evaluate(adapter, tasks, cfg.dataset.data_type, cfg.rollout, cfg.execute,
                           cfg.experiment.seed, run.dir if run else None, cfg.dataset.eval_dataset,
                           accelerator=acc, progress=progress and main)
        for r in results:
            r["model"] = cfg.model.pretrained_model
        if run is not None:
            with scores_kept_on_full_disk(run.dir, results, cfg.dataset.eval_dataset):
                write_atomic(run.dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in results))
                write_atomic(run.dir / "config.yaml", config_text(cfg))
    except BaseException as err:
        if run is not None:
            run.abandon(_why(err))
        raise
    barrier(acc)
    if run is not None:
        run.commit()
    return results


def _why(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    if isinstance(err, (ConfigError, ModelLoadError)):
        return f"error: {err}"
    return f"{type(err).__name__}: {err}"


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out
