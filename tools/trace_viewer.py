"""Write the HTML trace page of saved trajectories (the library is ``sample/trace_viewer.py``).

    python -m tools.trace_viewer --trajectories runs/x/rollouts.jsonl --tokenizer DIR --out trace.html \
        [--index i | --all]

A URL fragment selects the state on load, e.g. ``trace.html#i=2&t=17`` (trajectory 2, step 17; ``t=max`` for the end).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.files import write_atomic
from sample.trace_viewer import build_trace_html
from sample.trajectory import read_jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.trace_viewer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", required=True, help="rollouts JSONL (one Trajectory per line)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder (loaded offline, as the jobs load it)")
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
    except UnicodeDecodeError:
        parser.error(f"--trajectories {path}: not UTF-8 text (expected JSON lines)")
    except ValueError as e:
        # another file of a run folder given by mistake (results.jsonl): name the trajectories beside it; a
        # trajectories file with a field of another version of the code gets the error alone
        mistaken = "unknown trajectory field" in str(e) and not path.name.startswith("trajectories-")
        beside = sorted(path.parent.glob("trajectories-*.jsonl")) if mistaken else []
        hint = f" (not a trajectories file; beside it: {beside[0]})" if beside else ""
        parser.error(" ".join(str(e).split()) + hint)
    for i, t in enumerate(trajs):
        for field in ("prompt_ids", "response_ids", "step_map"):
            bad = next((x for x in getattr(t, field) if not isinstance(x, int) or isinstance(x, bool)), None)
            if bad is not None:
                parser.error(f"{path}: trajectory {i}: field '{field}' holds {bad!r}, not a token id / step")
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
    from models.registry import ModelLoadError, load_tokenizer  # registers our model types (no config warning)

    try:
        tokenizer = load_tokenizer(tok_dir)  # never runs (or asks about) a checkpoint's custom tokenizer code
    except ModelLoadError as e:
        parser.error(f"--tokenizer: {e}")  # the error names the folder
    vocab = len(tokenizer)
    for i, t in enumerate(trajs):
        outside = [x for x in (*t.prompt_ids, *t.response_ids) if not 0 <= x < vocab]
        if outside:
            parser.error(f"{path}: trajectory {i} holds token id {outside[0]}, outside the vocabulary of --tokenizer "
                         f"{tok_dir} ({vocab} tokens): is it the tokenizer the trajectories were sampled with?")

    page = build_trace_html(trajs, tokenizer, title=args.title or f"dLLM decoding trace: {path.name}")
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"--out {out}: is a directory (give a file name, e.g. {out / 'trace.html'})")
    try:
        write_atomic(out, page)  # a full disk leaves the page it would replace whole
    except OSError as e:
        parser.error(f"--out {out}: cannot write it ({e.strerror or e})")
    n_tok = sum(len(t.response_ids) for t in trajs)
    count = f"{len(trajs)} trajectories" if len(trajs) != 1 else "1 trajectory"
    print(f"wrote {out} ({count}, {n_tok} response tokens, {len(page) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
