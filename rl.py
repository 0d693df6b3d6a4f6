"""Post-train a dLLM with RL: `python rl.py config=configs/rl_trado.yaml [key=value ...]`.

Sampling, rewards, training and evaluation run in this one process (per rank) on one copy of the weights. With
``experiment.deepspeed_file`` set, the script relaunches itself under ``accelerate launch`` with
``accelerate_configs/<deepspeed_file>.yaml``; run it under ``accelerate launch`` yourself to choose the launch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from core.config import load_config_or_exit
from core.entry import run_job

ROOT = Path(__file__).resolve().parent


def _launched() -> bool:
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def relaunch_command(deepspeed_file: str, argv: list[str]) -> list[str]:
    """``accelerate launch --config_file accelerate_configs/<file>.yaml rl.py <argv>``."""
    config = ROOT / "accelerate_configs" / f"{deepspeed_file}.yaml"
    if not config.is_file():
        from core.loader import ConfigError

        raise ConfigError(f"key 'experiment.deepspeed_file': {config} does not exist "
                          f"(choose a file of {ROOT / 'accelerate_configs'})", "experiment.deepspeed_file")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(ROOT / "rl.py"),
            *argv]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit("rl", argv)  # before torch is imported

    def job() -> None:
        if cfg.experiment.deepspeed_file and not _launched():
            cmd = relaunch_command(cfg.experiment.deepspeed_file, argv)
            print("launching: " + " ".join(cmd), flush=True)
            os.execv(cmd[0], cmd)
        from jobs.rl import run_rl

        run_rl(cfg)

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
