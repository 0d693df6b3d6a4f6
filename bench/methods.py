"""Compare the RL algorithms of the registry on the same start: held-out accuracy before and after, time and memory.

    python -m bench.methods                          # every RL method x {arithmetic, countdown} x 3 seeds
    python -m bench.methods --quick                  # smoke run: 1 seed, 4 steps, arithmetic, a few minutes on CPU
    python -m bench.methods --methods tracerl,coupled --tasks countdown --seeds 5
    python -m bench.methods --report --out runs/bench_methods   # the table again, re-read from the run directories

The methods are read from the registry (``train.algorithms.RL_METHODS``) at run time, so an algorithm added there
is compared without touching this file. Every (method, task, seed) is a fresh RL job built from
``configs/demo/rl_demo.yaml`` with overrides, in its own run directory under ``--out``/runs, run in a child process.
Fairness: every job of a task starts from the same SFT model (the task's demo SFT start, ``START_MODELS``: arithmetic
from the RL demo's ``runs/sft_demo/ckpt/optimized``, Countdown from ``runs/sft_countdown/ckpt/optimized``, each
trained once on first use by the demo machinery, before any timed job; ``--model`` gives every task one start),
samples the same number of completions per step
(``rollout.num_task_per_step`` x ``rollout.num_response_per_task``, checked in each run's metrics), and for a given
seed draws the same training tasks and evaluates on the same held-out tasks (``experiment.seed`` keys both draws).
A method whose estimator refuses the default group baseline (``reward.advantage``) gets the first one it allows
(``Entry.advantages``); a method whose job fails at config load is reported as "refused: <its one-line error>".

Read from each run: the held-out accuracy at step 0 (before) and at the last step (after), from ``metrics.jsonl``;
seconds per RL step (sampling + advantages + training; the in-loop evaluation and checkpoint saving excluded; the
median over a run's steps, then the smallest over seeds, as other work on a shared machine only slows runs); peak
memory: on CPU the peak resident set of the job's process over the whole run (``os.wait4``'s ``ru_maxrss``: model,
optimizer, sampling and training together), on CUDA ``torch.cuda.max_memory_allocated`` in the job's process.
Statistics over seeds: mean +- sample standard deviation; the gain's 95% interval is mean +- t(0.975, n-1) * sd /
sqrt(n); a method is compared with TraceRL by Welch's two-sided t-test on the per-seed gains at the 5% level.
Outputs in ``--out`` (default runs/bench_methods/): ``results.json`` (every number), ``curves.png`` (held-out
accuracy over the steps, mean over seeds per method, one panel per task).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import train.algorithms as algorithms
from core.errors import UserError
from core.files import write_atomic

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = "configs/demo/rl_demo.yaml"
# Each task's SFT start, built on first use by the demo machinery (jobs/demo.py, SFT_DEMOS): from a start that
# never solves a task, every group ties and no method learns (the arithmetic start scores 0 on Countdown).
START_MODELS = {"arithmetic": "runs/sft_demo/ckpt/optimized", "countdown": "runs/sft_countdown/ckpt/optimized"}
BASELINE = "tracerl"
# The overrides that make a task. Countdown is the two-number kind (builtin:countdown2): no tiny demo model solves
# d1's three-number tasks after SFT (0 of 256 held-out samples), so every group would tie and nothing would be
# compared. Its prompts are ~110 tokens and its equations longer than the demo's arithmetic answers, so the prompt
# and answer limits grow with it.
TASKS: dict[str, list[str]] = {
    "arithmetic": ["dataset.train_dataset=builtin:arithmetic", "dataset.data_type=math",
                   "evaluation.eval_dataset=builtin:arithmetic", "evaluation.data_type=math"],
    "countdown": ["dataset.train_dataset=builtin:countdown2", "dataset.data_type=math",
                  "evaluation.eval_dataset=builtin:countdown2_test", "evaluation.data_type=math",
                  "training.max_prompt_len=192", "rollout.max_tokens=32", "training.max_gen_length=32",
                  "evaluation.max_tokens=32"],
}
# Two-sided 95% quantiles t(0.975, df) of Student's t for df = 1..30 (used when scipy is missing); above 30 the
# quantile of df = 30 is used, which errs wide (the normal's is 1.960).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class BenchError(UserError):
    """A bad argument of the benchmark (unknown method or task, too few seeds)."""


# ------------------------------------------------------------------------------------------ what runs


def selected_methods(spec: str | None) -> list[str]:
    """The registry names to compare: every RL method of the registry, or the comma-separated ``spec`` (any
    spelling the registry accepts; an SFT-only method is kept and shows up as refused)."""
    if not spec:
        return list(algorithms.RL_METHODS)  # read now: the registry is the list
    out = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        name = algorithms.canonical_method(word)
        if name is None:
            raise BenchError(f"--methods: unknown method {word!r}; the RL methods are "
                             f"{', '.join(algorithms.RL_METHODS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise BenchError("--methods names no method")
    return out


def selected_tasks(spec: str | None, quick: bool) -> list[str]:
    """The task names: ``spec`` (comma-separated), else arithmetic only for --quick, else all."""
    if not spec:
        return ["arithmetic"] if quick else list(TASKS)
    out = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in out if w not in TASKS]
    if unknown or not out:
        raise BenchError(f"--tasks: unknown task {(unknown or [spec])[0]!r}; expected some of {', '.join(TASKS)}")
    return out


def advantage_overrides(method: str, advantage: str) -> list[str]:
    """``reward.advantage=<first allowed>`` when ``method``'s estimator refuses the configured ``advantage``."""
    if not algorithms.advantage_refusal(method, advantage):
        return []
    return [f"reward.advantage={algorithms.REGISTRY[method].advantages[0]}"]


