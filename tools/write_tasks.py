"""Write built-in synthetic tasks (data/tasks.py) as a dataset JSON file.

    python -m tools.write_tasks --task arithmetic --n 100 --seed 0 --difficulty 2 --out data/arith.json
    python -m tools.write_tasks --task code --n 50 --seed 0 --out data/code.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.formats import save_dataset_file
from data.tasks import arithmetic_task, code_task


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.write_tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("arithmetic", "code"), required=True)
    parser.add_argument("--n", type=_at_least_one, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=_at_least_one, default=None, help="arithmetic only (default 1)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a directory: name the file to write")
    if args.task != "arithmetic" and args.difficulty is not None:
        parser.error(f"--difficulty applies to --task arithmetic only, not {args.task}")
    if args.task == "arithmetic":
        rows, kind = arithmetic_task(args.n, args.seed, args.difficulty or 1), "math"
    else:
        rows, kind = code_task(args.n, args.seed), "code"
    print(f"wrote {len(rows)} {args.task} tasks to {save_dataset_file(rows, args.out, kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
