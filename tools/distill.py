"""SFT data distilled from an autoregressive checkpoint, and its held-out accuracy (the A2D recipe's first step).

    python -m tools.distill --source DIR [--gguf-file F] --out data/smollm2_distill.jsonl --n 2000 --difficulty 2

The built-in arithmetic questions (``builtin:arithmetic``, seeded) are asked with the checkpoint's chat template
and answered greedily by the AR model itself (transformers ``generate``, batched); each row is
``{prompt, response, correct}``. With ``--correct-only`` (the default) only answers the math reward accepts are kept:
the converted diffusion model is adapted on the AR model's own correct outputs (its distribution, not a new
one), which also needs no download. ``--eval-n`` questions drawn with another seed (the RL recipe's held-out seed)
give the AR model's greedy accuracy: the baseline of the real-weights run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm


def ar_answers(model: Any, tokenizer: Any, questions: list[str], max_new_tokens: int, batch_size: int = 128,
               progress: bool = True) -> list[str]:
    """Greedy answers of a causal LM to ``questions`` (one user turn each, the checkpoint's chat template)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    out: list[str] = []
    for i in tqdm(range(0, len(prompts), batch_size), desc="AR answers", disable=not progress, leave=False):
        batch = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def scored_rows(model: Any, tokenizer: Any, n: int, seed: int, difficulty: int, max_new_tokens: int,
                progress: bool = True) -> list[dict]:
    """``n`` built-in arithmetic questions with the AR model's answers and whether the math reward accepts them."""
    from data.tasks import arithmetic_task
    from reward.math import score_math

    tasks = arithmetic_task(n, seed=seed, difficulty=difficulty)
    answers = ar_answers(model, tokenizer, [t["question"] for t in tasks], max_new_tokens, progress=progress)
    return [{"prompt": t["question"], "response": a.strip(),
             "correct": bool(score_math(a, t["ground_truth_answer"]))} for t, a in zip(tasks, answers, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.distill", description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="local folder of the AR checkpoint")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out", required=True, help="the .jsonl file to write (SFT rows)")
    ap.add_argument("--n", type=int, default=2000, help="training questions")
    ap.add_argument("--seed", type=int, default=0, help="the training questions' seed")
    ap.add_argument("--difficulty", type=int, default=2, help="builtin:arithmetic difficulty")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--all", action="store_true", help="keep wrong answers too (default: correct ones only)")
    ap.add_argument("--eval-n", type=int, default=256, help="held-out questions for the AR baseline (0: none)")
    ap.add_argument("--eval-seed", type=int, default=1, help="the held-out questions' seed")
    args = ap.parse_args(argv)
    if Path(args.out).is_dir():  # said now, not after the answers are generated
        ap.error(f"--out {args.out} is a folder: name the .jsonl file to write")
    for name in ("n", "eval_n", "max_new_tokens"):
        if getattr(args, name) < (0 if name == "eval_n" else 1):
            ap.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'eval_n' else 1}, "
                     f"got {getattr(args, name)}")
    from core.entry import run_job

    return run_job(lambda: _distill(args))  # a user error: one line, exit status 2


def _distill(args: argparse.Namespace) -> None:
    from core.files import write_atomic
    from data.formats import DataFormatError
    from models.a2d import load_ar

    model, tokenizer = load_ar(args.source, args.gguf_file)
    rows = scored_rows(model, tokenizer, args.n, args.seed, args.difficulty, args.max_new_tokens)
    kept = rows if args.all else [r for r in rows if r["correct"]]
    if not kept:
        raise DataFormatError(f"none of the {len(rows)} answers is correct: nothing to write to {args.out} (pass "
                              "--all to keep wrong answers, or raise --max-new-tokens)")
    out = write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in kept))
    print(f"wrote {len(kept)} rows to {out} ({sum(r['correct'] for r in rows)}/{len(rows)} answers correct)")
    if args.eval_n:
        held = scored_rows(model, tokenizer, args.eval_n, args.eval_seed, args.difficulty, args.max_new_tokens)
        print(f"AR greedy held-out accuracy: {sum(r['correct'] for r in held) / len(held):.3f} "
              f"({len(held)} questions, difficulty {args.difficulty}, seed {args.eval_seed})")


if __name__ == "__main__":
    sys.exit(main())
