"""The RL loop (rl.py): steps that train and write complete step directories, resume after SIGKILL, code RL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jobs.config import load_config
from models.tiny import save_tiny_checkpoint
from tests import warm

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "rl_harness.py"


def demo_args(out: Path, model: Path, base: str = "sdar", **over) -> list[str]:
    args = {"experiment.output_dir": out, "experiment.project": "run", "model.pretrained_model": model,
            "model.model_base": base, "experiment.total_step": 3, "experiment.save_every": 1,
            "experiment.eval_every": 0, "rollout.num_task_per_step": 3, "rollout.num_response_per_task": 4,
            "rollout.max_token": 8, "reward.acc_low": 0.0, "reward.acc_high": 1.0, "training.batch_size_lm": 4,
            "optimizer.params.learning_rate": 1e-2, "evaluation.num_response_per_task": 1,
            "evaluation.max_token": 8}
    args.update(over)
    return ["config=configs/demo/rl_demo.yaml", *(f"{k}={v}" for k, v in args.items())]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, demo_tokenizer):
    base = tmp_path_factory.mktemp("rl_ckpts")
    return {m: save_tiny_checkpoint(base / m, m, demo_tokenizer, size="test")
            for m in ("sdar", "llada", "sdar_moe", "llada2", "llada_moe")}


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir / "ckpt" / "policy" / "model.safetensors"))


def comparable(metrics: list[dict]) -> list[dict]:
    """Step metrics without wall-clock measurements."""
    return [{k: v for k, v in m.items() if k not in ("seconds", "tokens_per_second")} for m in metrics]


@pytest.mark.parametrize("base", ["sdar", "llada", "sdar_moe", "llada2", "llada_moe"])
def test_two_rl_steps_train_and_write_step_directories(tmp_path, ckpts, base, monkeypatch):
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    from jobs.rl import run_rl

    cfg = load_config(demo_args(tmp_path, ckpts[base], base, **{"experiment.total_step": 2,
                                                               "experiment.eval_every": 2}), "rl")
    history = run_rl(cfg, progress=False)
    run = tmp_path / "run"
    assert [m["step"] for m in history] == [0, 1, 2]
    for step in (1, 2):
        d = run / f"step_{step}"
        rollouts = [json.loads(line) for line in (d / "rollouts.jsonl").read_text().splitlines()]
        assert len(rollouts) == 12 and {r["group_id"] for r in rollouts} == {str(r["task_index"]) for r in rollouts}
        assert all(r["score"] == float(sum(r["response_ids"]) % 2) for r in rollouts)  # reward on its own sample
        m = json.loads((d / "metrics.json").read_text())
        assert m["optimizer_steps"] >= 1 and m["kept"] > 0 and (d / "ckpt" / "DONE").is_file()
    start = load_file(str(ckpts[base] / "model.safetensors"))
    end = weights(run / "step_2")
    assert max(float((start[k].float() - end[k].float()).abs().max()) for k in start) > 1e-4
    assert (run / "step_2" / "eval" / "results.jsonl").is_file() and (run / "curves.png").stat().st_size > 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert os.path.realpath(run / "ckpt" / "optimized") == os.path.realpath(run / "step_2" / "ckpt" / "policy")


def _harness(args: list[str], kill: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if kill:
        env["RL_HARNESS_KILL"] = kill
    # a process forked from a warm one; killed and resumed runs from another server than the uninterrupted run they
    # are compared with, so that the two never share a hash seed or an unseeded random state
    server = "interrupted" if kill or "experiment.start_from_scratch=false" in args else "main"
    return warm.run([str(HARNESS), *args], cwd=ROOT, env=env, timeout=600, server=server)


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path, ckpts):
    whole = tmp_path / "whole"
    proc = _harness(demo_args(whole, ckpts["sdar"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = comparable([json.loads(x) for x in (whole / "run" / "metrics.jsonl").read_text().splitlines()])
    final = weights(whole / "run" / "step_3")
    for kill in ("sample:2", "train:3", "save:2"):
        out = tmp_path / kill.replace(":", "_")
        killed = _harness(demo_args(out, ckpts["sdar"]), kill=kill)
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert not (out / "run" / f"step_{kill.split(':')[1]}").exists()  # the step in progress is only partial
        (out / "run" / "step_9.partial").mkdir()  # a corrupt leftover is discarded too
        resumed = _harness(demo_args(out, ckpts["sdar"], **{"experiment.start_from_scratch": "false"}))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        got = comparable([json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()])
        assert [m["step"] for m in got] == [1, 2, 3] and got == reference, kill
        assert all(torch.equal(final[k], v) for k, v in weights(out / "run" / "step_3").items()), kill
        assert not list((out / "run").glob("*.partial"))


def test_resume_refuses_a_changed_config_and_fresh_run_refuses_a_used_dir(tmp_path, ckpts, monkeypatch):
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    from core.files import RunDirError
    from jobs.rl import run_rl

    run_rl(load_config(demo_args(tmp_path, ckpts["sdar"], **{"experiment.total_step": 1}), "rl"), progress=False)
    with pytest.raises(RunDirError, match="not empty"):
        run_rl(load_config(demo_args(tmp_path, ckpts["sdar"]), "rl"), progress=False)
    changed = demo_args(tmp_path, ckpts["sdar"], **{"experiment.start_from_scratch": "false",
                                                    "rollout.temperature": 0.5})
    with pytest.raises(RunDirError, match="temperature. was 1.0 and is now 0.5"):
        run_rl(load_config(changed, "rl"), progress=False)


def answer_one_right(monkeypatch, right_text, rollout_size: int) -> list:
    """In every rollout of ``rollout_size`` samples, the second response (to the first task) becomes
    ``right_text(task)``; returns the list those samples are appended to (their sample_ids are renamed to dataset
    rows after sampling: read them at the end). Responses are never cut by the truncation rule (a random model runs
    every response to max_tokens, which that rule scores 0 before any checker sees it)."""
    import jobs.evaluate
    import jobs.rollout

    real_rollout, answered = jobs.evaluate.rollout_tasks, []

    def one_right_answer(adapter, tasks, data_type, params, indices=None, progress=True):
        rollout = real_rollout(adapter, tasks, data_type, params, indices, progress)
        if len(rollout) == rollout_size:
            lucky = rollout[1]
            lucky.text = right_text(tasks[lucky.task_index])
            answered.append(lucky)
        return rollout

    monkeypatch.setattr(jobs.evaluate, "rollout_tasks", one_right_answer)
    monkeypatch.setattr(jobs.rollout, "is_truncated", lambda length, limit, margin: False)
    return answered


def assert_only_that_sample_scores(rollouts: list[dict], answered: list) -> None:
    (lucky,) = answered
    assert len(rollouts) == 4 and lucky.sample_id.endswith("-1")
    assert sorted((r["sample_id"], r["score"]) for r in rollouts) == sorted(
        (r["sample_id"], 1.0 if r["sample_id"] == lucky.sample_id else 0.0) for r in rollouts)


def test_code_rl_step_through_the_sandbox(tmp_path, ckpts, monkeypatch):
    """One response is given its task's reference program: the sandbox passes it and the score lands on that sample
    only (a random model writes no program: the others score 0)."""
    from jobs.rl import run_rl

    answered = answer_one_right(monkeypatch, lambda task: f"```python\n{task['solution']}```", rollout_size=4)
    cfg = load_config(demo_args(tmp_path, ckpts["sdar"], **{
        "experiment.total_step": 1, "dataset.train_dataset": "builtin:code", "dataset.data_type": "code",
        "rollout.num_task_per_step": 2, "rollout.num_response_per_task": 2, "execute.num_chunk": 2,
        "reward.filter_all_equal": "false", "training.max_prompt_len": 512}), "rl")
    history = run_rl(cfg, progress=False)
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "step_1" / "rollouts.jsonl").read_text().splitlines()]
    assert_only_that_sample_scores(rollouts, answered)
    assert history[-1]["optimizer_steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(("config", "base", "kind"), [("cpu_ddp_2proc.yaml", "sdar", "MULTI_CPU"),
                                                     ("cpu_zero3_2proc.yaml", "sdar", "DEEPSPEED"),
                                                     ("cpu_zero3_2proc.yaml", "llada", "DEEPSPEED")])
def test_two_process_rl_keeps_ranks_identical(tmp_path, ckpts, config, base, kind):
    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RL_HARNESS_DUMP=str(tmp_path / "w"))
    args = demo_args(tmp_path, ckpts[base], base, **{"experiment.total_step": 2, "experiment.save_every": 2,
                                                     "experiment.eval_every": 2, "rollout.num_task_per_step": 4})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), "--main_process_port", str(_free_port()), str(HARNESS), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"w.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["num_processes"] == 2 and r["distributed_type"] == f"DistributedType.{kind}" for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"]
    run = tmp_path / "run"
    rollouts = [json.loads(x) for x in (run / "step_2" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 16 and len({r["sample_id"] for r in rollouts}) == 16  # both ranks' groups, once each
    assert all(r["score"] == float(sum(r["response_ids"]) % 2) for r in rollouts)
    start = load_file(str(ckpts[base] / "model.safetensors"))
    end = weights(run / "step_2")
    assert max(float((start[k].float() - end[k].float()).abs().max()) for k in start) > 1e-4
    if kind == "DEEPSPEED":  # whole weights were saved once: resume them in a single process, fresh optimizer
        more = _harness([*args, "experiment.start_from_scratch=false", "experiment.total_step=3"])
        assert more.returncode == 0 and "fresh optimizer state" in more.stdout, more.stderr[-3000:]
        assert json.loads((run / "step_3" / "metrics.json").read_text())["optimizer_steps"] >= 1


@pytest.mark.slow
def test_two_process_vrpo_trains_every_pair_of_every_group(tmp_path, ckpts):
    """VRPO pairs the correct and wrong responses of one task: under DDP each group stays on one process, so the
    pairs trained (summed over both ranks) are all the pairs the step's rollouts hold."""
    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RL_HARNESS_DUMP=str(tmp_path / "w"))
    args = demo_args(tmp_path, ckpts["sdar"], "sdar", **{"experiment.total_step": 1, "training.method": "vrpo",
                                                          "rollout.num_task_per_step": 6,
                                                          "training.mask_times_per_sample": 2})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_ddp_2proc.yaml"), "--main_process_port", str(_free_port()),
           str(HARNESS), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "step_1" / "rollouts.jsonl").read_text().splitlines()]
    signs: dict[str, list[int]] = {}
    for r in rollouts:
        if (adv := r["meta"]["advantage"]) is not None:  # None: the group was filtered out (all equal)
            signs.setdefault(r["group_id"], []).append((adv > 0) - (adv < 0))
    expected = sum(s.count(1) * s.count(-1) for s in signs.values())
    metrics = json.loads((tmp_path / "run" / "step_1" / "metrics.json").read_text())
    assert expected > 0 and metrics["pairs"] == expected


