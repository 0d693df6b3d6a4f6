"""One MoE layer (models/moe.py), grouped expert compute vs a loop running every expert on every token, same run:

    python -m bench.moe [--hidden 512 --experts 64 --top-k 8 --inner 256]

Shapes: batch-1 decode (one block of 4 tokens), batch-32 decode (32 x 4 tokens) and a training shape (``--train``
tokens, forward + backward). The defaults are SDAR-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert width
768) scaled down to run in seconds on a CPU; pass the real sizes on a bigger machine. Each time is the minimum over
``--reps`` calls; the routing is the same for both computations.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from models.moe import SparseMoeBlock, grouped_expert_compute, naive_expert_compute


def fastest(reps: int, fn) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_shape(block: SparseMoeBlock, tokens: int, reps: int, train: bool) -> tuple[float, float, float]:
    """(grouped ms, naive ms, max |difference|) for ``tokens`` tokens through ``block``'s experts."""
    x = torch.randn(tokens, block.gate.in_features, requires_grad=train)
    with torch.no_grad():
        _, weights, index = block.route(x)

    def run(compute):
        def call():
            with torch.set_grad_enabled(train):
                out = compute(x, weights, index, block.experts)
                if train:
                    out.square().mean().backward()
            return out
        return call

    grouped, naive = run(grouped_expert_compute), run(naive_expert_compute)
    diff = float((grouped().detach() - naive().detach()).abs().max())
    return fastest(reps, grouped), fastest(reps, naive), diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inner", type=int, default=256)
    p.add_argument("--train", type=int, default=512, help="tokens of the training shape")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                          moe_intermediate_size=args.inner, norm_topk_prob=True)
    block = SparseMoeBlock(cfg)
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, expert width {args.inner}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'shape':<28}{'tokens':>8}{'grouped ms':>12}{'all-experts ms':>16}{'ratio':>8}{'max diff':>11}")
    for name, tokens, train in (("decode batch 1 (block 4)", 4, False), ("decode batch 32 (block 4)", 128, False),
                                ("training fwd+bwd", args.train, True)):
        g, n, diff = time_shape(block, tokens, args.reps, train)
        print(f"{name:<28}{tokens:>8}{g:>12.2f}{n:>16.2f}{n / g:>7.1f}x{diff:>11.1e}")


if __name__ == "__main__":
    main()
