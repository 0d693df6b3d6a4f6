"""Run `eval.py` on several nodes: `python multinode_eval.py config=configs/<job>.yaml [key=value ...]` on EVERY node.

The node rank, node count and master address come from the environment (jobs/cluster.py: MLP_*, torchrun-style
NODE_RANK/NNODES/MASTER_ADDR/MASTER_PORT, or SLURM); this script execs `accelerate launch` with the multi-machine
settings and `accelerate_configs/<experiment.deepspeed_file>.yaml` (default: ZeRO-3 for that many nodes).
"""

from __future__ import annotations

import os
import sys

from core.config import load_config_or_exit
from core.entry import run_job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit("eval", argv)

    def job() -> None:
        from jobs.cluster import launch_command, node_env

        cmd = launch_command("eval.py", argv, node_env(), cfg.experiment.deepspeed_file,
                             cfg.experiment.num_node)
        print("launching: " + " ".join(cmd), flush=True)
        os.execv(cmd[0], cmd)

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
