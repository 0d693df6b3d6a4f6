"""Benchmark of one TraceRL training pass (forward + backward of the policy loss) on a tiny SDAR, on CPU.

Compares, per sample: dense masked attention vs split attention (pieces of a row attend only to the keys they may
see), per-round rows vs the packed layout, and full logits ([R, N, V] then log_softmax over every
position, the reference's way, Gen-Verse/dLLM-RL train/rl_trado.py) vs gathered chunked log-probs (LM head on trained
positions
only). Workload: prompt L0, response L1, block b, ``steps_per_block`` steps per block (each block decodes one
token per step, so every block has that many rounds), a realistic vocabulary with a small hidden size so the LM
head matters.

Method: every configuration runs in fresh subprocesses: one memory run, and ``--rounds`` time runs interleaved
with the other configurations'. Time run (default allocator): per-sample wall time of the measured samples after
one warm-up sample; the fastest over samples and rounds is reported, being the least disturbed on a shared
machine. Memory run: glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor buffer is mmapped and
returned to the OS when freed and the resident set follows live tensor memory (otherwise glibc's dynamic threshold
keeps freed buffers on the heap and the peak depends on allocation history); one warm-up sample (thread pools and
kernel workspaces are allocated once, and would otherwise count), then the peak resident set is reset
(``/proc/self/clear_refs``) and one measured sample runs: peak memory per sample = its peak resident set minus the
resident size just before it, i.e. the extra memory the training pass needs on top of the model and its inputs
(tracemalloc does not see torch's allocations). Rows are processed one per micro-batch (the reference's
``batch_size_lm: 1``), so a per-round sample is several forwards and a packed sample is one.

    python -m bench.train            # defaults: L0=128, L1=512, b=4, 4 steps/block, vocab 151936
    python -m bench.train --head     # the LM head alone: the plain-head function vs the module a chunk at a time

``--head``: the trained tokens' log-probs and their backward (into the hidden states and the weight) at SmolLM2-135M's
head (vocab 49,152 x hidden 576, tied: its gradient adds to the embedding's), ``--head-tokens`` tokens per
micro-batch over ``--head-micro`` micro-batches, under bf16 autocast where the CPU multiplies bf16 natively (fp32
otherwise): ``train.logprobs.head_logprobs`` (the weight cast once, its gradient written slice by slice) against
``token_logprobs`` through the ``nn.Linear`` (autocast casts the weight for every chunk and its recomputation, and
each chunk's weight gradient is a [vocab, hidden] tensor of its own). Alternating rounds in one process, glibc
keeping freed memory as the jobs have it (core/allocator.py); the median round is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from bench import hardware_line

# (layout, logits, attention): dense = one masked [N, N] attention per row (the reference's way), split = ours on
# CPU (each piece of the row attends only to the keys it may see, models/common.py). The first is the baseline.
# budget = packed rows of at most --row-budget tokens (training.max_row_tokens; default: the clean sequence + 2
# noisy copies, so a sample's rounds go two by two: the smallest packing that shares the clean part).
CONFIGS = (("per_round", "full", "dense"), ("per_round", "gathered", "dense"), ("packed", "gathered", "dense"),
           ("per_round", "full", "split"), ("per_round", "gathered", "split"), ("packed", "full", "split"),
           ("packed", "gathered", "split"), ("budget", "gathered", "split"))


def _rss_kib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def _reset_peak_rss() -> None:
    """Reset the kernel's peak resident set (VmHWM) of this process to its current size (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_kib() -> float:
    with open("/proc/self/status") as f:
        return float(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def build_model(args: argparse.Namespace):
    from models.sdar import SDARConfig, SDARForCausalLM

    cfg = SDARConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=args.hidden // 4, block_size=args.block, mask_token_id=args.vocab - 1,
                     max_position_embeddings=args.l0 + args.l1 + 64)
    torch.manual_seed(0)
    return SDARForCausalLM(cfg).train()


