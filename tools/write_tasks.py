"""Write built-in synthetic tasks (data/tasks.py) as a dataset JSON file.

    python -m tools.write_tasks --task arithmetic --n 100 --seed 0 --difficulty 2 --out data/arith.json
    python -m tools.write_tasks --task code --n 50 --seed 0 --out data/code.json
"""

from __future__ import annotations

import argparse
import sys

from data.formats import save_dataset_file
from data.tasks import arithmetic_task, code_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.write_tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("arithmetic", "code"), required=True)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, default=1, help="arithmetic only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.task == "arithmetic":
        rows, kind = arithmetic_task(args.n, args.seed, args.difficulty), "math"
    else:
        rows, kind = code_task(args.n, args.seed), "code"
    print(f"wrote {len(rows)} {args.task} tasks to {save_dataset_file(rows, args.out, kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
