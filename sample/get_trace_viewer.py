"""Write the HTML trace page of saved trajectories (the library is ``sample/trace_viewer.py``).

    python sample/get_trace_viewer.py --trajectories runs/x/rollouts.jsonl --tokenizer DIR --out trace.html \
        [--index i | --all]

A URL fragment selects the state on load, e.g. ``trace.html#i=2&t=17`` (trajectory 2, step 17; ``t=max`` for the end).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repository importable

from sample.trace_viewer import build_trace_html  # noqa: E402
from sample.trajectory import read_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", required=True, help="rollouts JSONL (one Trajectory per line)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (loaded offline with AutoTokenizer)")
    parser.add_argument("--out", default="trace.html", help="output HTML file")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--index", type=int, default=None, help="0-based line of the trajectory to show (default 0)")
    which.add_argument("--all", action="store_true", help="put every trajectory of the file in the page")
    parser.add_argument("--title", default=None, help="page title (default: the JSONL file name)")
    args = parser.parse_args(argv)

    path = Path(args.trajectories)
    if not path.is_file():
        parser.error(f"--trajectories {path}: no such file")
    try:
        trajs = list(read_jsonl(path))
    except ValueError as e:
        parser.error(str(e))
    if not trajs:
        parser.error(f"{path}: no trajectories in file")
    if not args.all:
        index = 0 if args.index is None else args.index
        if not 0 <= index < len(trajs):
            parser.error(f"--index {index} out of range: {path} has {len(trajs)} trajectories")
        trajs = [trajs[index]]

    tok_dir = Path(args.tokenizer)
    if not tok_dir.is_dir():
        parser.error(f"--tokenizer {tok_dir}: not a directory")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        parser.error(f"--tokenizer {tok_dir}: cannot load a tokenizer ({e})")

    page = build_trace_html(trajs, tokenizer, title=args.title or f"dLLM decoding trace: {path.name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    n_tok = sum(len(t.response_ids) for t in trajs)
    print(f"wrote {out} ({len(trajs)} trajectories, {n_tok} response tokens, {len(page) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
