"""One MoE layer (models/moe.py): grouped expert compute (one ``torch._grouped_mm``, no host sync) vs the per-expert
split (the counts read on the host, one product per expert) vs a loop running every expert on every token, same run;
then each MoE family's sampler on its tiny demo model beside its dense sibling's:

    python -m bench.moe [--hidden 512 --experts 64 --top-k 8 --inner 256] [--no-samplers]

Shapes: batch-1 decode (one block of 4 tokens), batch-32 decode (32 x 4 tokens) and a training shape (``--train``
tokens, forward + backward). The defaults are SDAR-30B-A3B's layer (hidden 2048, 128 experts, top-8, expert width
768) scaled down to run in seconds on a CPU; pass the real sizes on a bigger machine. Each time is the minimum over
``--reps`` calls; the routing is the same for both computations.

Samplers: tokens/s of greedy sampling (no early stop, so every run writes ``--max-tokens`` tokens per prompt) at
batch 1 and batch ``--batch`` on the tiny ``demo``-size model of each MoE family (models/tiny.py: 8 experts, top-2)
and of the dense family with the same attention (SDAR for the block models, LLaDA for LLaDA-MoE); block models decode
4-token blocks with the dynamic threshold 0.9 and the prefix cache, full-attention ones take one step per token
without a cache. The best of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from models.moe import SparseMoeBlock, grouped_expert_compute, naive_expert_compute

# the three computations of one layer's experts, same arguments
COMPUTE = {
    "grouped": lambda x, w, i, e: grouped_expert_compute(x, w, i, e.gate_up_proj, e.down_proj, grouped=True),
    "split": lambda x, w, i, e: grouped_expert_compute(x, w, i, e.gate_up_proj, e.down_proj, grouped=False),
    "every": naive_expert_compute,
}

# each MoE family and the dense family with its attention
SIBLINGS = (("sdar_moe", "sdar"), ("llada2", "sdar"), ("llada_moe", "llada"))


def fastest(reps: int, fn) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_shape(block: SparseMoeBlock, tokens: int, reps: int, train: bool) -> tuple[dict[str, float], float]:
    """({computation: ms}, max |difference| from every-expert) for ``tokens`` tokens through ``block``'s experts."""
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

    calls = {name: run(compute) for name, compute in COMPUTE.items()}
    ref = calls["every"]().detach()
    diff = max(float((calls[name]().detach() - ref).abs().max()) for name in ("grouped", "split"))
    return {name: fastest(reps, call) for name, call in calls.items()}, diff


def sampler_runs(model_base: str, batch: int, max_tokens: int, reps: int, size: str = "demo") -> list:
    """The RolloutStats of ``reps`` greedy sampling runs of ``batch`` prompts on the family's tiny model."""
    from models.tiny import build_tiny
    from models.tokenizers import build_demo_tokenizer
    from sample.generate import generate
    from sample.params import SamplingParams

    adapter = build_tiny(model_base, build_demo_tokenizer(), size=size, seed=0)
    block = adapter.attention == "block"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[], block_size=4,
                            remasking_strategy="low_confidence_dynamic" if block else "low_confidence_static",
                            denoising_steps=4, steps=None if block else max_tokens,
                            cache="prefix" if block else "none")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 24, (batch,), generator=g).tolist()
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in lengths]
    return [generate(adapter, prompts, params, progress=False).stats for _ in range(reps)]


def sampler_tokens_per_second(model_base: str, batch: int, max_tokens: int, reps: int) -> float:
    return max(stats.tokens_per_second for stats in sampler_runs(model_base, batch, max_tokens, reps))


def compare_samplers(args: argparse.Namespace) -> None:
    print(f"\nsamplers, tiny demo models ({args.max_tokens} tokens per prompt, greedy, best of {args.reps})")
    print(f"{'family':<12}{'batch':>6}{'tokens/s':>10}{'dense':>8}{'tokens/s':>10}{'MoE/dense':>11}")
    dense_cache: dict[tuple[str, int], float] = {}
    for moe, dense in SIBLINGS:
        for batch in (1, args.batch):
            ours = sampler_tokens_per_second(moe, batch, args.max_tokens, args.reps)
            if (dense, batch) not in dense_cache:
                dense_cache[dense, batch] = sampler_tokens_per_second(dense, batch, args.max_tokens, args.reps)
            ref = dense_cache[dense, batch]
            print(f"{moe:<12}{batch:>6}{ours:>10.1f}{dense:>8}{ref:>10.1f}{ours / ref:>10.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inner", type=int, default=256)
    p.add_argument("--train", type=int, default=512, help="tokens of the training shape")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16, help="prompts of the batched sampler runs")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt of the sampler runs")
    p.add_argument("--no-samplers", action="store_true", help="time the MoE layer only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                          moe_intermediate_size=args.inner, norm_topk_prob=True)
    block = SparseMoeBlock(cfg)
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, expert width {args.inner}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'shape':<28}{'tokens':>8}{'grouped ms':>12}{'split ms':>10}{'all-experts ms':>16}"
          f"{'all/grouped':>13}{'split/grouped':>15}{'max diff':>10}")
    for name, tokens, train in (("decode batch 1 (block 4)", 4, False), ("decode batch 32 (block 4)", 128, False),
                                ("training fwd+bwd", args.train, True)):
        ms, diff = time_shape(block, tokens, args.reps, train)
        g, s, n = ms["grouped"], ms["split"], ms["every"]
        print(f"{name:<28}{tokens:>8}{g:>12.2f}{s:>10.2f}{n:>16.2f}{n / g:>12.1f}x{s / g:>14.2f}x{diff:>10.1e}")
    if not args.no_samplers:
        compare_samplers(args)


if __name__ == "__main__":
    main()
