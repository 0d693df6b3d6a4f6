"""Sampler throughput on a random SDAR-shaped model: batched KV-cached sampler vs baselines, same run.

    python -m bench.sampler                          # tiny model on CPU (hidden 128, 4 layers, demo vocab)
    python -m bench.sampler --preset cpu             # hidden 256: batch 32 becomes compute-bound on 2 CPU cores
    python -m bench.sampler --device cuda --preset 1.7b --batch 64
    python -m bench.sampler --baseline 428247e       # also run the same measurements on an older commit
    python -m bench.sampler --compare-dtypes         # fp32 / fp32 under bf16 autocast / bf16, interleaved rounds
    python -m bench.sampler --preset 135m --batch 128 --group 16 --max-tokens 32   # RL groups: shared prefills

Prints the hardware first, then tokens/s and tokens per forward for: our sampler at batch 1 and batch N, the
no-cache reference path (``cache="none"``: recompute the whole sequence every step) at batch 1 and batch N, and
a loop that samples the N prompts one at a time; then the ratios. Responses have a fixed length (no stops) so
every variant generates the same number of tokens. Each variant runs ``--repeat`` times and the fastest run is
reported (shared machines are noisy).

On CPU, batching pays by amortising per-forward overhead: once a batch-32 forward is compute-bound (the 3.3M-param
``cpu`` preset reaches ~50 GFLOP/s on 2 cores) the batch/loop ratio is capped by FLOPs, not by the sampler.

``--baseline REF`` measures batch 1 (``--loop-prompts`` prompts one at a time), batch N and an AR-equivalent run
(block 1, one step per block: one token per forward, what an autoregressive model of the same shape costs) with
the code of commit REF too, in a subprocess over a temporary ``git worktree`` (same model seed, same prompts, same
machine) that answers one run at a time: every run of ours is paired with a run of REF made just before or just
after it (the order alternates by round), and the median of the paired ratios is printed next to best-of-rounds.
On a shared machine whose load changes within minutes, runs a few minutes apart differ by 20-30%.

``--group K``: the RL rollout's workload, ``--batch`` / K prompts sampled K times each (a task's group), all rows
admitted at once up to ``--max-active``; the sampler prefills each distinct prompt once and keeps the last few for
copies admitted later. Measured against every copy prefilled for itself (the code before), in interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench import hardware_line
from models.registry import make_adapter
from models.sdar import SDARConfig, SDARForCausalLM
from models.tokenizers import build_demo_tokenizer
from sample.generate import RolloutStats, generate
from sample.params import SamplingParams

PRESETS = {  # hidden, layers, heads, kv heads, head dim, mlp, vocab
    "cpu": (256, 4, 8, 2, 32, 768, 0),  # vocabulary of the demo tokenizer (512 tokens)
    "cpu-4096": (256, 4, 8, 2, 32, 768, 4096),
    "cpu-small": (128, 4, 4, 2, 32, 384, 0),
    "cpu-151936": (256, 4, 8, 2, 32, 768, 151936),  # the cpu preset with Qwen3's vocabulary: the LM head dominates
    "135m": (576, 30, 9, 3, 64, 1536, 49152),  # SmolLM2-135M's shape (the real-weights recipe's model)
    "1.7b": (2048, 28, 16, 8, 128, 6144, 151936),  # Qwen3-1.7B / SDAR-1.7B shape
}


def build_adapter(preset: str, device: str, dtype: torch.dtype, block_size: int):
    hidden, layers, heads, kv, head_dim, mlp, vocab = PRESETS[preset]
    tok = build_demo_tokenizer()
    cfg = SDARConfig(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=mlp,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                     block_size=block_size, max_position_embeddings=32768, mask_token_id=tok.mask_token_id,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = SDARForCausalLM(cfg)
    return make_adapter(model.to(dtype).eval(), tok, "sdar")


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of varied lengths (so blocks start at different offsets), ids from the plain BPE range."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 64, (n,), generator=g).tolist()
    return [torch.randint(0, min(vocab, 400), (k,), generator=g).tolist() for k in lengths]


def best_of(repeat: int, fn, *args) -> RolloutStats:
    return min((fn(*args) for _ in range(repeat)), key=lambda s: s.wall_time)


def run(adapter, prompts: list[list[int]], params: SamplingParams, device: str) -> RolloutStats:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out = generate(adapter, prompts, params, progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out.stats


def loop_one_at_a_time(adapter, prompts: list[list[int]], params: SamplingParams, device: str,
                       repeat: int) -> RolloutStats:
    """Sample the prompts one by one (batch 1), the fastest of ``repeat`` runs per prompt, summed."""
    return _summed([best_of(repeat, run, adapter, [p], params, device) for p in prompts])


def _summed(stats: list[RolloutStats]) -> RolloutStats:
    return RolloutStats(**{f: sum(getattr(s, f) for s in stats)
                           for f in ("forwards", "denoise_forwards", "generated_tokens", "wall_time")})


class CoreWorkload:
    """Batch 1 (``--loop-prompts`` prompts one at a time), batch N and the AR-equivalent run (block 1, one step
    per block) on one model, measured one run at a time, so that two versions of the code can alternate run by run.
    Uses only APIs that older commits have too."""

    def __init__(self, args: argparse.Namespace):
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
        self.adapter = build_adapter(args.preset, args.device, self.dtype, args.block_size)
        self.device = args.device
        self.prompts = make_prompts(args.batch, self.adapter.model.config.vocab_size)
        self.params = params = SamplingParams(max_tokens=args.max_tokens, denoising_steps=args.steps,
                                              temperature=1.0, seed=0, ignore_eos=True, stop_token_ids=[],
                                              max_active=args.batch,
                                              **({"compute_dtype": c} if (c := getattr(args, "compute_dtype", None))
                                                 else {}))
        ar = SamplingParams(**{**params.__dict__, "block_size": 1, "denoising_steps": 1})
        loop = self.prompts[: args.loop_prompts]
        self.variants = {"batch 1": (loop, params, True), f"batch {args.batch}": (self.prompts, params, False),
                         "AR-equivalent, batch 1": (loop, ar, True)}
        run(self.adapter, self.prompts[:2], params, self.device)  # warm-up

    def measure(self, key: str) -> list[float]:
        """[tokens/s, forwards per token] of one run of variant ``key``."""
        prompts, params, one_at_a_time = self.variants[key]
        if one_at_a_time:
            stats = _summed([run(self.adapter, [p], params, self.device) for p in prompts])
        else:
            stats = run(self.adapter, prompts, params, self.device)
        return [stats.tokens_per_second, stats.forwards / max(stats.generated_tokens, 1)]


def measure_core(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each variant of ``CoreWorkload``, the fastest of ``--repeat`` runs."""
    work = CoreWorkload(args)
    return {key: max((work.measure(key) for _ in range(args.repeat)), key=lambda m: m[0]) for key in work.variants}


