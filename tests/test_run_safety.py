"""Run directories that nothing breaks: the lock, outputs re-derived on resume, fallback past an unreadable
checkpoint, moved directories, bounded disk use, degenerate settings, a full disk, interrupts, a storm of kills."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.files import RunDirError
from jobs.config import load_config
from models.tiny import save_tiny_checkpoint
from tests import warm
from tests.rl_harness import wait_for_hold
from tests.test_rl import _harness, comparable, demo_args, weights

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory, demo_tokenizer):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("safety") / "sdar", "sdar", demo_tokenizer, size="test")


@pytest.fixture
def rl(monkeypatch):
    """run_rl with the harness's stand-in reward: ``rl(out, model, **overrides)`` -> history."""
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    from jobs.rl import run_rl

    def run(out: Path, model: Path, **over):
        return run_rl(load_config(demo_args(out, model, **over), "rl"), progress=False)

    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _link_target(run: Path) -> Path:
    return Path(os.path.realpath(run / "ckpt" / "optimized"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith(("error:", "interrupted:", "terminated:"))]


# ------------------------------------------------------------------------------------------ lock


def test_a_live_run_directory_is_locked_and_a_dead_holders_lock_is_taken_over(tmp_path, model, rl):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from core.files import RunLock; RunLock(Path(sys.argv[1])); print('held', flush=True); "
                               "time.sleep(600)", str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "rl.py", *demo_args(tmp_path, model)], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert _error_lines(proc.stderr) == [f"error: run directory {run} is in use by a live run (pid {holder.pid}); "
                                             "wait for it to end, stop it, or choose another experiment.project"]
        for extra in ({"experiment.overwrite": "true"}, {"experiment.start_from_scratch": "false"}):
            with pytest.raises(RunDirError, match=f"in use by a live run \\(pid {holder.pid}\\)"):
                rl(tmp_path, model, **extra)
        assert [p.name for p in run.iterdir()] == [".lock"]  # nothing of the live run was touched
    finally:
        holder.kill()
        holder.wait()
    history = rl(tmp_path, model, **{"experiment.total_step": 1})  # the dead holder's lock is taken over
    assert [m["step"] for m in history] == [1]


# ------------------------------------------------------------------------------------------ resume


def test_resume_rederives_outputs_and_falls_back_past_an_unreadable_checkpoint(tmp_path, model, rl):
    whole = rl(tmp_path / "whole", model)
    run = tmp_path / "a" / "run"
    rl(tmp_path / "a", model)
    assert _link_target(run) == (run / "step_3" / "ckpt" / "policy").resolve()
    assert not list((run / "step_3" / "ckpt" / "trainer").glob("*.safetensors"))  # the weights are stored once
    # a kill right after the last rename: stale link, metrics and curves; resuming repairs them and runs no step
    os.replace(run / "ckpt" / "optimized", run / "ckpt" / "kept")
    (run / "ckpt" / "optimized").symlink_to(os.path.relpath(run / "step_2" / "ckpt" / "policy", run / "ckpt"))
    (run / "metrics.jsonl").write_text(json.dumps(whole[0]) + "\n")
    (run / "curves.png").unlink()
    history = rl(tmp_path / "a", model, **{"experiment.start_from_scratch": "false"})
    assert comparable(history) == comparable(whole) == comparable(_metrics(run))
    assert _link_target(run) == (run / "step_3" / "ckpt" / "policy").resolve() and (run / "curves.png").is_file()

    # a truncated newest policy checkpoint: one notice, the previous step resumes and step 3 is redone exactly
    policy = run / "step_3" / "ckpt" / "policy" / "model.safetensors"
    policy.write_bytes(policy.read_bytes()[:1000])
    rl(tmp_path / "a", model, **{"experiment.start_from_scratch": "false"})
    reference = weights(tmp_path / "whole" / "run" / "step_3")
    assert all(torch.equal(v, reference[k]) for k, v in weights(run / "step_3").items())
    # a truncated optimizer state likewise
    optim = run / "step_3" / "ckpt" / "trainer" / "optimizer.bin"
    optim.write_bytes(optim.read_bytes()[:-100])
    history = rl(tmp_path / "a", model, **{"experiment.start_from_scratch": "false"})
    assert comparable(history) == comparable(whole)


def test_a_truncated_checkpoint_is_named_in_one_notice(tmp_path, model, rl, capsys):
    run = tmp_path / "run"
    rl(tmp_path, model, **{"experiment.total_step": 2})
    optim = run / "step_2" / "ckpt" / "trainer" / "optimizer.bin"
    optim.write_bytes(optim.read_bytes()[:-100])
    capsys.readouterr()
    rl(tmp_path, model, **{"experiment.total_step": 2, "experiment.start_from_scratch": "false"})
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and "step 2 cannot be resumed (trainer/optimizer.bin:" in notes[0]
    assert "falling back to the step before it" in notes[0]


