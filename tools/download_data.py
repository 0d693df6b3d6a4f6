"""Download an evaluation / RL dataset from the Hugging Face Hub and store it, validated, as data/NAME.json.

    python -m tools.download_data --dataset MATH500 [--out data/]

The catalog and the download are ``data/hub.py``; this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.hub import DATASETS, DownloadError, download

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.download_data", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--out", default=str(DATA_DIR), help="output directory (default: the repository's data/)")
    args = parser.parse_args(argv)
    try:
        path = download(args.dataset, args.out)
    except DownloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