@pytest.mark.slow
def test_two_process_zero3_rl_trains_a_value_model_beside_the_policy(tmp_path, ckpts):
    """Value-guided TraceRL under DeepSpeed ZeRO-3: the value model gets an engine (and an Accelerator) of its own;
    both models train and stay identical across the ranks, and the value checkpoint is written whole."""
    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RL_HARNESS_DUMP=str(tmp_path / "w"))
    args = demo_args(tmp_path, ckpts["sdar"], "sdar", **{"experiment.total_step": 2, "experiment.save_every": 2,
                                                          "rollout.num_task_per_step": 4,
                                                          "model.value_base_model": ckpts["sdar"]})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_zero3_2proc.yaml"), "--main_process_port", str(_free_port()),
           str(HARNESS), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"w.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["distributed_type"] == "DistributedType.DEEPSPEED" for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["value_digest"] == ranks[1]["value_digest"]
    value = load_file(str(tmp_path / "run" / "step_2" / "ckpt" / "value" / "policy" / "model.safetensors"))
    assert float(value["value_head.weight"].abs().max()) > 0  # trained away from its zero init
    start = load_file(str(ckpts["sdar"] / "model.safetensors"))
    end = weights(tmp_path / "run" / "step_2")
    assert max(float((start[k].float() - end[k].float()).abs().max()) for k in start) > 1e-4