def job_argv(method: str, task: str, seed: int, args: argparse.Namespace, advantage: str) -> list[str]:
    """The rl.py arguments of one (method, task, seed) job."""
    project = f"{method}-{task}-seed{seed}"
    return [f"config={BASE_CONFIG}", f"model.pretrained_model={start_model(task, args)}",
            f"experiment.output_dir={Path(args.out) / 'runs'}", f"experiment.project={project}",
            "experiment.start_from_scratch=true", "experiment.overwrite=true",
            f"experiment.total_step={args.steps}", f"experiment.eval_every={args.eval_every}",
            f"experiment.save_every={args.steps}", "experiment.keep_checkpoints=1",
            # every job runs all its steps: a method (or task) whose groups all tie makes no update, a measured 0
            "experiment.max_idle_steps=0",
            f"experiment.seed={seed}", f"training.seed={seed}",
            f"rollout.num_task_per_step={args.tasks_per_step}", f"rollout.num_response_per_task={args.responses}",
            f"evaluation.num_response_per_task={args.eval_responses}",
            *TASKS[task], f"training.method={method}", *advantage_overrides(method, advantage)]


def config_refusal(argv: list[str]) -> str:
    """The one-line error of loading the job's config ("" when it loads)."""
    from core.loader import ConfigError
    from jobs.config import load_config

    try:
        load_config(argv, "rl")
    except (ConfigError, UserError) as err:
        return " ".join(str(err).split())
    return ""


# ------------------------------------------------------------------------------------------ one job


def start_model(task: str, args: argparse.Namespace) -> str:
    """The SFT start of ``task``'s jobs: ``--model`` when given, else the task's demo start."""
    return args.model or START_MODELS[task]


def ensure_start_model(model: str) -> None:
    """Build a demo SFT start once, before any timed job (its minutes must not count in the first job)."""
    if (REPO / model / "config.json").is_file():  # a relative path is the repository's, as the jobs run there
        return
    if Path(model).as_posix().rstrip("/") not in START_MODELS.values():  # only the demo's own starts are built
        raise BenchError(f"--model {model}: no checkpoint there (config.json missing)")
    code = ("from jobs.config import load_config; from jobs.demo import ensure_demo_model; ensure_demo_model("
            f"load_config(['config={BASE_CONFIG}', 'model.pretrained_model={model}'], 'rl').model)")
    if subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode != 0:
        raise BenchError(f"could not build the start model {model} (see the output above)")