def trajectories(args: argparse.Namespace, n: int):
    """Synthetic records: every block decodes one token per step, in a random order inside the block."""
    from sample.trajectory import Trajectory

    rng = random.Random(0)
    out = []
    for i in range(n):
        steps = []
        for k in range(args.l1 // args.block):
            order = list(range(1, args.steps_per_block + 1))
            order += [args.steps_per_block] * (args.block - len(order))
            rng.shuffle(order)
            steps += [k * args.steps_per_block + s for s in order]
        out.append(Trajectory(prompt_ids=[rng.randrange(10, args.vocab - 2) for _ in range(args.l0)],
                              response_ids=[rng.randrange(10, args.vocab - 2) for _ in range(args.l1)],
                              step_map=steps, logprobs=[-5.0] * args.l1, sample_id=str(i)))
    return out


def run_one(args: argparse.Namespace) -> dict:
    """One configuration (in its own process): time and peak extra memory per sample."""
    from models import common

    if args.attention == "dense":
        common.SPLIT_MAX_DENSITY = 0.0  # never split: one dense masked attention per row
    from train.logprobs import full_logits_logprobs, gathered_logprobs
    from train.loss import policy_loss
    from train.settings import LossConfig, ViewConfig
    from train.views import ModelTraits, build_view

    torch.set_num_threads(args.threads)
    model = build_model(args)
    traits = ModelTraits(mask_id=args.vocab - 1, pad_id=0, attention="block", block_size=args.block)
    n = args.samples + 1
    trajs = trajectories(args, n)
    budget = args.row_budget or args.l0 + 3 * args.l1  # the clean sequence + 2 noisy copies
    view = ViewConfig(layout="packed", max_row_tokens=budget) if args.layout == "budget" else ViewConfig(
        layout=args.layout)
    batches = [build_view([t], {t.sample_id: 1.0}, view, traits) for t in trajs]
    micro = [[b.select_rows([r]) for r in range(b.num_rows)] for b in batches]
    loss_cfg = LossConfig(beta=0.01)

    def one_sample(rows) -> None:
        for mb in rows:
            hidden = model.model(mb.input_ids, position_ids=mb.position_ids, layout=mb.layout).last_hidden_state
            if args.logits == "full":
                logp = full_logits_logprobs(model.lm_logits, hidden, mb.rows, mb.cols, mb.labels)
            else:
                logp = gathered_logprobs(model.lm_logits, hidden, mb.rows, mb.cols, mb.labels, args.chunk)
            policy_loss(logp, mb.old_logprobs, mb.advantages, mb.weights, loss_cfg).loss.backward()
            del hidden, logp

    one_sample(micro[0])  # warm-up
    peak = math.nan
    if args.measure == "memory":
        elapsed = math.nan
        model.zero_grad(set_to_none=False)  # gradients exist from the warm-up on: not part of the pass's peak
        base = _rss_kib()
        _reset_peak_rss()
        one_sample(micro[1])
        peak = _peak_rss_kib() - base
    else:
        times = []
        for rows in micro[1:]:
            start = time.perf_counter()
            one_sample(rows)
            times.append(time.perf_counter() - start)
        elapsed = min(times)  # the least disturbed sample: the machine may be shared
    b = batches[1]
    logit_rows = b.num_input_tokens if args.logits == "full" else b.num_tokens
    return {"layout": args.layout, "logits": args.logits, "attention": args.attention, "rows": b.num_rows,
            "input_tokens": b.num_input_tokens,
            "trained_tokens": b.num_tokens, "logit_rows": logit_rows, "seconds": elapsed, "peak_mib": peak / 1024}


def _child(argv: list[str] | None, layout: str, logits: str, attention: str, measure: str) -> dict:
    """Run one measurement in a fresh process; the memory run keeps every large buffer in its own mmap."""
    env = dict(os.environ)
    if measure == "memory":  # freed buffers go back to the OS at once, so RSS follows live tensor memory
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, "-m", "bench.train", *(argv if argv is not None else sys.argv[1:]), "--layout", layout,
           "--logits", logits, "--attention", attention, "--measure", measure]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return {k: v for k, v in result.items() if v == v and not (measure == "time" and k == "peak_mib")}


