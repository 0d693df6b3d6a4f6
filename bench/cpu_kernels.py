"""The two CPU decode kernels of the sampler against what they replace, same run:

    python -m bench.cpu_kernels

- projections: a layer's q/k/v, output, gate/up and down products as ``nn.Linear`` calls (MKL sgemm, which packs
  the weight again on every call) vs the pre-packed groups of ``models.layers.packed_projections``; the weights
  of several layers are cycled, as in a forward, so they come from L3 and not from a warm L2; and the packed
  groups as bf16 copies under bf16 autocast (``rollout.compute_dtype=bfloat16``; pays where the CPU multiplies
  bf16 natively: AVX512-BF16 / AMX);
- attention: SDPA with ``enable_gqa`` vs ``models.common._grouped_query_attention`` (query heads of a K/V head
  folded into the query axis) at decode shapes, with the maximum difference of their outputs;
- threads: small ops on the main thread vs the same ops on a second thread once the main thread has run torch
  (each calling thread gets its own OpenMP team; past one team per core libgomp stops spin-waiting): why
  serve.py drives its engine on the main thread (jobs/serve_engine.py).

Each time is the minimum over ``--reps`` calls, taken in ``--rounds`` interleaved rounds (the machine's load comes
and goes; the minimum is the figure least disturbed by it).
"""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from models.common import _grouped_query_attention, mask_per_group
from models.layers import packed_projections, silu_mul
from models.qwen_layers import QwenAttention, QwenMLP


def fastest(reps: int, fn, *args) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


class _Layer(torch.nn.Module):
    """The projection groups of one SDAR-shaped layer, applied as its forward applies them."""

    def __init__(self, hidden: int, heads: int, kv: int, head_dim: int, mlp: int):
        super().__init__()
        cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads,
                              num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6)
        self.attn = QwenAttention(cfg, 0, qkv_bias=False, qk_norm=False)
        self.mlp = QwenMLP(cfg)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        q, _, _ = self.attn.project("qkv", x)
        h = x + self.attn.project("out", q)  # q stands in for the attention output (same width)
        return h + self.mlp.project("down", silu_mul(*self.mlp.project("gate_up", h)))


def _forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> None:
    for layer in layers:
        layer.run(x)


def bench_projections(args: argparse.Namespace) -> None:
    hidden, heads, kv, head_dim, mlp = args.hidden, args.hidden // 32, max(args.hidden // 128, 1), 32, 3 * args.hidden
    layers = torch.nn.ModuleList(_Layer(hidden, heads, kv, head_dim, mlp) for _ in range(args.layers)).eval()
    print(f"projections of {args.layers} layers (hidden {hidden}, mlp {mlp}), per layer, us; bf16 packed: the fp32 "
          f"weights packed as bf16 copies under bf16 autocast (rollout.compute_dtype=bfloat16)")
    print(f"{'tokens':>8}{'nn.Linear':>12}{'packed':>10}{'ratio':>8}{'bf16 packed':>13}{'vs packed':>11}")
    for tokens in args.tokens:
        x = torch.randn(1, tokens, hidden)
        plain, packed, bf16 = [], [], []
        with torch.inference_mode():
            for _ in range(args.rounds):
                plain.append(fastest(args.reps, _forward, layers, x))
                with packed_projections(layers):
                    packed.append(fastest(args.reps, _forward, layers, x))
                with torch.autocast("cpu", dtype=torch.bfloat16), packed_projections(layers):
                    bf16.append(fastest(args.reps, _forward, layers, x))
        a, b, c = (min(t) / args.layers for t in (plain, packed, bf16))
        print(f"{tokens:>8}{a:>12.1f}{b:>10.1f}{a / b:>7.2f}x{c:>13.1f}{b / c:>10.2f}x")


def _gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bench_attention(args: argparse.Namespace) -> None:
    print("\ncached decode attention (8 query heads, 2 K/V heads, head dim 32), us")
    print(f"{'batch':>6}{'queries':>9}{'keys':>7}{'enable_gqa':>12}{'grouped':>10}{'ratio':>8}{'max diff':>10}")
    for batch, queries, keys in ((1, 4, 150), (1, 8, 300), (32, 4, 100), (32, 8, 200), (32, 8, 1000)):
        q = torch.randn(batch, queries, 8, 32).transpose(1, 2)
        k, v = torch.randn(batch, 2, keys, 32), torch.randn(batch, 2, keys, 32)
        mask = torch.zeros(batch, 1, queries, keys)
        mask[..., keys - 3:] = float("-inf")
        grouped_mask = mask_per_group(mask, 4)
        a = min(fastest(args.reps, _gqa, q, k, v, mask) for _ in range(args.rounds))
        b = min(fastest(args.reps, _grouped_query_attention, q, k, v, grouped_mask) for _ in range(args.rounds))
        diff = (_gqa(q, k, v, mask) - _grouped_query_attention(q, k, v, grouped_mask)).abs().max().item()
        print(f"{batch:>6}{queries:>9}{keys:>7}{a:>12.1f}{b:>10.1f}{a / b:>7.2f}x{diff:>10.1e}")


def _thread_ops() -> dict:
    x, w, big = torch.randn(128, 256), torch.randn(1024, 256), torch.randn(256, 4096)
    return {"linear 128x256 @ 256x1024": lambda: F.linear(x, w),
            "linear 8x256 @ 256x1024": lambda: F.linear(x[:8], w),
            "softmax 256x4096": lambda: torch.softmax(big, -1), "add 256x4096": lambda: big + 1.0}


def bench_threads(args: argparse.Namespace) -> None:
    print(f"\nsmall ops back to back on the main thread vs a second thread ({torch.get_num_threads()} torch "
          "threads), us per call (best round)")
    print(f"{'op':>28}{'main':>9}{'second':>9}{'ratio':>8}")
    ops, times = _thread_ops(), {}

    def time_ops(where: str) -> None:  # back to back, as in a forward: the mean call of a run of them
        for name, fn in ops.items():
            fn()
            start = time.perf_counter()
            for _ in range(args.reps * 10):
                fn()
            mean = (time.perf_counter() - start) / (args.reps * 10) * 1e6
            times[(name, where)] = min(times.get((name, where), float("inf")), mean)

    for _ in range(args.rounds):  # interleaved: the machine's load drifts
        time_ops("main")
        worker = threading.Thread(target=time_ops, args=("second",))
        worker.start()
        worker.join()
    for name in ops:
        main_us, second_us = times[(name, "main")], times[(name, "second")]
        print(f"{name:>28}{main_us:>9.1f}{second_us:>9.1f}{second_us / main_us:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8, help="layers whose weights are cycled")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 128])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_projections(args)
    bench_attention(args)
    bench_threads(args)


if __name__ == "__main__":
    main()