def test_the_schedules_count_training_rl_steps_whatever_the_filters_drop(tmp_path):
    """A decaying LR schedule spans the run's training RL steps, the value model's (trained every
    train_value_every RL steps) as the policy's. Counted in optimiser steps, it assumed every sample is trained:
    with samples_per_step and groups dropped for an equal reward, the cosine stopped a fraction of the way down."""
    from types import SimpleNamespace

    from jobs.rl import RLJob

    cfg = load_config(demo_args(tmp_path, tmp_path / "m", **{
        "experiment.total_step": 10, "experiment.train_value_every": 3, "model.value_base_model": tmp_path / "m",
        "training.samples_per_step": 4,
        "rollout.num_task_per_step": 4, "rollout.num_response_per_task": 4}), "rl")
    job = SimpleNamespace(cfg=cfg, acc=SimpleNamespace(num_processes=2))
    assert RLJob._schedule_steps(job) == 10
    assert RLJob._schedule_steps(job, every=3) == 3  # steps 3, 6 and 9


def test_a_resumed_value_model_is_loaded_in_the_runs_dtype(tmp_path, monkeypatch):
    """A fresh run builds the value model from value_base_model in model.dtype: its resume loads it in that dtype
    too (not float32, which would change its values and double its memory)."""
    from types import SimpleNamespace

    import jobs.rl
    from jobs.rl import RLJob

    class Loaded(Exception):
        pass

    def load_value_model(path, dtype=torch.float32):
        raise Loaded(path, dtype)

    monkeypatch.setattr(jobs.rl, "load_value_model", load_value_model)
    cfg = load_config(demo_args(tmp_path, tmp_path / "m", **{"model.value_base_model": str(tmp_path / "m"),
                                                             "model.dtype": "bfloat16"}), "rl")
    job = SimpleNamespace(cfg=cfg, run=SimpleNamespace(step=lambda i: tmp_path / f"step_{i}"))
    with pytest.raises(Loaded) as loaded:
        RLJob._value_trainer(job, resume_from=2)
    assert loaded.value.args == (tmp_path / "step_2" / "ckpt" / "value" / "policy", torch.bfloat16)


