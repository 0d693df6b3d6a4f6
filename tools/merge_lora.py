"""Merge a LoRA adapter into its base model: a whole checkpoint that eval.py and ``load_model`` read.

    python -m tools.merge_lora --base PATH --adapter PATH --out PATH --model-base sdar [--dtype bfloat16] [--overwrite]

``--adapter`` is a ``policy/`` folder of a LoRA run (or its ``ckpt/optimized`` link); see models/lora.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.merge_lora", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base checkpoint folder the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="the adapter folder (adapter_config.json, weights)")
    parser.add_argument("--out", required=True, help="the folder to write the merged checkpoint to")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (refused otherwise)")
    parser.add_argument("--model-base", required=True, help="the family (model.model_base: sdar, dream, ...)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default: the base checkpoint's)")
    args = parser.parse_args(argv)
    from core.entry import run_job

    def job() -> None:
        out = merge_adapter_checkpoint(args.base, args.adapter, args.out, args.model_base, args.dtype,
                                       args.overwrite)
        print(f"merged checkpoint: {out}")

    return run_job(job)  # a user error: one line, exit status 2


def merge_adapter_checkpoint(base: str | Path, adapter: str | Path, out: str | Path, model_base: str,
                             dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write ``out``: the whole checkpoint of ``base`` with the adapter merged (``load_model`` / eval.py read it).
    The merge runs in float32; the weights are saved in ``dtype`` (default: the base checkpoint's own).
    ``overwrite``: replace a non-empty ``out`` (refused otherwise; never the base or the adapter)."""
    from core.files import check_model_out, write_model_folder
    from models.lora import merged_model
    from models.registry import DTYPES, ModelLoadError, load_model

    check_model_out(out, overwrite, base, adapter)
    if dtype is None:
        config = json.loads((Path(base) / "config.json").read_text(encoding="utf-8")) \
            if (Path(base) / "config.json").is_file() else {}
        dtype = next((str(config[k]) for k in ("dtype", "torch_dtype") if str(config.get(k)) in DTYPES), "float32")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    loaded = load_model({"pretrained_model": str(base), "model_base": model_base, "dtype": "float32"})
    model = merged_model(loaded.model, adapter).to(DTYPES[dtype])

    def write(folder: Path) -> None:
        model.save_pretrained(str(folder), safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(folder))

    return write_model_folder(out, write)


if __name__ == "__main__":
    raise SystemExit(main())
