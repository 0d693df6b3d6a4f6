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