def head_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per round of each way through the head (see the module docstring, ``--head``)."""
    from core.allocator import keep_freed_memory
    from models.layers import native_cpu_bf16
    from train.logprobs import token_logprobs

    keep_freed_memory()  # as every job does (system.keep_freed_memory): the heads' own costs, not page faults
    torch.manual_seed(0)
    embed = torch.nn.Embedding(args.head_vocab, args.head_hidden)
    head = torch.nn.Linear(args.head_hidden, args.head_vocab, bias=False)
    head.weight = embed.weight  # tied, as SmolLM2's
    ids = [torch.randint(0, args.head_vocab, (args.head_tokens,)) for _ in range(args.head_micro)]
    labels = [torch.randint(0, args.head_vocab, (args.head_tokens,)) for _ in range(args.head_micro)]
    ways = {"module": None, "plain": embed.weight}
    bf16 = native_cpu_bf16()

    def one_round(weight) -> float:
        start = time.perf_counter()
        for x, y in zip(ids, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                hidden = embed(x) * 1.0  # stands in for the backbone's output
                logp = token_logprobs(head, hidden, y, args.chunk, head_weight=weight)
            logp.sum().backward()
        embed.weight.grad = None
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for weight in ways.values():
        one_round(weight)  # warm-up
    for _ in range(args.rounds):
        for way, weight in ways.items():
            seconds[way].append(one_round(weight))
    print(f"head: vocab {args.head_vocab} x hidden {args.head_hidden} (tied), {args.head_micro} micro-batches x "
          f"{args.head_tokens} trained tokens, {'bf16 autocast' if bf16 else 'fp32'}, chunks of {args.chunk} tokens")
    return seconds


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--l0", type=int, default=128, help="prompt length")
    p.add_argument("--l1", type=int, default=512, help="response length")
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=5, help="measured samples per configuration and round (time)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved time rounds (fresh processes)")
    p.add_argument("--chunk", type=int, default=128, help="logits_chunk_size of the gathered log-probs")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--head", action="store_true", help="measure the LM head alone, both ways (module docstring)")
    p.add_argument("--head-vocab", type=int, default=49152)
    p.add_argument("--head-hidden", type=int, default=576)
    p.add_argument("--head-tokens", type=int, default=352, help="trained tokens per micro-batch")
    p.add_argument("--head-micro", type=int, default=6, help="micro-batches per round")
    p.add_argument("--layout", choices=("per_round", "packed", "budget"), help=argparse.SUPPRESS)
    p.add_argument("--row-budget", type=int, default=None, help="max_row_tokens of the budget layout")
    p.add_argument("--logits", choices=("full", "gathered"), help=argparse.SUPPRESS)
    p.add_argument("--measure", choices=("time", "memory"), help=argparse.SUPPRESS)
    p.add_argument("--attention", choices=("dense", "split"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.block < 1 or args.l1 % args.block or not 1 <= args.steps_per_block <= args.block or args.samples < 1:
        p.error("--l1 must be a multiple of --block, 1 <= --steps-per-block <= --block, --samples >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.layout:  # child process
        print(json.dumps(run_one(args)))
        return
    print(hardware_line())
    if args.head:
        rounds = {way: statistics.median(times) for way, times in head_rounds(args).items()}
        print(f"module a chunk at a time: {rounds['module']:.2f} s a round; plain head: {rounds['plain']:.2f} s "
              f"({rounds['module'] / rounds['plain']:.2f}x faster; medians of {args.rounds} rounds)")
        return
    print(f"workload: L0={args.l0} L1={args.l1} block={args.block} steps/block={args.steps_per_block} "
          f"vocab={args.vocab} hidden={args.hidden} layers={args.layers}, fp32, forward+backward, "
          f"time = fastest of {args.samples} samples x {args.rounds} interleaved rounds after 1 warm-up each, one row "
          f"per micro-batch")
    rows = {config: _child(argv, *config, "memory") for config in CONFIGS}  # deterministic: one run each
    for _ in range(args.rounds):  # every configuration once per round: load bursts hit all of them alike
        for config in CONFIGS:
            seconds = _child(argv, *config, "time")["seconds"]
            rows[config]["seconds"] = min(seconds, rows[config].get("seconds", seconds))
    for config, r in rows.items():
        print(f"{config[0]:>9} + {config[1]:<8} + {config[2]:<5}: rows/sample {r['rows']}, input tokens "
              f"{r['input_tokens']}, trained tokens {r['trained_tokens']}, LM-head rows {r['logit_rows']}, "
              f"{r['seconds']:.2f} s/sample, peak +{r['peak_mib']:.0f} MiB/sample")
    base_key = CONFIGS[0]
    base = rows[base_key]
    for key, r in rows.items():
        if key != base_key:
            print(f"{'+'.join(key)} vs {'+'.join(base_key)}: time {r['seconds'] / base['seconds']:.2f}x, "
                  f"peak memory {r['peak_mib'] / base['peak_mib']:.2f}x")


if __name__ == "__main__":
    main()
