"""Convert a local autoregressive checkpoint into one of our diffusion families (the conversion: models/a2d.py).

    python -m tools.a2d --source /path/to/SmolLM2-135M-Instruct --to dream --out runs/a2d/smollm2_dream
    python -m tools.a2d --source DIR --gguf-file model.gguf --to sdar --block-size 4 --out runs/a2d/smollm2_sdar
"""

from __future__ import annotations

import argparse
import sys

from core.entry import run_job
from models.a2d import TARGETS, convert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.a2d", description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="local folder of a Llama / Qwen2 / Qwen3 causal LM")
    ap.add_argument("--to", required=True, choices=TARGETS, help="dream: full attention, shifted; sdar: blocks")
    ap.add_argument("--out", required=True, help="folder to write the converted checkpoint to")
    ap.add_argument("--block-size", type=int, default=None, help="sdar only: the block size (default 4)")
    ap.add_argument("--mask-token", default="<|mask|>", help="the new mask token's text")
    ap.add_argument("--gguf-file", default=None, help="a GGUF file inside --source (read by transformers)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a non-empty --out (swapped once the new one is whole; refused otherwise)")
    args = ap.parse_args(argv)

    def job() -> None:
        out = convert(args.source, args.to, args.out, args.block_size, args.mask_token, args.gguf_file,
                      args.overwrite)
        print(f"wrote {out} ({args.to}; model_base: {args.to})")

    return run_job(job)  # a user error: one line, exit status 2


if __name__ == "__main__":
    sys.exit(main())