@pytest.mark.slow
def test_a_value_model_run_resumes_exactly_and_saves_each_optimizer_once(tmp_path, ckpts):
    """Outside DeepSpeed the value model shares the policy's Accelerator, whose state holds both optimizers: the
    policy's checkpoint saves them once, the value checkpoint keeps its weights and loop state only."""
    value = {"model.value_base_model": ckpts["sdar"]}
    whole = tmp_path / "whole"
    proc = _harness(demo_args(whole, ckpts["sdar"], **value))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = whole / "run" / "step_3" / "ckpt"
    assert sorted(p.name for p in (ckpt / "value" / "trainer").iterdir()) == ["loop.json"]
    assert sorted(p.name for p in (ckpt / "trainer").glob("optimizer*")) == ["optimizer.bin", "optimizer_1.bin"]
    out = tmp_path / "killed"
    killed = _harness(demo_args(out, ckpts["sdar"], **value), kill="train:3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _harness(demo_args(out, ckpts["sdar"], **value, **{"experiment.start_from_scratch": "false"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = [comparable([json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()])
               for d in (whole, out)]
    assert metrics[0] == metrics[1]
    for part in ("policy", "value/policy"):
        a, b = (load_file(str(d / "run" / "step_3" / "ckpt" / part / "model.safetensors")) for d in (whole, out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_samples_the_sandbox_failed_on_leave_their_group_and_a_broken_sandbox_stops_the_run(tmp_path, ckpts,
                                                                                         monkeypatch, capsys):
    import jobs.evaluate
    from jobs.rl import run_rl
    from reward.sandbox import SandboxFailure
    from tests import rl_harness

    def score_with_failures(rollout, tasks, data_type, **kw):  # the parity reward; the sandbox fails on some samples
        scores = rl_harness.parity_score(rollout, tasks, data_type)
        for t in rollout:
            if t.sample_id.endswith(tuple(failing)):
                t.score, t.meta["sandbox_error"] = 0.0, "fork: Resource temporarily unavailable"
        return scores

    monkeypatch.setattr(jobs.evaluate, "score_rollout", score_with_failures)
    failing = ["-0"]  # one sample of each group of 4
    history = run_rl(load_config(demo_args(tmp_path, ckpts["sdar"], **{
        "experiment.total_step": 1, "reward.filter_all_equal": "false"}), "rl"), progress=False)
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "step_1" / "rollouts.jsonl").read_text().splitlines()]
    assert history[-1]["dropped_by"]["sandbox_error"] == 3 and history[-1]["kept"] == 9
    assert "kept 9/12" in (out := capsys.readouterr().out) and "SANDBOX FAILED 3" in out  # on the step line
    for r in rollouts:
        if r["sample_id"].endswith("-0"):
            assert r["meta"]["advantage"] is None and r["meta"]["sandbox_error"]
    right = sum(sum(r["response_ids"]) % 2 for r in rollouts if not r["sample_id"].endswith("-0"))
    assert 0 < right < 9  # the step's reward and acc are over the 9 scored samples, not the 12
    assert history[-1]["reward"] == pytest.approx(right / 9) and history[-1]["acc"] == pytest.approx(right / 9)
    for gid in {r["group_id"] for r in rollouts}:  # z-scores over the group's three scored samples
        rest = [r for r in rollouts if r["group_id"] == gid and not r["sample_id"].endswith("-0")]
        scores = [float(sum(r["response_ids"]) % 2) for r in rest]
        mean = sum(scores) / 3
        std = (sum((s - mean) ** 2 for s in scores) / 3) ** 0.5
        for r, s in zip(rest, scores, strict=True):
            assert r["meta"]["advantage"] == pytest.approx((s - mean) / std if std > 1e-8 else 0.0)
    failing[:] = ["-0", "-1", "-2"]  # three of four: the sandbox is broken, not the programs
    with pytest.raises(SandboxFailure, match="failed to run 9 of 12 programs"):
        run_rl(load_config(demo_args(tmp_path / "again", ckpts["sdar"], **{"experiment.total_step": 1}), "rl"),
               progress=False)