def run_job(argv: list[str], log: Path) -> dict:
    """Run one RL job in a child process; returns its exit code, wall time, the last line of its output, the peak
    resident set of its process (MB) and, on CUDA, its peak allocated GPU memory (MB)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    # as bench/memory.py: freed tensor buffers go back to the OS, so the resident set follows live tensors
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bench.methods", "--child", *argv], cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN would mix the jobs)
        except BaseException:  # the benchmark interrupted or terminated: its job goes with it
            proc.terminate()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    result = next((json.loads(ln.removeprefix("RESULT ")) for ln in reversed(lines) if ln.startswith("RESULT ")), {})
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - start, "peak_rss_mb": usage.ru_maxrss / 1024,
            "cuda_peak_mb": result.get("cuda_peak_mb"), "last_line": lines[-1] if lines else ""}


def child(argv: list[str]) -> int:
    """The job's process: rl.py's job in-process, then its peak GPU memory on one line."""
    from core.entry import run_job as run_entry
    from jobs.config import load_config_or_exit

    cfg = load_config_or_exit("rl", argv)

    def job() -> None:
        import torch

        from jobs.rl import run_rl

        run_rl(cfg, progress=False)
        cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        print("RESULT " + json.dumps({"cuda_peak_mb": cuda}), flush=True)

    return run_entry(job)


def step_seconds(metrics: dict) -> float:
    """Seconds of one RL step without its evaluation and checkpoint saving (which not every step does)."""
    s = metrics["seconds"]
    return s["total"] - s.get("eval", 0.0) - s.get("save", 0.0)


def read_run(history: list[dict]) -> dict:
    """What the comparison needs of a run's ``metrics.jsonl`` lines: the held-out curve, before / after, s/step (the
    median over the steps: a step slowed by other work on the machine moves it little) and the completions
    sampled per step."""
    curve = [(m["step"], m["eval_acc"]) for m in history if "eval_acc" in m]
    if not curve or curve[0][0] != 0:
        raise ValueError("the run has no step-0 evaluation (experiment.eval_every must be > 0)")
    steps = [m for m in history if m["step"] > 0]
    return {"before": curve[0][1], "after": curve[-1][1], "curve": curve,
            "s_per_step": statistics.median(map(step_seconds, steps)) if steps else math.nan,
            "s_per_step_mean": sum(map(step_seconds, steps)) / len(steps) if steps else math.nan,
            "samples_per_step": sorted({m["samples"] for m in steps if "samples" in m})}


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ statistics


def t_quantile(df: float) -> float:
    """t(0.975, df): two-sided 95% quantile of Student's t (scipy when installed, else the table, df floored)."""
    try:
        from scipy import stats
    except ImportError:
        return T975[min(max(int(df), 1), len(T975)) - 1]
    return float(stats.t.ppf(0.975, df))


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for one value)."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return mean, sd


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t-interval (lo, hi); nan bounds for one value."""
    mean, sd = mean_sd(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
    return mean, mean - half, mean + half


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's t-test of mean(a) != mean(b): t, the Welch-Satterthwaite df, the 5% critical value, significance
    and (with scipy) the two-sided p-value. Needs two values on each side and some spread."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    va, vb = sa**2 / len(a), sb**2 / len(b)
    if len(a) < 2 or len(b) < 2 or va + vb == 0:
        return {"t": math.nan, "df": math.nan, "crit": math.nan, "p": math.nan, "significant": False}
    t = (ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    crit = t_quantile(df)
    try:
        from scipy import stats

        p = float(2 * stats.t.sf(abs(t), df))
    except ImportError:
        p = math.nan
    return {"t": t, "df": df, "crit": crit, "p": p, "significant": abs(t) > crit}


def summarise(runs: list[dict]) -> dict:
    """One (method, task) cell over its seeds: before / after mean and sd, gain mean and interval, peak memory (the
    largest), s/step (the smallest run's: the time of the least disturbed run, as benchmarks take the best of
    repeats; every run's is kept in ``runs``)."""
    before, after = [r["before"] for r in runs], [r["after"] for r in runs]
    gains = [r["after"] - r["before"] for r in runs]
    peaks = [r["cuda_peak_mb"] if r.get("cuda_peak_mb") is not None else r["peak_rss_mb"] for r in runs]
    gain, lo, hi = mean_interval(gains)
    return {"n": len(runs), "before": mean_sd(before), "after": mean_sd(after), "gains": gains,
            "gain": gain, "gain_lo": lo, "gain_hi": hi, "s_per_step": min(r["s_per_step"] for r in runs),
            "peak_mb": max(peaks)}


# ------------------------------------------------------------------------------------------ report


def _pm(pair: tuple[float, float]) -> str:
    mean, sd = pair
    return f"{mean:.3f}" if math.isnan(sd) else f"{mean:.3f}+-{sd:.3f}"


def _gain(cell: dict) -> str:
    if math.isnan(cell["gain_lo"]):
        return f"{cell['gain']:+.3f} (n=1)"
    return f"{cell['gain']:+.3f} [{cell['gain_lo']:+.3f}, {cell['gain_hi']:+.3f}]"


def _not_run(cell: dict) -> str:
    if "refused" in cell:
        return f"refused: {cell['refused']}"
    return f"failed: {cell['failed']}" if "failed" in cell else "not run yet"


HEADER = ("method", "task", "n", "before", "after", "gain [95% CI]", "s/step", "peak MB")


def format_table(cells: list[dict]) -> str:
    """The comparison table; ``cells`` hold method, task and either a summary or ``refused`` / ``failed``."""
    rows = [HEADER]
    for c in cells:
        if "summary" in c:
            s = c["summary"]
            rows.append((c["method"], c["task"], str(s["n"]), _pm(s["before"]), _pm(s["after"]), _gain(s),
                         f"{s['s_per_step']:.2f}", f"{s['peak_mb']:.0f}"))
        else:
            rows.append((c["method"], c["task"], "-", _not_run(c)))
    widths = [max(len(r[i]) for r in rows if len(r) == len(HEADER) or i < 3) for i in range(len(HEADER))]
    out = []
    for r in rows:
        if len(r) == len(HEADER):
            out.append(" | ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=True)).rstrip())
        else:  # a refused / failed cell: the message takes the rest of the line
            out.append(" | ".join([*(f"{v:<{w}}" for v, w in zip(r[:3], widths, strict=False)), r[3]]))
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def orderings(cells: list[dict], baseline: str = BASELINE) -> list[str]:
    """One line per (method, task) against the baseline: Welch's t-test on the per-seed gains, 5% two-sided."""
    by_key = {(c["method"], c["task"]): c for c in cells if "summary" in c}
    lines = []
    for (method, task), c in by_key.items():
        base = by_key.get((baseline, task))
        if method == baseline or base is None:
            continue
        a, b = c["summary"]["gains"], base["summary"]["gains"]
        test = welch(a, b)
        c["vs_baseline"] = test
        name = algorithms.REGISTRY[baseline].display or baseline
        head = f"{method} vs {name} on {task}: gain {sum(a) / len(a):+.3f} vs {sum(b) / len(b):+.3f}"
        if math.isnan(test["t"]):
            lines.append(f"{head}: not testable (needs >= 2 seeds each and some spread)")
            continue
        p = "" if math.isnan(test["p"]) else f", p={test['p']:.3f}"
        verdict = ("significant: " + (f"{method} better" if test["t"] > 0 else f"{baseline} better")
                   if test["significant"] else "not significant")
        lines.append(f"{head}: Welch t={test['t']:+.2f}, df={test['df']:.1f}{p} -> {verdict} (5%, two-sided)")
    return lines


def plot_curves(cells: list[dict], tasks: list[str], path: Path) -> None:
    """Held-out accuracy over the steps, mean over seeds per method, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for i, c in enumerate(c for c in cells if c["task"] == task and "summary" in c):
            curves = [dict(r["curve"]) for r in c["runs"]]
            steps = sorted(set.intersection(*(set(cu) for cu in curves)))
            # tab10 repeats after 10 methods: the line style tells the next ten apart
            ax.plot(steps, [sum(cu[s] for cu in curves) / len(curves) for s in steps], marker="o", label=c["method"],
                    color=f"C{i % 10}", linestyle=("-", "--", ":")[i // 10 % 3])
        ax.set_title(task)
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.methods", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 4 steps, 4 tasks per step, arithmetic")
    ap.add_argument("--methods", help="comma-separated subset (default: every RL method of the registry)")
    ap.add_argument("--tasks", help=f"comma-separated subset of {', '.join(TASKS)} (default: all; --quick: "
                    "arithmetic)")
    ap.add_argument("--seeds", type=int, help="seeds per (method, task), 1..n (default 3; --quick 1)")
    ap.add_argument("--steps", type=int, help="RL steps per job (default 20; --quick 4)")
    ap.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default 5; --quick 2)")
    ap.add_argument("--tasks-per-step", type=int, help="rollout.num_task_per_step (default 16; --quick 4)")
    ap.add_argument("--responses", type=int, default=8, help="rollout.num_response_per_task (default 8)")
    ap.add_argument("--eval-responses", type=int, help="samples per held-out task (default 4; --quick 2)")
    ap.add_argument("--model", help="the SFT start of every job (default: each task's demo SFT start, "
                    + ", ".join(f"{t}: {m}" for t, m in START_MODELS.items()) + ")")
    ap.add_argument("--out", default="runs/bench_methods", help="results.json, curves.png and the run directories")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: re-read the benchmark already in --out and print its table again")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.child:
        args.job_argv = rest
        return args
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    quick = args.quick
    for name, full, smoke in (("seeds", 3, 1), ("steps", 20, 4), ("eval_every", 5, 2), ("tasks_per_step", 16, 4),
                              ("eval_responses", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.out = str(Path(args.out).resolve())
    return args


def run_task(task: str, methods: list[str], args: argparse.Namespace, advantage: str, save=None) -> list[dict]:
    """Every (method, seed) of one task: per method a refused config, a failed job, or its runs and summary.
    Seed-major order (every method's seed 1, then seed 2, ...), so a change of the machine's load over the
    benchmark falls on every method alike; ``save(cells)`` after each job keeps partial results."""
    cells = []
    for method in methods:
        cell: dict = {"method": method, "task": task, "overrides": advantage_overrides(method, advantage), "runs": []}
        refusal = config_refusal(job_argv(method, task, 1, args, advantage))
        if refusal:
            cell["refused"] = refusal
        cells.append(cell)
    for seed in range(1, args.seeds + 1):
        for cell in (c for c in cells if "refused" not in c and "failed" not in c):
            method, name = cell["method"], f"{cell['method']}-{task}-seed{seed}"
            job = run_job(job_argv(method, task, seed, args, advantage), Path(args.out) / "logs" / f"{name}.log")
            metrics = Path(args.out) / "runs" / name / "metrics.jsonl"
            print(f"  {method} / {task} / seed {seed}: exit {job['rc']}, {job['wall_s']:.0f} s, "
                  f"peak RSS {job['peak_rss_mb']:.0f} MB", flush=True)
            if job["rc"] != 0 or not metrics.is_file():
                cell["failed"] = f"seed {seed}: {job['last_line']}"
            else:
                cell["runs"].append({"seed": seed, **job, **read_run(read_metrics(metrics))})
                cell["summary"] = summarise(cell["runs"])
            if save is not None:
                save(cells)
    for cell in cells:
        if "failed" in cell:
            cell.pop("summary", None)  # a method that failed on a seed is not compared on the others
    return cells


def write_results(args: argparse.Namespace, device: str, cells: list[dict], tasks: list[str]) -> tuple[str, list]:
    """results.json and curves.png of the cells so far; returns the table and the lines vs TraceRL."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table, lines = format_table(cells), orderings(cells)
    plot_curves(cells, tasks, out / "curves.png")
    settings = {k: v for k, v in vars(args).items() if k != "child"}
    write_atomic(out / "results.json", json.dumps(_json_safe({"settings": settings, "device": device, "cells": cells,
                                                              "table": table, "vs_baseline": lines}), indent=1))
    return table, lines


def reread(args: argparse.Namespace) -> tuple[str, list[dict], list[str]]:
    """--report: the device, cells and tasks of the benchmark already in ``--out``, every run re-read from its run
    directory (its exit code and peak memory from results.json); ``args`` takes that benchmark's settings."""
    out = Path(args.out)
    if not (out / "results.json").is_file():
        raise BenchError(f"--report: no results.json in {out}")
    old = json.loads((out / "results.json").read_text())
    for key, value in old["settings"].items():
        if key not in ("out", "report"):
            setattr(args, key, value)
    cells = []
    for cell in old["cells"]:
        runs = [{**r, **read_run(read_metrics(out / "runs" / f"{cell['method']}-{cell['task']}-seed{r['seed']}"
                                               / "metrics.jsonl"))} for r in cell.get("runs", [])]
        cell = {k: v for k, v in cell.items() if k not in ("summary", "vs_baseline")}
        cells.append({**cell, "runs": runs, **({"summary": summarise(runs)} if runs and "failed" not in cell else {})})
    return old["device"], cells, list(dict.fromkeys(c["task"] for c in cells))


def run_all(args: argparse.Namespace, device: str) -> tuple[list[dict], list[str]]:
    """Every job of the benchmark; returns the cells and the tasks."""
    methods, tasks = selected_methods(args.methods), selected_tasks(args.tasks, args.quick)
    print(f"methods (registry): {', '.join(methods)}; tasks: {', '.join(tasks)}; {args.seeds} seed(s); "
          f"{args.steps} steps, held-out evaluation every {args.eval_every}; {args.tasks_per_step} tasks x "
          f"{args.responses} completions per step", flush=True)
    for task in tasks:
        print(f"start of {task}: {start_model(task, args)}", flush=True)
        ensure_start_model(start_model(task, args))
    from jobs.config import load_config

    advantage = load_config([f"config={BASE_CONFIG}"], "rl").reward.advantage
    cells: list[dict] = []
    for task in tasks:
        done = list(cells)
        cells = done + run_task(task, methods, args, advantage,
                                save=lambda now, done=done: write_results(args, device, done + now, tasks))
    return cells, tasks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.job_argv)
    from bench import hardware_line

    if args.report:
        device, cells, tasks = reread(args)
    else:
        device = "cuda" if _cuda() else "cpu"
        print(hardware_line(device))
        cells, tasks = run_all(args, device)
    table, lines = write_results(args, device, cells, tasks)
    counts = {n for c in cells for r in c["runs"] for n in r["samples_per_step"]}
    print("\n" + table)
    print(f"completions sampled per step, every run: {sorted(counts)} "
          f"(expected {args.tasks_per_step * args.responses})")
    print(f"peak MB: {'peak allocated GPU memory' if device == 'cuda' else 'peak resident set of the job process'}; "
          "s/step: sampling + advantages + training (evaluation and saving excluded), the median over a run's steps, "
          "the smallest over seeds (the least disturbed run on a shared machine)")
    print("vs TraceRL (Welch t-test on per-seed gains):")
    print("\n".join(f"  {ln}" for ln in lines) or "  (nothing to compare)")
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'curves.png'}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cli(argv: list[str] | None = None) -> int:
    """The command line: a bad argument prints one line (``error: ...``) and exits 2."""
    from core.entry import run_job as run_entry

    code = [0]

    def job() -> None:
        code[0] = main(argv)

    return run_entry(job) or code[0]


if __name__ == "__main__":
    sys.exit(cli())
