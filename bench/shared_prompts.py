"""Training with shared prompts vs every row forwarding its own prompt: one TraceRL step's training, same run.

    python -m bench.shared_prompts                          # SmolLM2-135M's shape, the real-weights recipe's step
    python -m bench.shared_prompts --preset cpu --prompts 4 --group 8 --rounds 2   # quick

On CPU (the machine's cores). An RL step trains ``--group`` samples of each of ``--prompts`` prompts;
micro-batches of ``--micro`` rows hold several rows of a prompt. Shared (``training.share_prompts=true``,
train/shared_prefix.py): the distinct prompts' complete blocks are forwarded once per micro-batch, then the rows
read them as a cache. Baseline (``false``): one forward of every row. A third configuration shares prompts but
deals the rows to micro-batches in a random order over all prompts (the trainer's order before it kept a prompt's
rows together, ``train.trainer.grouped_order``): each 16-row micro-batch then holds several prompts, each
forwarded once per micro-batch. All train the same rows (TraceRL, packed layout) with the same trainer, alternating
step by step (interleaved rounds, so load on a shared machine hits all alike); the median step is reported, and the
log-probs of the shared and unshared paths are compared on the first micro-batch. The
synthetic records decode dynamically: each block takes 1-3 tokens per step (the real recipe's dynamic remasking
commits ~2.2 per step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import train.trainer
from bench import hardware_line
from bench.sampler import PRESETS, build_adapter
from sample.trajectory import Trajectory
from train.accelerator import build_accelerator
from train.policy_trainer import PolicyTrainer
from train.settings import OptimizerParams, RLTrainingConfig


def trajectories(args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    """``group`` records of each prompt; a block's tokens are committed 1-3 per step, in a random order."""
    rng = random.Random(0)
    n = args.response_len
    total = n + (-(args.prompt_len + n)) % args.block  # the response and the final block's tail
    # the first generated block holds the prompt's last prompt_len % block tokens
    bounds = [0, *range(args.block - args.prompt_len % args.block, total, args.block), total]
    out = []
    for p in range(args.prompts):
        prompt = [rng.randrange(10, min(vocab, 400)) for _ in range(args.prompt_len)]
        for c in range(args.group):
            steps, step = [0] * total, 0
            for start, end in zip(bounds[:-1], bounds[1:]):
                order = rng.sample(range(start, end), end - start)
                while order:
                    step += 1
                    k = rng.randint(1, 3)
                    for j in order[:k]:
                        steps[j] = step
                    order = order[k:]
            ids = [rng.randrange(10, min(vocab, 400)) for _ in range(total)]
            out.append(Trajectory(prompt_ids=prompt, response_ids=ids[:n], step_map=steps[:n], logprobs=[-1.0] * n,
                                  tail_ids=ids[n:], tail_steps=steps[n:], block_size=args.block,
                                  sample_id=f"{p}-{c}", group_id=str(p)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.shared_prompts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=84)
    ap.add_argument("--response-len", type=int, default=24)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (training.batch_size_lm)")
    ap.add_argument("--mixed-precision", choices=("no", "bf16"), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    adapter = build_adapter(args.preset, "cpu", torch.float32, args.block)
    trajs = trajectories(args, adapter.model.config.vocab_size)
    advantages = {t.sample_id: (-1.0) ** i for i, t in enumerate(trajs)}
    cfg = RLTrainingConfig(batch_size_lm=args.micro, mixed_precision=args.mixed_precision, enable_tf32=False)
    trainer = PolicyTrainer(adapter, cfg, OptimizerParams(learning_rate=1e-7),
                            accelerator=build_accelerator(mixed_precision=args.mixed_precision))
    batch = trainer.build_views(trajs, advantages)[0]
    first = trainer.micro_batches(batch, 0)[0]
    logp = {}
    for share in (True, False):
        trainer.share_prompts = share
        logp[share] = trainer.logprobs(first)
    n_params = sum(p.numel() for p in adapter.model.parameters())
    print(hardware_line())
    print(f"model: SDAR-shaped preset {args.preset} ({n_params / 1e6:.1f}M params), training under "
          f"{args.mixed_precision}; {args.prompts} prompts of {args.prompt_len} tokens x {args.group} samples of "
          f"{args.response_len} tokens, block {args.block}: {batch.num_rows} packed rows, "
          f"{batch.num_input_tokens} input tokens, {batch.num_tokens} trained; micro-batches of {args.micro} rows")
    print(f"log-probs of the first micro-batch, shared vs not: max |difference| "
          f"{float((logp[True] - logp[False]).abs().max()):.2e}")
    grouped = train.trainer.grouped_order
    configs = {"every row its own prompt": (False, grouped), "shared, rows shuffled": (True, _rows_shuffled),
               "shared, prompts together": (True, grouped)}
    seconds: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(args.rounds):
        for label, (share, order) in configs.items():
            trainer.share_prompts, train.trainer.grouped_order = share, order
            start = time.perf_counter()
            trainer.train_step(trajs, advantages)
            seconds[label].append(time.perf_counter() - start)
    train.trainer.grouped_order = grouped
    median = {label: statistics.median(times) for label, times in seconds.items()}
    for label, times in seconds.items():
        print(f"{label:>24}: training step {median[label]:.2f} s median ({', '.join(f'{s:.2f}' for s in times)})")
    own, shuffled, together = median.values()
    print(f"shared prompts vs every row its own: {own / together:.2f}x faster; prompts together vs rows shuffled: "
          f"{shuffled / together:.2f}x faster")


def _rows_shuffled(group: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The baseline order: the rows of a step in a seeded random order, whatever their prompt."""
    return torch.randperm(len(group), generator=generator or torch.Generator().manual_seed(0))


if __name__ == "__main__":
    main()