def test_dynamic_sampling_keeps_a_redrawn_group_without_its_unscored_sample(tmp_path, ckpts, monkeypatch):
    import jobs.evaluate
    from jobs.rl import run_rl

    draws = []

    def score(rollout, tasks, data_type, **kw):  # the first draw ties every group; redraws split them 1 / 0
        draws.append(len(rollout))
        for t in rollout:
            t.score = 1.0 if len(draws) > 1 and t.sample_id.endswith("-1") else 0.0
            if t.sample_id.endswith("-0"):  # one program of each group of 3 the sandbox failed to run
                t.meta["sandbox_error"] = "setup failed"
        return [t.score for t in rollout]

    monkeypatch.setattr(jobs.evaluate, "score_rollout", score)
    m = run_rl(load_config(demo_args(tmp_path, ckpts["sdar"], **{
        "experiment.total_step": 1, "rollout.num_response_per_task": 3, "reward.filter_all_equal": "true",
        "rollout.dynamic_sampling_rounds": 2}), "rl"), progress=False)[-1]
    assert draws == [9, 9] and m["resample_rounds"] == 1
    assert (m["kept"], m["dropped"], m["dropped_by"]) == (6, 12, {"all_equal": 6, "sandbox_error": 6})
    rows = [json.loads(x) for x in (tmp_path / "run" / "step_1" / "rollouts.jsonl").read_text().splitlines()]
    trained = {r["sample_id"]: r["meta"]["advantage"] for r in rows if r["meta"]["advantage"] is not None}
    assert sorted(trained.values()) == [-1.0] * 3 + [1.0] * 3  # z-scores of (1, 0) in each redrawn group
    assert all(sid.endswith(("-1", "-2")) for sid in trained) and m["optimizer_steps"] >= 1


def test_rollouts_in_another_precision_than_training_recompute_the_old_log_probs(tmp_path, ckpts, monkeypatch,
                                                                               capsys):
    import torch

    import jobs.evaluate
    import jobs.rl
    from jobs.rl import run_rl
    from tests import rl_harness

    monkeypatch.setattr(jobs.evaluate, "score_rollout", rl_harness.parity_score)  # rewards that differ: it trains
    args = {"experiment.total_step": 1, "model.dtype": "float32", "training.mixed_precision": "no"}
    same = run_rl(load_config(demo_args(tmp_path / "same", ckpts["sdar"], **args), "rl"), progress=False)[-1]
    # fp32 both ways: the sampler's log-probs are the old ones
    assert same["optimizer_steps"] >= 1 and "sampler_logp_max_abs_diff" not in same
    # bf16 rollouts (as rollout.compute_dtype=bfloat16 gives where the CPU multiplies bf16), fp32 training
    monkeypatch.setattr(jobs.rl, "sampling_dtype", lambda adapter, params: torch.bfloat16)
    mixed = run_rl(load_config(demo_args(tmp_path / "mixed", ckpts["sdar"], **args), "rl"), progress=False)[-1]
    assert "note: rollouts compute in bfloat16 and training in float32; old log-probs are recomputed" in \
        capsys.readouterr().out
    assert "sampler_logp_max_abs_diff" in mixed  # recomputed (and compared) before the update