@contextlib.contextmanager
def baseline_server(ref: str, argv: list[str]) -> Iterator[Callable[[str], list[float]]]:
    """``CoreWorkload.measure`` with the code of commit ``ref``: this script in a subprocess over a temporary git
    worktree, answering one measurement per request, so that its runs interleave with ours run by run."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        tree = str(Path(tmp) / "tree")
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", tree, ref], check=True)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--serve"], cwd=tree,
                                env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

        def ask(key: str) -> list[float]:
            proc.stdin.write(key + "\n")
            proc.stdin.flush()
            for line in proc.stdout:  # anything else the code of that commit prints is skipped
                if line.startswith(SERVE_PREFIX):
                    return json.loads(line[len(SERVE_PREFIX):])
            raise RuntimeError(f"the baseline process (commit {ref}) ended with code {proc.wait()}; see its stderr")

        try:
            yield ask
        finally:
            with contextlib.suppress(BrokenPipeError):  # it may have died already (its stderr says why)
                proc.stdin.close()
            proc.wait()
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", tree], check=False)


SERVE_PREFIX = "measured: "


def serve(args: argparse.Namespace) -> None:
    """The baseline side of ``--baseline``: one ``CoreWorkload`` measurement per variant name read from stdin."""
    work = CoreWorkload(args)
    for line in sys.stdin:
        print(SERVE_PREFIX + json.dumps(work.measure(line.strip())), flush=True)


def compare_with_baseline(args: argparse.Namespace, argv: list[str]) -> None:
    with baseline_server(args.baseline, argv) as base:
        ours = CoreWorkload(args)
        pairs: dict[str, list[tuple[list[float], list[float]]]] = {key: [] for key in ours.variants}
        for r in range(args.rounds):
            for key in ours.variants:  # base and ours back to back, in alternating order: load drift hits both
                if r % 2 == 0:
                    b = base(key)
                    pairs[key].append((b, ours.measure(key)))
                else:
                    o = ours.measure(key)
                    pairs[key].append((base(key), o))
    print(f"\nours vs commit {args.baseline} ({args.rounds} rounds, each variant measured back to back on both sides; "
          f"tokens/s best of rounds; batch 1 = {args.loop_prompts} prompts one at a time; paired = the median over "
          f"rounds of ours / base, the steadier figure on a machine whose load comes and goes)")
    print(f"{'variant':<26}{'base tok/s':>12}{'ours tok/s':>12}{'ratio':>8}{'paired':>8}{'base fwd/tok':>14}"
          f"{'ours fwd/tok':>14}")
    for key, runs in pairs.items():
        base_best = max(b[0] for b, _ in runs)
        ours_best = max(o[0] for _, o in runs)
        paired = statistics.median(o[0] / b[0] for b, o in runs)
        print(f"{key:<26}{base_best:>12.1f}{ours_best:>12.1f}{ours_best / base_best:>7.2f}x{paired:>7.2f}x"
              f"{runs[0][0][1]:>14.3f}{runs[0][1][1]:>14.3f}")


DTYPE_VARIANTS = {  # column -> (weights' dtype, the sampler's compute_dtype)
    "fp32": ("float32", None),
    "fp32 w, bf16 compute": ("float32", "bfloat16"),  # an RL run's fp32 master weights, rollout.compute_dtype
    "bf16": ("bfloat16", None),
}


def compare_dtypes(args: argparse.Namespace) -> None:
    """float32 vs bfloat16 sampling with our code, interleaved rounds (bf16 pays on CPUs with AVX512-BF16 / AMX):
    fp32 weights, fp32 weights sampled under bf16 autocast (``compute_dtype``), bf16 weights."""
    rounds = {name: [] for name in DTYPE_VARIANTS}
    for _ in range(args.rounds):
        for name, (dtype, compute) in DTYPE_VARIANTS.items():
            rounds[name].append(measure_core(argparse.Namespace(**{**vars(args), "dtype": dtype,
                                                                   "compute_dtype": compute})))
    flags = _cpu_flags()
    print(f"\nfloat32 vs bfloat16 ({args.rounds} interleaved rounds, best of rounds, tok/s; CPU bf16 support: "
          f"{', '.join(f for f in ('avx512_bf16', 'amx_bf16') if f in flags) or 'none'})")
    print(f"{'variant':<26}" + "".join(f"{name:>22}" for name in DTYPE_VARIANTS) + "  ratios to fp32")
    for key in rounds["fp32"][0]:
        best = {name: max(r[key][0] for r in runs) for name, runs in rounds.items()}
        ratios = " ".join(f"{best[name] / best['fp32']:.2f}x" for name in list(DTYPE_VARIANTS)[1:])
        print(f"{key:<26}" + "".join(f"{v:>22.1f}" for v in best.values()) + f"  {ratios}")


def _prefill_every_copy(runner, prefixes: list[list[int]]):
    """The prefill before prompts shared theirs: every row's prefix computed for itself (the baseline of --group)."""
    from sample.block_runners import PREFILL_TOKENS, _chunks
    from sample.engine import on_device

    rows = [on_device(p, runner.device) for p in prefixes]
    return [runner._prefill(chunk) for chunk in _chunks(rows, PREFILL_TOKENS)]


