"""Merge a LoRA adapter into its base model: a whole checkpoint that eval.py and ``load_model`` read.

    python -m jobs.merge_lora --base PATH --adapter PATH --out PATH --model-base sdar [--dtype bfloat16]

``--adapter`` is a ``policy/`` folder of a LoRA run (or its ``ckpt/optimized`` link); see models/lora.py.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.merge_lora", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base checkpoint folder the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="the adapter folder (adapter_config.json, weights)")
    parser.add_argument("--out", required=True, help="the folder to write the merged checkpoint to")
    parser.add_argument("--model-base", required=True, help="the family (model.model_base: sdar, dream, ...)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default: the base checkpoint's)")
    args = parser.parse_args(argv)
    from core.entry import run_job
    from models.lora import merge_adapter_checkpoint

    def job() -> None:
        out = merge_adapter_checkpoint(args.base, args.adapter, args.out, args.model_base, args.dtype)
        print(f"merged checkpoint: {out}")

    return run_job(job)  # a user error: one line, exit status 2


if __name__ == "__main__":
    raise SystemExit(main())
