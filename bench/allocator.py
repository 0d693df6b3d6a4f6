"""RL steps with glibc keeping freed memory (``system.keep_freed_memory``, the default) vs glibc's defaults, same run.

    python -m bench.allocator                        # SmolLM2-135M's shape, the real-weights recipe's step
    python -m bench.allocator --preset cpu --steps 3 --rounds 1   # quick

Each configuration runs in fresh processes, alternating round by round (load on a shared machine hits both
alike): build the model, then ``--steps`` RL-shaped steps, each sampling ``--prompts`` x ``--group`` responses
(``generate``, KV-cached, bf16 autocast where the CPU multiplies bf16 natively) and one TraceRL training step on
records shaped like the recipe's (``bench.shared_prompts``: 84-token prompts, 24-token responses committed 1-3
tokens a step). The first ``--warm`` steps are left out (the heap grows to the step's peak there); reported: the
median later step's sampling and training seconds and its page faults (``ru_minflt``), and the ratios. Default
glibc returns a buffer above its mmap threshold to the OS when freed, so the next step's buffers fault their pages
in again (core/allocator.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from bench import hardware_line
from bench.sampler import PRESETS, build_adapter, make_prompts

CONFIGS = ("default", "keep")  # the baseline first


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_child(args: argparse.Namespace) -> dict:
    """One configuration in this (fresh) process: per-step seconds and page faults."""
    from bench.shared_prompts import trajectories
    from core.allocator import keep_freed_memory
    from models.layers import native_cpu_bf16
    from sample.generate import generate
    from sample.params import SamplingParams
    from train.accelerator import build_accelerator
    from train.policy_trainer import PolicyTrainer
    from train.settings import OptimizerParams, RLTrainingConfig

    applied = keep_freed_memory() if args.child == "keep" else False
    precision = "bf16" if native_cpu_bf16() else "no"
    adapter = build_adapter(args.preset, "cpu", torch.float32, args.block)
    vocab = adapter.model.config.vocab_size
    prompts = [p for p in make_prompts(args.prompts, vocab) for _ in range(args.group)]
    params = SamplingParams(max_tokens=args.response_len, block_size=args.block, denoising_steps=2, temperature=1.0,
                            seed=0, ignore_eos=True, stop_token_ids=[], max_active=64,
                            compute_dtype="bfloat16" if precision == "bf16" else None)
    trajs = trajectories(args, vocab)
    advantages = {t.sample_id: (-1.0) ** i for i, t in enumerate(trajs)}
    cfg = RLTrainingConfig(batch_size_lm=16, mixed_precision=precision, enable_tf32=False)
    trainer = PolicyTrainer(adapter, cfg, OptimizerParams(learning_rate=1e-7),
                            accelerator=build_accelerator(mixed_precision=precision))
    steps = []
    for _ in range(args.steps):
        f0, t0 = _faults(), time.perf_counter()
        generate(adapter, prompts, params, progress=False)
        t1 = time.perf_counter()
        trainer.train_step(trajs, advantages)
        steps.append({"sample": t1 - t0, "train": time.perf_counter() - t1, "faults": _faults() - f0})
    return {"applied": applied, "precision": precision, "steps": steps}


def _child(argv: list[str] | None, config: str) -> dict:
    cmd = [sys.executable, "-m", "bench.allocator", *(argv if argv is not None else sys.argv[1:]), "--child", config]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="135m")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=84)
    p.add_argument("--response-len", type=int, default=24)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps per process")
    p.add_argument("--warm", type=int, default=2, help="first steps of a process left out")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per configuration, alternating")
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= args.warm or min(args.prompts, args.group, args.rounds) < 1:
        p.error("--steps must exceed --warm; --prompts, --group and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    print(hardware_line())
    measured: dict[str, list[dict]] = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            result = _child(argv, config)
            if config == "keep" and not result["applied"]:
                raise SystemExit("glibc's thresholds were not raised (not glibc, or MALLOC_* / GLIBC_TUNABLES set): "
                                 "nothing to compare")
            measured[config] += result["steps"][args.warm:]
    print(f"preset {args.preset}, {args.prompts} prompts x {args.group} samples of {args.response_len} tokens, "
          f"block {args.block}, {result['precision']} compute; {args.rounds} processes x {args.steps - args.warm} "
          f"measured steps per configuration (after {args.warm} warm-up steps each)")
    median = {config: {k: statistics.median(s[k] for s in steps) for k in ("sample", "train", "faults")}
              for config, steps in measured.items()}
    for config, m in median.items():
        print(f"{config:>8}: sampling {m['sample']:.2f} s, training {m['train']:.2f} s, "
              f"{m['faults']:,.0f} page faults a step (medians)")
    base, keep = median["default"], median["keep"]
    step = (base["sample"] + base["train"]) / (keep["sample"] + keep["train"])
    print(f"keep vs default: sampling {base['sample'] / keep['sample']:.2f}x faster, training "
          f"{base['train'] / keep['train']:.2f}x faster, the step {step:.2f}x")


if __name__ == "__main__":
    main()
