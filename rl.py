"""Post-train a dLLM with RL: `python rl.py config=configs/rl_trado.yaml [key=value ...]`.

Sampling, rewards, training and evaluation run in this one process (per rank) on one copy of the weights. With
``experiment.deepspeed_file`` set, the script relaunches itself under ``accelerate launch`` with
``accelerate_configs/<deepspeed_file>.yaml``; run it under ``accelerate launch`` yourself to choose the launch.
"""

from __future__ import annotations

import sys

from core.entry import run_job
from jobs.cluster import check_single_node, relaunch_if_requested
from jobs.config import load_config_or_exit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit("rl", argv)  # before torch is imported

    def job() -> None:
        check_single_node(cfg, "python multinode_rl.py config=...")
        relaunch_if_requested(cfg, "rl.py", argv)
        from jobs.rl import run_rl

        run_rl(cfg)

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