def test_a_moved_run_directory_resumes_and_old_checkpoints_are_pruned(tmp_path, model, rl):
    rl(tmp_path / "old", model, **{"experiment.total_step": 2, "experiment.keep_checkpoints": 2})
    shutil.move(tmp_path / "old" / "run", tmp_path / "new_place")
    history = rl(tmp_path, model, **{"experiment.project": "new_place", "experiment.total_step": 4,
                                     "experiment.keep_checkpoints": 2, "experiment.start_from_scratch": "false"})
    run = tmp_path / "new_place"
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [i for i in range(1, 5) if (run / f"step_{i}" / "ckpt").exists()] == [3, 4]
    assert all((run / f"step_{i}" / "rollouts.jsonl").is_file() for i in range(1, 5))  # logs are kept
    assert _link_target(run) == (run / "step_4" / "ckpt" / "policy").resolve()


def test_a_resume_that_starts_again_from_step_1_drops_the_discarded_steps_from_the_outputs(tmp_path, model, rl,
                                                                                          monkeypatch):
    """No checkpoint to resume from: the steps are discarded and the run starts again. Killed before its first new
    step completes, its metrics.jsonl and curves must not list the discarded steps."""
    import jobs.rl as rl_module

    rl(tmp_path, model, **{"experiment.total_step": 2})
    run = tmp_path / "run"
    for i in (1, 2):
        shutil.rmtree(run / f"step_{i}" / "ckpt")
    assert len(_metrics(run)) == 2

    def killed(self, step, d):
        raise KeyboardInterrupt

    monkeypatch.setattr(rl_module.RLJob, "one_step", killed)
    with pytest.raises(KeyboardInterrupt):
        rl(tmp_path, model, **{"experiment.total_step": 2, "experiment.start_from_scratch": "false"})
    assert _metrics(run) == [] and not (run / "ckpt" / "optimized").exists()


