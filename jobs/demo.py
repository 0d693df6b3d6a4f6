"""The demo's starting models, built on first use (nothing is downloaded): tiny random models, and the SFT demo
model that the RL demo starts from.

Below every job that needs them: the SFT demo model is trained in a child process that runs the SFT job by name, so
the SFT job can use this module too without an import circle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.entry import Terminated, launched
from jobs.config import DEMO_MODEL_DIRS, is_demo_model_dir
from models.errors import not_a_model_folder
from models.registry import ModelLoadError

# The demo's SFT models and the config that trains each: arithmetic (the RL demo's start) and Countdown (the
# Countdown start of bench/methods.py).
SFT_DEMOS = {"runs/sft_demo/ckpt/optimized": "configs/demo/sft_demo.yaml",
             "runs/sft_countdown/ckpt/optimized": "configs/demo/sft_countdown.yaml"}


ROOT = Path(__file__).resolve().parents[1]
# what a launcher (accelerate launch, torchrun) tells its processes; the demo's SFT child must not see it
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def ensure_demo_model(model_cfg: Any) -> None:
    """Demo configs only (a job's main process): build the model at one of the demo paths when it is missing (and
    say so); an SFT demo model is trained from its config (``SFT_DEMOS``) in a process of its own.

    Any other missing path is an error: a mistyped path must never silently become a random model.
    """
    path = Path(model_cfg.pretrained_model)
    if not model_cfg.init_tiny_if_missing or (path / "config.json").is_file():
        return
    if not is_demo_model_dir(path):
        if path.exists():
            raise ModelLoadError(not_a_model_folder(path))
        raise ModelLoadError(f"model path {str(path)!r} does not exist (model.init_tiny_if_missing only builds the "
                             f"demo's own paths: {', '.join(DEMO_MODEL_DIRS)})")
    sft_config = SFT_DEMOS.get(path.as_posix().rstrip("/"))
    if sft_config:
        print(f"{path} is missing: training the demo's starting model with {sft_config} (runs once)", flush=True)
        # the working directory's copy of the config where it has one (as for the job's own paths), else ours
        config = sft_config if Path(sft_config).is_file() else ROOT / sft_config
        _train_alone([f"config={config}", "experiment.overwrite=true"])
        return
    from models.tiny import save_tiny_checkpoint
    from models.tokenizers import build_demo_tokenizer

    print(f"building a tiny random {model_cfg.model_base} model at {path} (demo; nothing is downloaded)")
    save_tiny_checkpoint(path, str(model_cfg.model_base), build_demo_tokenizer(), size="demo")


def _train_alone(args: list[str]) -> None:
    """The SFT demo in a single-process child. In a launched job's process it would join the launch's process group,
    whose other processes are waiting for the model at a barrier, and take the group down when it ends; in any job
    it would load a second config into the job's process (the loader keeps how the job's keys were spelled, for its
    errors, per process)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("ACCELERATE_", "TORCHELASTIC_"))}
    if launched() and env.get("OMP_NUM_THREADS") == "1":
        del env["OMP_NUM_THREADS"]  # torchrun's one thread per process; the child trains alone while the rest wait
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = ("import sys; from core.entry import run_job; from jobs.config import load_config; from jobs.sft import "
            "run_sft; sys.exit(run_job(lambda: run_sft(load_config(sys.argv[1:], 'sft'))))")
    child = subprocess.Popen([sys.executable, "-c", code, *args], env=env)
    try:
        returncode = child.wait()
    except KeyboardInterrupt as err:
        _stop(child, signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)
        raise
    if returncode != 0:
        raise ModelLoadError(f"training the demo's starting model failed (exit code {returncode}); to see why, run "
                             f"the SFT alone: python {ROOT / 'train/sft_sdar.py'} {' '.join(args)}")


def _stop(child: subprocess.Popen, signum: int, grace: float = 60.0) -> None:
    """The job was interrupted while the SFT child trains: let the child end its run as an interrupted job does,
    killing it only if it hangs. A terminal's Ctrl-C reaches the child's process group too, so after SIGINT the
    child is given time to stop by itself before the signal is passed on; SIGTERM was sent to the job alone."""
    try:
        child.wait(timeout=10.0 if signum == signal.SIGINT else 0.0)
    except subprocess.TimeoutExpired:
        child.send_signal(signum)
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
