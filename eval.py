"""Evaluate a model on a benchmark: `python eval.py config=configs/trado_eval.yaml [key=value ...]`."""

from __future__ import annotations

import sys

from core.config import load_config_or_exit
from data.formats import DataFormatError
from jobs.evaluate import run_eval
from models.registry import ModelLoadError

USER_ERRORS = (ModelLoadError, DataFormatError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    cfg = load_config_or_exit("eval", argv if argv is not None else sys.argv[1:])
    try:
        m = run_eval(cfg)
    except USER_ERRORS as e:  # problems the user can fix: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = m["sampling"]
    print(f"{m['dataset']}: acc {m['acc']:.3f}  mean score {m['mean_score']:.3f}  avg length {m['avg_length']:.1f} "
          f"tokens  ({m['responses']} responses, {s['tokens_per_second']:.1f} tok/s, "
          f"{s['tokens_per_forward']:.2f} tok/forward)")
    print(f"results: {cfg.experiment.output_dir}/{cfg.experiment.project}/ (results.jsonl, trajectories, trace page)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