def compare_group_prefill(args: argparse.Namespace) -> None:
    """Tokens/s of an RL-shaped rollout (``--group`` copies of each prompt): shared prefills vs every copy
    prefilled, one run each per round, alternating which goes first."""
    from sample.block_runners import CachedRunner

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    adapter = build_adapter(args.preset, args.device, dtype, args.block_size)
    distinct = make_prompts(args.batch // args.group, adapter.model.config.vocab_size)
    prompts = [p for p in distinct for _ in range(args.group)]
    params = SamplingParams(max_tokens=args.max_tokens, denoising_steps=args.steps, temperature=1.0, seed=0,
                            ignore_eos=True, stop_token_ids=[], max_active=args.max_active or args.batch)
    shared = CachedRunner._prefilled

    def measure(share: bool) -> RolloutStats:
        CachedRunner._prefilled = shared if share else _prefill_every_copy
        try:
            return run(adapter, prompts, params, args.device)
        finally:
            CachedRunner._prefilled = shared

    measure(True)  # warm-up
    runs: dict[bool, list[RolloutStats]] = {True: [], False: []}
    for r in range(args.rounds):
        for share in ((True, False) if r % 2 else (False, True)):
            runs[share].append(measure(share))
    n_params = sum(p.numel() for p in adapter.model.parameters())
    print(f"model: SDAR-shaped preset {args.preset} ({n_params / 1e6:.1f}M params, {dtype}); {len(distinct)} prompts "
          f"x {args.group} samples ({sum(map(len, distinct)) / len(distinct):.0f} prompt tokens on average), "
          f"{args.max_tokens} tokens each, max_active {params.max_active}, block {args.block_size}, {args.steps} "
          f"steps/block; {args.rounds} rounds")
    print(f"{'prefill':<26}{'forwards':>10}{'best tok/s':>12}{'median tok/s':>14}")
    for share, name in ((False, "every copy (before)"), (True, "shared by the copies")):
        tps = [s.tokens_per_second for s in runs[share]]
        print(f"{name:<26}{runs[share][0].forwards:>10}{max(tps):>12.1f}{statistics.median(tps):>14.1f}")
    paired = statistics.median(a.tokens_per_second / b.tokens_per_second for a, b in zip(runs[True], runs[False]))
    print(f"shared / every copy: {paired:.2f}x (median of the rounds' paired ratios)")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant; the fastest is reported")
    ap.add_argument("--skip-slow", action="store_true", help="skip the no-cache baseline at batch N")
    ap.add_argument("--baseline", default=None, help="also measure the code of this git commit (see above)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the baseline comparison (one run per side "
                    "and variant each)")
    ap.add_argument("--loop-prompts", type=int, default=8, help="prompts sampled one at a time (comparison)")
    ap.add_argument("--compare-dtypes", action="store_true", help="float32 vs bfloat16 sampling (see above)")
    ap.add_argument("--group", type=int, default=None, help="RL groups: --batch / GROUP prompts, GROUP samples each; "
                    "shared vs per-copy prefills (see above)")
    ap.add_argument("--max-active", type=int, default=None, help="rows sampled at once with --group (default: all)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve:
        serve(args)
        return
    if args.group:
        print(hardware_line(args.device))
        compare_group_prefill(args)
        return
    if args.compare_dtypes:
        print(hardware_line(args.device))
        compare_dtypes(args)
        return
    if args.baseline:
        own = [a for i, a in enumerate(argv) if a != "--baseline" and (i == 0 or argv[i - 1] != "--baseline")]
        print(hardware_line(args.device))
        compare_with_baseline(args, [a for a in own if not a.startswith("--baseline=")])
        return
    print(hardware_line(args.device))
    work = CoreWorkload(args)  # the model, prompts and parameters of every measurement here (warmed up)
    adapter, prompts, params = work.adapter, work.prompts, work.params
    n_params = sum(p.numel() for p in adapter.model.parameters())
    print(f"model: SDAR-shaped preset {args.preset} ({n_params / 1e6:.1f}M params, {work.dtype}), block "
          f"{args.block_size}, {args.steps} steps/block, {args.max_tokens} tokens/response, static remasking, "
          f"temperature 1")
    slow = SamplingParams(**{**params.__dict__, "cache": "none"})
    rep, dev = args.repeat, args.device
    results = {
        "ours, batch 1": best_of(rep, run, adapter, prompts[:1], params, dev),
        f"ours, batch {args.batch}": best_of(rep, run, adapter, prompts, params, dev),
        "no-cache, batch 1": best_of(rep, run, adapter, prompts[:1], slow, dev),
    }
    if not args.skip_slow:
        results[f"no-cache, batch {args.batch}"] = best_of(1, run, adapter, prompts, slow, dev)
    results[f"one-at-a-time loop, {args.batch} prompts"] = loop_one_at_a_time(adapter, prompts, params, dev, rep)
    print(f"{'variant':<34}{'tokens':>8}{'forwards':>10}{'tok/fwd':>9}{'wall s':>9}{'tok/s':>10}")
    for name, s in results.items():
        print(f"{name:<34}{s.generated_tokens:>8}{s.forwards:>10}{s.tokens_per_forward:>9.2f}{s.wall_time:>9.2f}"
              f"{s.tokens_per_second:>10.1f}")
    tps = {k: v.tokens_per_second for k, v in results.items()}
    batch_key, loop_key = f"ours, batch {args.batch}", f"one-at-a-time loop, {args.batch} prompts"
    ratio = tps[batch_key] / tps[loop_key]
    print(f"ratio batch {args.batch} / one-at-a-time loop: {ratio:.1f}x (target >= 10x at batch 32 on CPU)")
    print(f"ratio ours / no-cache at batch 1: {tps['ours, batch 1'] / tps['no-cache, batch 1']:.1f}x")
    if not args.skip_slow:
        slow_key = f"no-cache, batch {args.batch}"
        print(f"ratio ours / no-cache at batch {args.batch}: {tps[batch_key] / tps[slow_key]:.1f}x")


if __name__ == "__main__":
    main()
