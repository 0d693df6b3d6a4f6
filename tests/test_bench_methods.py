"""bench/methods.py: the method list, the job arguments, the statistics and the table (no RL), and one tiny run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import bench.methods as bm
import train.algorithms as algorithms
from train.algorithms import Entry

REPO = Path(__file__).resolve().parents[1]


def _args(tmp_path, **kw):
    args = bm.parse_args(["--quick", "--out", str(tmp_path), *kw.pop("argv", [])])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


# ------------------------------------------------------------------------------------------ what runs


def test_methods_are_read_from_the_registry_at_call_time(monkeypatch):
    assert bm.selected_methods(None) == list(algorithms.RL_METHODS)
    registry = {**algorithms.REGISTRY, "newcomer": Entry("train.algorithms.tracerl")}
    monkeypatch.setattr(algorithms, "REGISTRY", registry)
    monkeypatch.setattr(algorithms, "RL_METHODS", (*algorithms.RL_METHODS, "newcomer"))
    monkeypatch.setattr(algorithms, "_BY_SPELLING", {**algorithms._BY_SPELLING, "newcomer": "newcomer"})
    assert bm.selected_methods(None)[-1] == "newcomer"
    assert bm.selected_methods("NEWCOMER,TraceRL,trace_rl") == ["newcomer", "tracerl"]


def test_bad_methods_tasks_and_counts_are_one_line_errors(tmp_path):
    with pytest.raises(bm.BenchError, match="unknown method 'ppo'"):
        bm.selected_methods("tracerl,ppo")
    with pytest.raises(bm.BenchError, match="unknown task 'sudoku'"):
        bm.selected_tasks("arithmetic,sudoku", quick=False)
    with pytest.raises(bm.BenchError, match="--seeds must be >= 1, got 0"):
        bm.parse_args(["--seeds", "0"])
    with pytest.raises(bm.BenchError, match="no checkpoint there"):
        bm.ensure_start_model(str(tmp_path / "missing"))
    with pytest.raises(bm.BenchError, match="--report: no results.json in"):
        bm.main(["--report", "--out", str(tmp_path)])
    assert bm.selected_tasks(None, quick=True) == ["arithmetic"]
    assert bm.selected_tasks(None, quick=False) == ["arithmetic", "countdown"]


def test_cli_prints_a_bad_method_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.methods", "--methods", "ppo"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --methods: unknown method 'ppo'")


def test_a_refused_default_advantage_becomes_the_first_allowed(monkeypatch):
    assert bm.advantage_overrides("tracerl", "grpo") == []
    monkeypatch.setattr(algorithms, "REGISTRY", {**algorithms.REGISTRY,
                                                 "tracerl": Entry("train.algorithms.tracerl",
                                                                  advantages=("rloo", "dr_grpo"))})
    assert bm.advantage_overrides("tracerl", "grpo") == ["reward.advantage=rloo"]
    assert bm.advantage_overrides("tracerl", "dr_grpo") == []


def test_job_arguments_load_for_both_tasks_and_fix_the_seed(tmp_path):
    args = _args(tmp_path)
    for task in bm.TASKS:
        argv = bm.job_argv("coupled", task, 2, args, "grpo")
        assert bm.config_refusal(argv) == ""
        from jobs.config import load_config

        cfg = load_config(argv, "rl")
        assert (cfg.training.method, cfg.experiment.seed, cfg.training.seed) == ("coupled", 2, 2)
        assert (cfg.experiment.total_step, cfg.experiment.eval_every, cfg.rollout.num_task_per_step) == (4, 2, 4)
        assert cfg.rollout.num_response_per_task == 8 and cfg.experiment.max_idle_steps == 0
        assert cfg.experiment.project == f"coupled-{task}-seed2"
        assert cfg.model.pretrained_model == bm.START_MODELS[task]  # each task starts from its own SFT model
    assert (cfg.dataset.train_dataset, cfg.evaluation.eval_dataset) == ("builtin:countdown2", "builtin:countdown2_test")
    assert cfg.training.max_prompt_len == 192  # countdown prompts are ~150 tokens
    assert bm.START_MODELS == {"arithmetic": "runs/sft_demo/ckpt/optimized",
                               "countdown": "runs/sft_countdown/ckpt/optimized"}
    args.model = "elsewhere/model"  # --model: one start for every task
    assert "model.pretrained_model=elsewhere/model" in bm.job_argv("tracerl", "countdown", 1, args, "grpo")


def test_an_sft_method_is_refused_at_config_load_and_not_run(tmp_path):
    (cell,) = bm.run_task("arithmetic", ["semi_ar"], _args(tmp_path), "grpo")
    assert "is an SFT method" in cell["refused"] and "summary" not in cell and cell["runs"] == []
    assert not (tmp_path / "runs").exists() and not (tmp_path / "logs").exists()


def test_read_run_takes_before_after_and_step_seconds_without_eval_and_save():
    history = [{"step": 0, "eval_acc": 0.25, "seconds": {"eval": 2.0, "total": 2.0}},
               {"step": 1, "samples": 32, "seconds": {"sample": 1.5, "train": 0.5, "eval": 1.0, "total": 3.0}},
               {"step": 2, "samples": 32, "eval_acc": 0.375,
                "seconds": {"sample": 3.0, "train": 1.0, "eval": 0.5, "save": 0.5, "total": 5.0}},
               {"step": 3, "samples": 32, "seconds": {"sample": 9.0, "train": 1.0, "total": 10.0}}]
    run = bm.read_run(history)
    assert (run["before"], run["after"], run["s_per_step"]) == (0.25, 0.375, 4.0)  # median of 2.0, 4.0, 10.0
    assert run["s_per_step_mean"] == pytest.approx(16.0 / 3)
    assert run["curve"] == [(0, 0.25), (2, 0.375)] and run["samples_per_step"] == [32]
    with pytest.raises(ValueError, match="no step-0 evaluation"):
        bm.read_run(history[1:])


# ------------------------------------------------------------------------------------------ statistics


def test_t_quantile_with_scipy_and_from_the_table(monkeypatch):
    assert bm.t_quantile(2) == pytest.approx(4.302653, abs=1e-5)
    assert bm.t_quantile(5) == pytest.approx(2.570582, abs=1e-5)
    assert 2.5706 < bm.t_quantile(4.959) < 2.7765  # a non-integer Welch df lies between its neighbours
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if scipy were not installed
    assert bm.t_quantile(2) == 4.303
    assert bm.t_quantile(4.959) == 2.776  # df floored to 4: wider, never narrower
    assert bm.t_quantile(100) == 2.042


def test_mean_interval_against_hand_values():
    mean, lo, hi = bm.mean_interval([0.1, 0.2, 0.3])
    half = 4.302653 * 0.1 / math.sqrt(3)  # sd = 0.1, t(0.975, 2)
    assert mean == pytest.approx(0.2) and lo == pytest.approx(0.2 - half) and hi == pytest.approx(0.2 + half)
    assert hi - lo == pytest.approx(0.496828, abs=1e-5)
    mean, lo, hi = bm.mean_interval([0.5])
    assert mean == 0.5 and math.isnan(lo) and math.isnan(hi)


def test_welch_against_hand_values_and_scipy():
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]
    test = bm.welch(a, b)
    # var(a)/3 = 1/3, var(b)/4 = (5/3)/4 = 5/12; t = (2 - 5.5) / sqrt(3/4); df = (3/4)^2 / ((1/3)^2/2 + (5/12)^2/3)
    assert test["t"] == pytest.approx(-3.5 / math.sqrt(0.75))
    assert test["df"] == pytest.approx(0.5625 / (1 / 18 + 25 / 432))
    from scipy import stats

    assert test["p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert test["significant"] and test["p"] < 0.05
    close = bm.welch([0.1, 0.2, 0.3], [0.15, 0.25, 0.35])
    assert not close["significant"] and close["p"] > 0.05
    assert math.isnan(bm.welch([0.1], [0.2, 0.3])["t"]) and not bm.welch([0.1], [0.2, 0.3])["significant"]


# ------------------------------------------------------------------------------------------ report


def _cell(method, gains, before=(0.25, 0.25, 0.25)):
    runs = [{"before": b, "after": b + g, "s_per_step": 2.5 - i / 2, "peak_rss_mb": 600.0 + i, "cuda_peak_mb": None,
             "curve": [(0, b), (4, b + g)]} for i, (b, g) in enumerate(zip(before, gains, strict=True))]
    return {"method": method, "task": "arithmetic", "runs": runs, "summary": bm.summarise(runs)}


def test_table_rows_and_orderings_vs_tracerl():
    cells = [_cell("tracerl", [0.1, 0.2, 0.3]), _cell("coupled", [-0.1, -0.2, -0.3]),
             {"method": "semi_ar", "task": "arithmetic", "refused": "training.method 'semi_ar' is an SFT method"}]
    lines = bm.format_table(cells).splitlines()
    assert lines[0].split(" | ") == ["method ", "task      ", "n", "before      ", "after       ",
                                     "gain [95% CI]          ", "s/step", "peak MB"]
    assert [v.strip() for v in lines[2].split(" | ")] == ["tracerl", "arithmetic", "3", "0.250+-0.000",
                                                          "0.450+-0.100", "+0.200 [-0.048, +0.448]", "1.50", "602"]
    assert lines[4] == "semi_ar | arithmetic | - | refused: training.method 'semi_ar' is an SFT method"
    pending = bm.format_table([{"method": "coupled", "task": "countdown", "runs": []}]).splitlines()[2]
    assert pending == "coupled | countdown | - | not run yet"
    (line,) = bm.orderings(cells)
    assert line.startswith("coupled vs TraceRL on arithmetic: gain -0.200 vs +0.200: Welch t=-4.90, df=4.0")
    assert line.endswith("-> significant: tracerl better (5%, two-sided)")


def test_one_seed_is_reported_but_not_tested():
    cells = [_cell("tracerl", [0.1], before=(0.25,)), _cell("random_masking", [0.2], before=(0.25,))]
    assert "+0.100 (n=1)" in bm.format_table(cells)
    assert bm.orderings(cells)[0].endswith("not testable (needs >= 2 seeds each and some spread)")


def test_plot_writes_a_png(tmp_path):
    bm.plot_curves([_cell("tracerl", [0.1, 0.2, 0.3])], ["arithmetic"], tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ a tiny run


def test_quick_run_of_one_method_from_a_tiny_model(tmp_path, demo_tokenizer):
    from models.tiny import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "model", "sdar", demo_tokenizer)
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bench.methods", "--quick", "--methods", "tracerl", "--steps", "1",
                           "--eval-every", "1", "--tasks-per-step", "2", "--responses", "2", "--eval-responses", "1",
                           "--model", str(model), "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0].startswith("hardware: ")
    result = json.loads((out / "results.json").read_text())
    (cell,) = result["cells"]
    history = [json.loads(x) for x in (out / "runs" / "tracerl-arithmetic-seed1" / "metrics.jsonl").read_text()
               .splitlines()]
    evals = [m["eval_acc"] for m in history if "eval_acc" in m]
    assert [m["step"] for m in history] == [0, 1] and len(evals) == 2
    run = cell["runs"][0]
    assert (run["before"], run["after"]) == (evals[0], evals[-1])
    assert run["samples_per_step"] == [4]  # 2 tasks x 2 completions
    assert run["peak_rss_mb"] > 100 and run["s_per_step"] > 0
    assert (out / "curves.png").is_file()
    (out / "curves.png").unlink()
    assert bm.main(["--report", "--out", str(out)]) == 0  # re-read: the same numbers, nothing run
    again = json.loads((out / "results.json").read_text())
    assert again["table"] == result["table"] and again["settings"]["steps"] == 1
    assert again["cells"][0]["runs"][0]["wall_s"] == run["wall_s"] and (out / "curves.png").is_file()