def test_a_kill_while_pruning_leaves_a_checkpoint_resume_skips(tmp_path, model, rl, monkeypatch):
    """Pruning deletes a checkpoint's DONE marker first: killed midway, the checkpoint says it is incomplete (a
    resume falls back past it) instead of complete with its optimizer state gone."""
    import jobs.rl as rl_module
    from jobs.checkpoint import checkpoint_problem

    rl(tmp_path, model, **{"experiment.total_step": 2})
    ckpt = tmp_path / "run" / "step_1" / "ckpt"
    assert checkpoint_problem(ckpt) is None

    def killed_midway(path, *args, **kwargs):
        gone = next(p for p in sorted(Path(path).rglob("*")) if p.is_file() and p.name != "DONE")
        gone.unlink()  # one file of the checkpoint gone, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(rl_module.shutil, "rmtree", killed_midway)
    monkeypatch.setattr("jobs.checkpoint.shutil.rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        rl_module.RunDir(tmp_path / "run").prune_checkpoints(1)
    assert checkpoint_problem(ckpt) is not None and checkpoint_problem(tmp_path / "run" / "step_2" / "ckpt") is None


# ------------------------------------------------------------------------------------------ degenerate settings


def test_too_few_tasks_and_prompts_over_the_limit(tmp_path, model, rl, capsys):
    with pytest.raises(RunDirError, match="has 64 usable tasks, fewer than rollout.num_task_per_step=65"):
        rl(tmp_path, model, **{"rollout.num_task_per_step": 65})
    with pytest.raises(RunDirError, match=r"no prompt of builtin:arithmetic fits training.max_prompt_len=3; the "
                                          r"shortest has \d+ tokens"):
        rl(tmp_path, model, **{"training.max_prompt_len": 3})


def test_tasks_over_max_prompt_len_are_never_drawn(tmp_path, model, rl, capsys):
    from data.prompts import prompt_ids
    from models.registry import load_model

    rows = [{"question": f"What is {i} + 1?" + (" Think about it carefully." * 4 if i % 2 else ""),
             "ground_truth_answer": str(i + 1)} for i in range(10)]
    data = tmp_path / "mixed.json"
    data.write_text(json.dumps(rows))
    adapter = load_model(load_config(demo_args(tmp_path, model), "rl").model, device="cpu")
    lengths = [len(prompt_ids(adapter, r, "math")) for r in rows]
    limit = max(lengths[0::2])
    assert limit < min(lengths[1::2])  # the even rows fit, the odd ones do not
    capsys.readouterr()
    history = rl(tmp_path, model, **{"training.max_prompt_len": limit, "experiment.total_step": 2,
                                     "dataset.train_dataset": str(data)})
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert notes == [f"note: 5 of 10 tasks of {data} have prompts over training.max_prompt_len={limit} and are "
                     "never drawn"]
    drawn = {json.loads(x)["task_index"] for i in (1, 2)
             for x in (tmp_path / "run" / f"step_{i}" / "rollouts.jsonl").read_text().splitlines()}
    assert drawn and all(i % 2 == 0 for i in drawn)
    assert all(m["kept"] == m["samples"] - m["dropped"] and m["optimizer_steps"] >= 1 for m in history)


def test_tasks_over_the_models_positions_are_never_drawn(tmp_path, model, rl, capsys):
    """A prompt that leaves no block of room below the model's positions would stop the run at the step that draws
    it (and again on resume): such tasks are left out at the start, as those over training.max_prompt_len are."""
    import shutil

    from data.prompts import prompt_ids
    from models.registry import load_model

    rows = [{"question": f"What is {i} + 1?" + (" Think about it carefully." * 4 if i % 2 else ""),
             "ground_truth_answer": str(i + 1)} for i in range(10)]
    data = tmp_path / "mixed.json"
    data.write_text(json.dumps(rows))
    short = shutil.copytree(model, tmp_path / "short")
    adapter = load_model(load_config(demo_args(tmp_path, model), "rl").model, device="cpu")
    lengths = [len(prompt_ids(adapter, r, "math")) for r in rows]
    positions = (max(lengths[0::2]) // 4 + 1) * 4  # block 4: prompts up to positions - 1 tokens leave a block
    assert positions - 1 < min(lengths[1::2])  # the even rows fit, the odd ones do not
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    capsys.readouterr()
    rl(tmp_path, short, **{"experiment.total_step": 2, "dataset.train_dataset": str(data)})
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert notes == [f"note: 5 of 10 tasks of {data} have prompts over the model's positions ({positions}, less a "
                     f"block of 4: prompts up to {positions - 1} tokens) and are never drawn"]
    drawn = {json.loads(x)["task_index"] for i in (1, 2)
             for x in (tmp_path / "run" / f"step_{i}" / "rollouts.jsonl").read_text().splitlines()}
    assert drawn and all(i % 2 == 0 for i in drawn)


def test_steps_without_an_update_stop_the_run(tmp_path, model, rl):
    # acc_low > acc_high keeps no group: every step trains nothing
    with pytest.raises(RunDirError, match=r"2 steps in a row \(steps 1..2\) made no optimizer update: every group "
                                          r"was filtered .*experiment.max_idle_steps=2"):
        rl(tmp_path, model, **{"reward.acc_low": 0.9, "reward.acc_high": 0.95, "experiment.max_idle_steps": 2})
    lines = _metrics(tmp_path / "run")
    assert [(m["step"], m["kept"], m["optimizer_steps"]) for m in lines] == [(1, 0, 0), (2, 0, 0)]


def test_the_idle_count_carries_over_a_resume(tmp_path, model, rl):
    # two idle steps, then a resume: the third idle step in a row stops the run (not the fifth)
    over = {"reward.acc_low": 0.9, "reward.acc_high": 0.95, "experiment.max_idle_steps": 3,
            "experiment.save_every": 1}
    rl(tmp_path, model, **over, **{"experiment.total_step": 2})
    with pytest.raises(RunDirError, match=r"3 steps in a row \(steps 1..3\) made no optimizer update"):
        rl(tmp_path, model, **over, **{"experiment.total_step": 5, "experiment.start_from_scratch": "false"})
    assert [m["step"] for m in _metrics(tmp_path / "run")] == [1, 2, 3]


# ------------------------------------------------------------------------------------------ full disk


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_step(tmp_path, model, rl, monkeypatch):
    import jobs.rl

    real = jobs.rl.save_checkpoint

    def full_at_step_2(trainer, ckpt, extra=None):
        if ckpt.parent.name == "step_2.partial":
            (ckpt / "policy").mkdir(parents=True)
            (ckpt / "policy" / "model.safetensors").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(trainer, ckpt, extra)

    monkeypatch.setattr(jobs.rl, "save_checkpoint", full_at_step_2)
    with pytest.raises(RunDirError, match=r"no space left on the device while writing .*step_2.partial \(.* MB free; "
                                          r"a save of this run needs about .* MB\)"):
        rl(tmp_path, model)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_1"]
    monkeypatch.setattr(jobs.rl, "save_checkpoint", real)
    assert [m["step"] for m in rl(tmp_path, model, **{"experiment.start_from_scratch": "false"})] == [1, 2, 3]


def test_an_interrupted_run_says_where_a_resume_continues_from(tmp_path):
    """A resume continues from the last checkpoint: the message says which, and that the steps logged after it are
    run again (it said "steps up to N are complete" with no checkpoint, and the resume started from step 1)."""
    from types import SimpleNamespace

    from jobs.rl import RLJob, RunDir

    job = object.__new__(RLJob)
    job.root, job.run = tmp_path, RunDir(tmp_path)
    job.cfg = SimpleNamespace(experiment=SimpleNamespace(save_every=3))

    def log_steps(*steps):
        for i in steps:
            (tmp_path / f"step_{i}").mkdir()
            (tmp_path / f"step_{i}" / "metrics.json").write_text("{}")

    assert job.interrupted_detail() == (f"no step completed in {tmp_path}; start it again with "
                                        "experiment.start_from_scratch=false")
    log_steps(1, 2)
    assert job.interrupted_detail() == (f"steps up to 2 are logged in {tmp_path} but none is checkpointed "
                                        "(experiment.save_every=3): a resume starts again from step 1; continue "
                                        "with experiment.start_from_scratch=false")
    (tmp_path / "step_2" / "ckpt").mkdir()
    (tmp_path / "step_2" / "ckpt" / "DONE").write_text("")
    assert job.interrupted_detail() == (f"the last checkpoint in {tmp_path} is step 2; continue with "
                                        "experiment.start_from_scratch=false")
    log_steps(3, 4)
    assert job.interrupted_detail() == (f"the last checkpoint in {tmp_path} is step 2; steps 3..4 are run again; "
                                        "continue with experiment.start_from_scratch=false")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


def test_a_real_full_disk_through_rl_py(tmp_path, model):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("needs root and tmpfs mounts (a stubbed writer covers the same path in-process)")
    try:
        args = demo_args(disk, model, **{"experiment.total_step": 1})
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "rl_harness.py"), *args], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = _error_lines(proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: no space left on the device while writing "), lines
        assert not list((disk / "run").glob("*.partial"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = _harness([*args, "experiment.start_from_scratch=false"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert (disk / "run" / "step_1" / "ckpt" / "DONE").is_file()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ------------------------------------------------------------------------------------------ signals


def test_sigint_during_the_step0_evaluation_then_resume(tmp_path, model):
    args = demo_args(tmp_path, model, **{"experiment.eval_every": 1, "evaluation.num_response_per_task": 8,
                                         "evaluation.max_token": 64, "experiment.total_step": 1})

    def default_sigint():  # a launcher may have left SIGINT ignored (nohup, `&`): this child must take it
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    held = tmp_path / "inside_the_evaluation"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rl_harness.py"), *args], cwd=ROOT,
                            env={**_env(), "RL_HARNESS_HOLD": str(held)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    wait_for_hold(held, proc)  # the step-0 evaluation's sampling holds until the signal
    assert (tmp_path / "run" / "step_0.partial").is_dir()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert _error_lines(err) == [f"interrupted: no step completed in {tmp_path / 'run'}; start it again with "
                                 "experiment.start_from_scratch=false"]
    resumed = _harness([*args, "experiment.start_from_scratch=false"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "holds no complete checkpoint yet; the run starts again" in resumed.stdout
    assert [m["step"] for m in _metrics(tmp_path / "run")] == [0, 1]


# ------------------------------------------------------------------------------------------ kill storm


@pytest.mark.slow
def test_a_storm_of_kills_ends_where_an_uninterrupted_run_ends(tmp_path, model):
    over = {"experiment.total_step": 4, "experiment.eval_every": 2, "experiment.save_every": 1}
    whole = tmp_path / "whole"
    assert _harness(demo_args(whole, model, **over)).returncode == 0
    rng = random.Random(20261125)
    stages = ("sample", "train", "save", "after")
    points = rng.sample([(s, i) for i in range(1, 5) for s in stages], 3)
    kills = sorted(points, key=lambda k: (k[1], stages.index(k[0])))
    if ("after", 4) not in kills:
        kills.append(("after", 4))  # the last step renamed, the run's outputs not yet
    out = tmp_path / "storm"
    for n, (stage, step) in enumerate(kills):
        resume = {"experiment.start_from_scratch": "false"} if n else {}
        killed = _harness(demo_args(out, model, **over, **resume), kill=f"{stage}:{step}")
        assert killed.returncode == -9, (stage, step, killed.stderr[-3000:])
    final = _harness(demo_args(out, model, **over, **{"experiment.start_from_scratch": "false"}))
    assert final.returncode == 0, final.stderr[-3000:]
    a, b = whole / "run", out / "run"
    assert comparable(_metrics(a)) == comparable(_metrics(b)), kills
    assert os.path.relpath(_link_target(b), b) == os.path.relpath(_link_target(a), a) == "step_4/ckpt/policy"
    end_a, end_b = load_file(str(a / "step_4/ckpt/policy/model.safetensors")), weights(b / "step_4")
    assert all(torch.equal(end_a[k], v) for k, v in end_b.items())
    assert (a / "curves.png").read_bytes() == (b / "curves.png").read_bytes()
    assert not list(b.glob("*.partial"))


def test_a_staged_evaluation_run_is_locked_while_it_runs(tmp_path):
    from core.files import StagedRun

    first = StagedRun(tmp_path / "eval")
    with pytest.raises(RunDirError, match=f"in use by a live run \\(pid {os.getpid()}\\)"):
        StagedRun(tmp_path / "eval", overwrite=True)  # would have removed the live run's partial folder
    (first.dir / "results.jsonl").write_text("{}\n")
    first.commit()
    second = StagedRun(tmp_path / "eval", overwrite=True)  # released at commit
    second.abandon("interrupted")
    assert (tmp_path / "eval" / "results.jsonl").read_text() == "{}\n"
    with pytest.raises(RunDirError, match="is not empty"):
        StagedRun(tmp_path / "eval")  # refused at once: no partial folder of its own is left behind
    assert sorted(p.name for p in (tmp_path / "eval.partial").iterdir()) == [".lock", "INTERRUPTED"]  # the earlier
    shutil.rmtree(tmp_path / "eval.partial")
    with pytest.raises(RunDirError, match="is not empty"):
        StagedRun(tmp_path / "eval")
    assert not (tmp_path / "eval.partial").exists()


def test_an_evaluation_never_overwrites_a_live_run_of_its_directory(tmp_path):
    """An RL or SFT run holds the lock of its own directory (not of a .partial one): an eval's overwrite of that
    directory is refused while it lives, and takes the lock itself until its commit."""
    from core.files import RunLock, StagedRun

    live = RunLock(tmp_path / "run")
    (tmp_path / "run" / "step_1").mkdir()
    with pytest.raises(RunDirError, match=f"run directory {tmp_path / 'run'} is in use by a live run"):
        StagedRun(tmp_path / "run", overwrite=True)
    assert (tmp_path / "run" / "step_1").is_dir() and not (tmp_path / "run.partial").exists()
    live.release()
    staged = StagedRun(tmp_path / "run", overwrite=True)  # the partial folder's lock was released on the refusal
    with pytest.raises(RunDirError, match="in use by a live run"):
        RunLock(tmp_path / "run")  # no run starts there before the eval's commit
    staged.commit()
    assert not (tmp_path / "run" / "step_1").exists()
    RunLock(tmp_path / "run").release()


# ------------------------------------------------------------------------------------------ SFT runs


def test_sft_is_locked_stores_its_weights_once_and_reports_a_full_disk(tmp_path, model, monkeypatch):
    import jobs.sft
    from core.files import RunLock
    from jobs.sft import run_sft
    from tests.test_sft import sft_args

    args = sft_args(tmp_path, model, **{"training.max_steps": 4, "training.save_every": 2})
    held = RunLock(tmp_path / "sft")
    with pytest.raises(RunDirError, match=f"in use by a live run \\(pid {os.getpid()}\\)"):
        run_sft(load_config(args, "sft"), progress=False)
    held.release()
    out = run_sft(load_config(args, "sft"), progress=False)
    last = tmp_path / "sft" / "ckpt" / "last"
    assert not list((last / "trainer").glob("*.safetensors"))
    assert (out / "model.safetensors").stat().st_ino == (last / "policy" / "model.safetensors").stat().st_ino

    def full(trainer, ckpt, extra=None):
        (ckpt / "policy").mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jobs.sft, "save_checkpoint", full)
    with pytest.raises(RunDirError, match=r"no space left on the device while writing .*last.partial"):
        run_sft(load_config([*args, "experiment.overwrite=true"], "sft"), progress=False)
    assert not (tmp_path / "sft" / "ckpt" / "last.partial").exists()


def test_an_overwrite_that_fails_its_setup_keeps_the_old_run(tmp_path, model, rl):
    from jobs.rollout import load_tasks  # noqa: F401 - the error below comes from it
    from jobs.sft import run_sft
    from tests.test_sft import sft_args

    rl(tmp_path, model, **{"experiment.total_step": 1, "experiment.save_every": 1})
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(FileNotFoundError, match="no_such_set"):  # found while setting up, after the run-dir check
        rl(tmp_path, model, **{"experiment.overwrite": "true", "dataset.train_dataset": "no_such_set"})
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before
    args = sft_args(tmp_path, model, **{"training.max_steps": 1})
    run_sft(load_config(args, "sft"), progress=False)
    sft_before = sorted((tmp_path / "sft").rglob("*"))
    with pytest.raises(Exception, match="no_such_set"):
        run_sft(load_config([*args, "experiment.overwrite=true", "dataset.optimization_data=no_such_set"], "sft"),
                progress=False)
    assert sorted((tmp_path / "sft").rglob("*")) == sft_before


# ------------------------------------------------------------------------------------------ non-finite values


def test_non_finite_settings_are_refused_naming_the_key():
    from core.loader import ConfigError

    for override, key in [("optimizer.params.learning_rate=.nan", "optimizer.params.learning_rate"),
                          ("optimizer.params.learning_rate=.inf", "optimizer.params.learning_rate"),
                          ("rollout.temperature=.nan", "rollout.temperature"),
                          ("reward.acc_low=-.inf", "reward.acc_low")]:
        with pytest.raises(ConfigError, match=f"key '{key}': .* must be a finite number"):
            load_config(["config=configs/demo/rl_demo.yaml", override], "rl")
    for override, why in [("optimizer.params.learning_rate=0", "learning_rate must be > 0.0"),
                          ("optimizer.params.value_learning_rate=0", "value_learning_rate must be > 0.0"),
                          ("rollout.num_response_per_task=1", "a group of one has advantage 0")]:
        with pytest.raises(ConfigError, match=why):
            load_config(["config=configs/demo/rl_demo.yaml", override], "rl")


def test_an_overflowing_rl_run_stops_at_the_step_and_saves_nothing_non_finite(tmp_path, model):
    # a finite but absurd learning rate: after the first of three optimizer steps of RL step 1 the weights are
    # ~1e30 and the next loss overflows
    args = demo_args(tmp_path, model, **{"optimizer.params.learning_rate": 1e30, "training.samples_per_step": 4})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "rl_harness.py"), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: training step 1: the loss is nan; the likely cause is a "
                                                   "learning rate too high"), lines
    run = tmp_path / "run"
    assert not (run / "step_1").exists() and not (run / "ckpt" / "optimized").exists()


def test_an_update_beyond_the_weights_dtype_is_one_line(tiny):
    from tests.test_train_trainer import fake_batch, make_trainer
    from train.trainer import NonFiniteError

    adapter = tiny("sdar", seed=1)
    trajs = fake_batch(adapter, n=4)
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    trainer = make_trainer(adapter, learning_rate=1e38)  # AdamW's first update is ~lr per weight: beyond fp32
    with pytest.raises(NonFiniteError, match=r"^training step \d+: the optimizer update at learning rate 1e\+38 "
                                             r"overflows the weights' dtype"):
        trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    after = adapter.model.state_dict()
    assert all(bool(torch.isfinite(after[k]).all()) for k in before)


def test_an_overflowing_sft_run_never_writes_its_model(tmp_path, model):
    from tests.test_sft import sft_args

    args = sft_args(tmp_path, model, **{"optimizer.params.learning_rate": 1e30, "training.save_every": 1})
    proc = subprocess.run([sys.executable, "train/sft_sdar.py", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "training step 2: the loss is nan" in lines[0], lines
    ckpt = tmp_path / "sft" / "ckpt"
    assert not (ckpt / "optimized").exists()  # no final model
    saved = load_file(str(ckpt / "last" / "policy" / "model.safetensors"))  # step 1's weights: huge, but finite
    assert all(bool(torch.isfinite(t).all()) for t in saved.values())


# ------------------------------------------------------------------------------------------ command-line corners


def test_config_check_without_files_prints_usage():
    proc = subprocess.run([sys.executable, "-m", "tools.check_config"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python -m tools.check_config ")
    assert "required: CONFIG.yaml" in proc.stderr.splitlines()[-1]


def test_mistyped_dataset_names_suggest_the_closest():
    from core.loader import ConfigError
    from jobs.rollout import load_tasks

    with pytest.raises(ConfigError, match=r"key 'dataset.eval_dataset': unknown built-in dataset 'builtin:arithmetc' "
                                          r"\(closest: 'builtin:arithmetic'\)"):
        load_config(["config=configs/demo/eval_demo.yaml", "dataset.eval_dataset=builtin:arithmetc"], "eval")
    with pytest.raises(ConfigError, match="key 'dataset.train_dataset': .*closest: 'builtin:code'"):
        load_config(["config=configs/demo/rl_demo.yaml", "dataset.train_dataset=builtin:cod"], "rl")
    with pytest.raises(FileNotFoundError, match=r"closest: 'MATH500' \(python -m tools.download_data --dataset "
                                                r"MATH500\)"):
        load_tasks("MATH50", "math", data_dir="/nonexistent")
    with pytest.raises(FileNotFoundError, match="run: python -m tools.download_data --dataset GSM8K"):
        load_tasks("GSM8K", "math", data_dir="/nonexistent")


def test_an_output_directory_under_a_regular_file_is_one_line(tmp_path, model, rl):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RunDirError, match=f"cannot create the run directory .*: {tmp_path / 'a_file'} is a file"):
        rl(tmp_path / "a_file" / "sub", model)


def test_errors_name_the_key_as_the_user_wrote_it(tmp_path):
    from core.loader import ConfigError

    demo = "configs/demo/eval_demo.yaml"  # written in the code's words (max_tokens, denoising_steps)
    with pytest.raises(ConfigError, match="key 'rollout.denoising_steps_per_block': denoising_steps_per_block must"):
        load_config([f"config={demo}", "rollout.denoising_steps_per_block=0"], "eval")
    with pytest.raises(ConfigError, match="key 'rollout.denoising_steps': denoising_steps must"):
        load_config([f"config={demo}", "rollout.denoising_steps=0"], "eval")  # the override uses the code's name
    yaml_file = tmp_path / "eval_ref.yaml"
    text = Path(demo).read_text()
    assert "  max_tokens: " in text
    yaml_file.write_text(text.replace("  max_tokens: ", "  max_token: -1 #"))  # the reference's spelling
    with pytest.raises(ConfigError, match="key 'rollout.max_token': max_token must be >= 1"):
        load_config([f"config={yaml_file}"], "eval")


def _viewer(args: list[str], fresh: bool = False) -> subprocess.CompletedProcess:
    """The viewer's command in a fresh interpreter, or forked from a warm one (tests/warm.py) for the error cases."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "tools.trace_viewer", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    return warm.run(["-m", "tools.trace_viewer", *args], cwd=ROOT, timeout=120)


def test_trace_viewer_command_line_corners(tmp_path, demo_tokenizer):
    tok = tmp_path / "tok"
    demo_tokenizer.save_pretrained(tok)
    row = {"prompt_ids": [5, 6], "response_ids": [7, 8], "step_map": [1, 2], "logprobs": [-0.1, -0.2]}

    def write(name: str, **change) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({**row, **change}) + "\n")
        return path

    good = write("good.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "not_tok").mkdir()
    (tmp_path / "not_tok" / "tokenizer_config.json").write_text("{broken")
    cases = [
        ([f"--trajectories={write('text_id.jsonl', response_ids=[7, 'x'])}"], "text_id.jsonl"),
        ([f"--trajectories={write('float_id.jsonl', response_ids=[7, 8.5])}"], "field 'response_ids' holds 8.5"),
        ([f"--trajectories={latin}"], f"--trajectories {latin}: not UTF-8"),
        ([f"--trajectories={good}", f"--out={tmp_path / 'a_dir'}"], f"--out {tmp_path / 'a_dir'}: is a directory"),
        ([f"--trajectories={write('oov.jsonl', response_ids=[7, 99999])}"], "token id 99999, outside the vocabulary"),
        ([f"--trajectories={good}", f"--tokenizer={tmp_path / 'not_tok'}"], "not a valid JSON tokenizer config"),
    ]
    for extra, culprit in cases:
        args = [f"--tokenizer={tok}", f"--out={tmp_path / 'out.html'}", *extra]
        proc = _viewer(args)
        lines = [x for x in proc.stderr.splitlines() if "error:" in x]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (extra, proc.stderr[-1500:])
        assert len(lines) == 1 and culprit in lines[0], (extra, proc.stderr)
    done = _viewer([f"--trajectories={good}", f"--tokenizer={tok}", f"--out={tmp_path / 'ok.html'}"], fresh=True)
    assert done.returncode == 0 and (tmp_path / "ok.html").stat().st_size > 0
    assert "to instantiate a model of type" not in done.stderr  # the tokenizer loads as the jobs load it


def test_a_prompt_longer_than_the_model_positions_is_one_line(tmp_path, model, capsys, monkeypatch):
    """Checked before any sampling (the sampler stopped at the first such prompt, after the tasks before it)."""
    import eval as eval_entry
    import jobs.evaluate

    monkeypatch.setattr(jobs.evaluate, "rollout_tasks", lambda *a, **k: pytest.fail("sampled"))
    data = tmp_path / "long.json"
    data.write_text(json.dumps([{"question": "2 + 2?", "ground_truth_answer": "4"},
                                {"question": "word " * 3000, "ground_truth_answer": "1"}]))
    code = eval_entry.main(["config=configs/demo/eval_demo.yaml", f"model.pretrained_model={model}",
                            f"dataset.eval_dataset={data}", f"experiment.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:") or "error:" in x]
    assert code == 2 and "Traceback" not in err and len(lines) == 1
    assert re.search(rf"error: 1 of 2 prompts of {re.escape(str(data))} \(up to \d+ tokens\) do not fit the model's "
                     r"positions \(4096, less a block of 4: prompts up to 4095 tokens\): drop those rows$", lines[0])
    assert not (tmp_path / "out" / "eval_demo").exists()


def test_a_run_from_before_a_new_config_section_resumes(tmp_path, model, rl):
    import yaml

    rl(tmp_path, model, **{"experiment.total_step": 1})
    saved = tmp_path / "run" / "config.yaml"
    tree = yaml.safe_load(saved.read_text())
    del tree["process_reward"], tree["tensorboard"], tree["experiment"]["keep_checkpoints"]  # an older version's
    saved.write_text(yaml.safe_dump(tree, sort_keys=False))
    history = rl(tmp_path, model, **{"experiment.total_step": 2, "experiment.start_from_scratch": "false"})
    assert [m["step"] for m in history] == [1, 2]
    with pytest.raises(RunDirError, match="'process_reward.k_sample' was 3 and is now 5"):  # a real change is not
        rl(tmp_path, model, **{"experiment.total_step": 3, "experiment.start_from_scratch": "false",
                               "process_reward.k_sample": 5})
    resume = {"experiment.total_step": 3, "experiment.start_from_scratch": "false"}
    tree = yaml.safe_load(saved.read_text())
    saved.write_text(yaml.safe_dump({**tree, "dataset": {**tree["dataset"], "optimization_data": "x.json"}}))
    with pytest.raises(RunDirError, match=f"^cannot resume {tmp_path / 'run'}: its config.yaml has "
                                          "'dataset.optimization_data', a setting this job does not know; if it is "
                                          "another kind of run"):
        rl(tmp_path, model, **resume)  # an SFT run's folder
    saved.write_text(yaml.safe_dump({**tree, "system": {**tree["system"], "env": {"FOO": "1"}}}))
    with pytest.raises(RunDirError, match="'system.env.FOO' was '1' and is now None"):  # a changed setting, said so
        rl(tmp_path, model, **resume)
    for text, said in (("experiment: [unclosed", "is unreadable"), ("", "holds no config")):
        saved.write_text(text)
        with pytest.raises(RunDirError, match=f"^cannot resume {tmp_path / 'run'}: its config.yaml {said}"):
            rl(tmp_path, model, **resume)


def test_safetensors_full_disk_and_unreadable_checkpoints_never_lose_the_run(tmp_path, model, rl, monkeypatch):
    from safetensors import SafetensorError

    import jobs.rl

    real = jobs.rl.save_checkpoint

    def full(trainer, ckpt, extra=None):  # what safetensors raises on ENOSPC (not an OSError)
        if ckpt.parent.name == "step_2.partial":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(trainer, ckpt, extra)

    monkeypatch.setattr(jobs.rl, "save_checkpoint", full)
    with pytest.raises(RunDirError, match="no space left on the device while writing .*step_2.partial"):
        rl(tmp_path, model, **{"experiment.keep_checkpoints": 1})
    monkeypatch.setattr(jobs.rl, "save_checkpoint", real)
    run = tmp_path / "run"
    assert not (run / "step_2.partial").exists() and (run / "step_1" / "ckpt" / "DONE").is_file()
    # the only checkpoint (keep_checkpoints=1) truncated: resuming refuses instead of starting the run over
    policy = run / "step_1" / "ckpt" / "policy" / "model.safetensors"
    policy.write_bytes(policy.read_bytes()[:500])
    with pytest.raises(RunDirError, match=r"cannot resume .*: no checkpoint reads back \(steps 1;"):
        rl(tmp_path, model, **{"experiment.keep_checkpoints": 1, "experiment.start_from_scratch": "false"})
    assert (run / "step_1" / "rollouts.jsonl").is_file()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path, umask, mode):
    from core.files import write_atomic

    old = os.umask(umask)
    try:
        out = write_atomic(tmp_path / "config.yaml", "a: 1\n")
        (tmp_path / "plain").write_text("a: 1\n")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == mode
    assert out.read_text() == "a: 1\n" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_machine_that_refuses_the_write_is_one_line(tmp_path, monkeypatch, capsys):
    """A run directory that cannot be made or written (read-only file system, full disk), and any write the machine
    refuses later in a job, end in one line naming the cause, not a traceback."""
    import errno

    from core.entry import run_job
    from core.files import RunLock, write_atomic

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", read_only)
        with pytest.raises(RunDirError, match=f"^cannot create the run directory {tmp_path / 'run'}: Read-only file "
                                              "system$"):
            RunLock(tmp_path / "run")

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", full_disk)
        with pytest.raises(RunDirError, match=f"^cannot write in the run directory {tmp_path / 'run'}: No space left "
                                              "on device$"):
            RunLock(tmp_path / "run")
    RunLock(tmp_path / "run").release()  # the failed attempt released its descriptor: the lock is free

    config = tmp_path / "run" / "config.yaml"
    with monkeypatch.context() as patch:  # the system's error names no file: write_atomic adds the one it wrote
        patch.setattr(os, "fsync", full_disk)
        assert run_job(lambda: write_atomic(config, "experiment: {}\n")) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: No space left on device: {config}"]
    assert sorted(p.name for p in config.parent.iterdir()) == [".lock"]  # no temp file left

    def a_bug():
        raise OSError(errno.EBADF, "Bad file descriptor")

    with pytest.raises(OSError, match="Bad file descriptor"):  # the program's own errors keep their traceback
        run_job(a_bug)


def test_a_full_disk_while_drawing_the_curves_leaves_no_temp_file(tmp_path, monkeypatch):
    """curves.png is written through a temp file and renamed: a full disk mid-write removes the temp file, keeps the
    old picture and names the picture in the error (a write's or fsync's own OSError names no file)."""
    import core.files
    from jobs.rl import _plot_curves

    history = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}]
    out = tmp_path / "curves.png"
    _plot_curves(history, out)
    before = out.read_bytes()
    assert before.startswith(b"\x89PNG")

    def full(fd):  # the picture's bytes are in the temp file, not yet on disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core.files.os, "fsync", full)
    with pytest.raises(OSError, match="No space left") as err:
        _plot_curves(history + [{"step": 3, "reward": 0.5}], out)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"] and out.read_bytes() == before
