"""Run `rl.py` on several nodes: `python multinode_rl.py config=configs/<job>.yaml [key=value ...]` on EVERY node.

The node rank, node count and master address come from the environment (jobs/cluster.py: MLP_*, torchrun-style
NODE_RANK/NNODES/MASTER_ADDR/MASTER_PORT, or SLURM); this script execs `accelerate launch` with the multi-machine
settings and `accelerate_configs/<experiment.deepspeed_file>.yaml` (default: ZeRO-3 for that many nodes).
"""

from jobs.cluster import multinode_main

if __name__ == "__main__":
    raise SystemExit(multinode_main("rl", "rl.py"))
