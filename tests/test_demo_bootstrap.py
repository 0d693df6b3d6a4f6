"""The demo's starting model is built on first use by one process, however many processes the job has
(jobs/demo.py). Runs the user's command from a fresh directory whose demo SFT config is cut to 2 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train_distributed import _free_port

ROOT = Path(__file__).resolve().parents[1]


def _fresh_checkout(tmp_path: Path) -> Path:
    """A working directory with the demo configs (relative paths resolve here) and no runs/."""
    demo = tmp_path / "configs" / "demo"
    demo.mkdir(parents=True)
    sft = (ROOT / "configs/demo/sft_demo.yaml").read_text()
    assert "max_steps: 1200" in sft and "builtin_size: 2000" in sft
    (demo / "sft_demo.yaml").write_text(sft.replace("max_steps: 1200", "max_steps: 2")
                                        .replace("builtin_size: 2000", "builtin_size: 64"))
    return tmp_path


@pytest.mark.parametrize("launcher", [None, pytest.param("cpu_ddp_2proc", marks=pytest.mark.slow)])
def test_eval_trains_the_missing_sft_demo_model_once(tmp_path, launcher):
    cwd = _fresh_checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    launch = [] if launcher is None else [  # on a free port: another run may hold accelerate's default one
        "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / f"{launcher}.yaml"),
        "--main_process_port", str(_free_port())]
    cmd = [sys.executable, *launch, str(ROOT / "eval.py"), f"config={ROOT / 'configs/demo/eval_demo.yaml'}",
           "model.pretrained_model=runs/sft_demo/ckpt/optimized", "dataset.builtin_size=4", "rollout.max_tokens=8",
           "experiment.project=bootstrap"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("training the demo's starting model") == 1  # by the main process only
    assert (cwd / "runs/sft_demo/ckpt/optimized/config.json").is_file()
    assert json.loads((cwd / "runs/sft_demo/metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    result = json.loads((cwd / "runs/bootstrap/results.jsonl").read_text())
    assert (result["tasks"], result["responses"]) == (4, 8)  # every task, on however many processes


@pytest.mark.parametrize(("launched", "omp", "child_omp"), [(True, "1", None), (True, "4", "4"), (False, "1", "1")])
def test_the_sft_child_leaves_the_launch_behind(monkeypatch, launched, omp, child_omp):
    """The child sees none of the launcher's variables, and not the one OpenMP thread torchrun gives each process
    (the child trains alone while the launched processes wait); a thread count the user set without a launcher
    stays."""
    from jobs import demo

    seen = {}

    class Child:
        def __init__(self, cmd, env):
            seen.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(demo.subprocess, "Popen", Child)
    for key in demo.LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    if launched:
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    demo._train_alone(["config=configs/demo/sft_demo.yaml"])
    assert seen["env"].get("OMP_NUM_THREADS") == child_omp
    assert not any(k in seen["env"] for k in demo.LAUNCHER_VARIABLES)
    assert not any(k.startswith("ACCELERATE_") for k in seen["env"])
    assert seen["cmd"][-1] == "config=configs/demo/sft_demo.yaml"
    assert str(ROOT) in seen["env"]["PYTHONPATH"].split(os.pathsep)


@pytest.mark.parametrize(("interrupt", "forwarded"), [("term", "SIGTERM"), ("int", "SIGINT")])
def test_an_interrupted_job_lets_its_sft_child_stop_cleanly(monkeypatch, interrupt, forwarded):
    """SIGTERM to the job (core.entry turns it into Terminated) is passed on to the SFT child at once; after Ctrl-C
    the child, which got it from the terminal too, has time to stop by itself, then it is passed on; the job's
    interrupt goes on up (its run is marked interrupted)."""
    import signal

    from core.entry import Terminated
    from jobs import demo

    calls = []

    class Child:
        def __init__(self, cmd, env):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            calls.append(("wait", timeout))
            if self.waits == 1:
                raise Terminated() if interrupt == "term" else KeyboardInterrupt()
            if self.waits == 2:  # the child did not stop by itself in time
                raise subprocess.TimeoutExpired("sft", timeout)
            return 130

        def send_signal(self, signum):
            calls.append(("signal", signum))

        def kill(self):
            calls.append(("kill", None))

    monkeypatch.setattr(demo.subprocess, "Popen", Child)
    with pytest.raises(KeyboardInterrupt):
        demo._train_alone(["config=configs/demo/sft_demo.yaml"])
    first_wait = 0.0 if interrupt == "term" else 10.0
    assert calls == [("wait", None), ("wait", first_wait), ("signal", getattr(signal, forwarded)), ("wait", 60.0)]


def test_the_demo_started_from_another_directory_trains_with_the_shipped_sft_config(tmp_path, monkeypatch):
    """`python /path/to/rl.py config=/path/to/configs/demo/rl_demo.yaml` from elsewhere: the demo's paths are the
    working directory's, and the SFT config, which that directory lacks, is the checkout's."""
    from types import SimpleNamespace

    from jobs import demo

    seen = []
    monkeypatch.setattr(demo, "_train_alone", seen.append)
    monkeypatch.chdir(tmp_path)
    demo.ensure_demo_model(SimpleNamespace(pretrained_model="runs/sft_demo/ckpt/optimized", init_tiny_if_missing=True,
                                           model_base="sdar"))
    assert seen == [[f"config={ROOT / 'configs/demo/sft_demo.yaml'}", "experiment.overwrite=true"]]


def test_a_demo_config_pointed_at_another_folder_says_what_the_folder_is(tmp_path):
    from types import SimpleNamespace

    from jobs import demo
    from models.errors import ModelLoadError

    cfg = SimpleNamespace(pretrained_model=str(tmp_path / "missing"), init_tiny_if_missing=True)
    with pytest.raises(ModelLoadError, match="does not exist \\(model.init_tiny_if_missing only builds the demo's"):
        demo.ensure_demo_model(cfg)
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")  # a LoRA run's checkpoint: it exists
    with pytest.raises(ModelLoadError, match="holds a LoRA adapter, not a whole model"):
        demo.ensure_demo_model(SimpleNamespace(pretrained_model=str(tmp_path / "lora"), init_tiny_if_missing=True))
