"""Evaluate a model on a benchmark: `python eval.py config=configs/trado_eval.yaml [key=value ...]`."""

from __future__ import annotations

import sys

from core.entry import run_job
from jobs.cluster import check_single_node, relaunch_if_requested
from jobs.config import load_config_or_exit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit("eval", argv)  # before torch is imported

    def job() -> None:
        check_single_node(cfg, "python multinode_eval.py config=...")
        relaunch_if_requested(cfg, "eval.py", argv)
        from jobs.evaluate import run_eval, summary_table

        results = run_eval(cfg)
        print(summary_table(results))
        print(f"results: {cfg.experiment.output_dir}/{cfg.experiment.project}/ "
              "(results.jsonl, config.yaml, trajectories, trace page)")

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
