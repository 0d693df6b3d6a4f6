"""Evaluate a model on a benchmark: `python eval.py config=configs/trado_eval.yaml [key=value ...]`."""

from __future__ import annotations

import sys

from core.config import load_config_or_exit
from core.entry import run_job


def main(argv: list[str] | None = None) -> int:
    cfg = load_config_or_exit("eval", argv if argv is not None else sys.argv[1:])  # before torch is imported

    def job() -> None:
        from jobs.evaluate import run_eval, summary_table

        results = run_eval(cfg)
        print(summary_table(results))
        print(f"results: {cfg.experiment.output_dir}/{cfg.experiment.project}/ "
              "(results.jsonl, config.yaml, trajectories, trace page)")

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
