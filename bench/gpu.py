"""The GPU acceptance run: one command, run first whenever a GPU is at hand (no download: random models from configs).

    python -m bench.gpu                          # ~15 min on one H100: prints a table, writes bench_gpu.json
    python -m bench.gpu --sections sampler --shapes sdar-4b --batches 1,128   # a part of it
    python -m bench.gpu --quick --device cpu     # the same code paths on tiny shapes (a smoke run of this script)

1. Sampler: random bf16 models shaped like SDAR-1.7B and SDAR-4B (Qwen3 shapes, vocabulary 151,936) sample
   ``--tokens`` tokens at batch 1, 32 and 128 with static decoding (4 steps per block of 4) and dynamic decoding
   (threshold 0.9), each run twice (the second, warm run is the figure; the first is kept as ``cold_tok_s``).
   Reported: tokens/s, forwards per token, and two rooflines. Batch 1 is memory-bound: every
   forward streams the weights once, so tokens/s <= tokens per forward x bandwidth / weight bytes (percent of that
   bound printed; the bandwidth comes from the device name, or ``--bandwidth-gbs``). Batch 128 is compute-bound:
   FLOPs ~ 2 x parameters x positions processed, with positions ~ generated tokens x (steps per block + 1) (each
   position of a block is in every denoising forward of its block plus the forward that stores it); percent of
   the dense bf16 peak (``--peak-tflops`` or from the device name). Each run is repeated with
   ``rollout.cuda_graphs`` (fixed-capacity KV cache, one CUDA graph per batch bucket and forward shape): its warm
   tokens/s and the ratio to the eager run.
2. One TraceRL training step (SDAR-1.7B shape, bf16, gradient checkpointing, ``--train-samples`` synthetic
   trajectories of 128 prompt + 512 response tokens): time and peak memory, SDPA vs FlexAttention.
   ``fuse``: the sampler with finished blocks stored fused and separately at each batch size (mixed prompt
   lengths), the measurement behind ``FUSE_MAX_TOKENS["cuda"]`` (sample/block_sampler.py).
3. One MoE layer of SDAR-30B-A3B's shape (hidden 2048, 128 experts, top-8, expert width 768) in bf16: grouped
   expert compute (one grouped product) vs the per-expert split vs every expert on every token at decode and
   training shapes, and the host syncs per forward (counted by torch's sync debug mode; 0 expected).
   ``attention``: one decode step's attention alone (4 queries per row over 128-2,048 cached keys with an invalid
   tail, at the largest batch): SDPA with ``enable_gqa`` and the mask vs the query heads folded into the query axis
   (what ``attend`` runs where ``models.common.FOLD_QUERY_HEADS`` says so) vs no mask (a lower bound); on CUDA also
   each form held to one SDPA kernel. ``--fold-query-heads on|off`` sets that choice for the sampler rows.
4. Smoke runs of the real entry points on this device, each in its own process: ``eval.py`` on the demo config,
   2 steps of ``rl.py`` (full, LoRA, and QLoRA on CUDA), 2 steps of SFT, and a single-GPU DeepSpeed ZeRO-3 RL step
   (``accelerate launch``). The first run that needs the demo SFT model trains it (about a minute on an H100).

5. ``serve``: ``python -m bench.serve`` on this device (SDAR-1.7B shape, bf16): 1, 8 and 32 streaming clients of
   ``serve.py``'s app against offline batched ``generate`` (targets: 0.8x offline batch 32, 8x one client).
6. ``profile``: where a sampler run's time goes, for the last shape (SDAR-4B by default) at the largest batch
   (static decoding, eager and with CUDA graphs), one warm run under torch.profiler: wall time, the device's busy
   time (its kernels' sum; busy / wall says how much the host leaves it idle), kernel launches, host syncs (sync
   debug mode, another run) and the kernels with the most device time; the full table is written beside
   ``--out``. Not in the default sections: ``--sections profile --batches 128`` when the throughput falls short.

``--sections`` runs some of them (a GPU lease may not hold them all); the JSON is rewritten after each section, so a
run stopped at its time limit keeps what it measured. Any failure is printed with its command and makes the exit
status 1; the JSON holds every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # hidden, layers, heads, kv heads, head dim, MLP, vocabulary
    "sdar-1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
    "sdar-4b": (2560, 36, 32, 8, 128, 9728, 151936),
    "tiny": (128, 2, 4, 2, 32, 384, 4096),
}
# public spec-sheet figures (dense bf16 without sparsity; HBM bandwidth), by a substring of the device name
DEVICES = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0)}


def device_figures(device: str, args) -> tuple[float | None, float | None]:
    """(peak bf16 TFLOP/s, bandwidth GB/s) of the device: the options, else the spec sheet by name."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else ""
    known = next((v for k, v in DEVICES.items() if k in name), (None, None))
    return args.peak_tflops or known[0], args.bandwidth_gbs or known[1]


def build_adapter(shape: str, device: str, dtype: torch.dtype, attn_backend: str = "sdpa"):
    from models.registry import make_adapter
    from models.sdar import SDARConfig, SDARForCausalLM
    from models.tokenizers import build_demo_tokenizer

    hidden, layers, heads, kv, head_dim, mlp, vocab = SHAPES[shape]
    tok = build_demo_tokenizer()
    cfg = SDARConfig(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=mlp,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                     block_size=4, max_position_embeddings=8192, mask_token_id=tok.mask_token_id,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, attn_backend=attn_backend)
    torch.manual_seed(0)
    with torch.device(device):
        model = SDARForCausalLM(cfg).to(dtype)
    return make_adapter(model.eval(), tok, "sdar")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ sampler


def _random_prompts(n: int, g: torch.Generator) -> list[list[int]]:
    """``n`` prompts of 16-63 ids from the plain BPE range, drawn from ``g`` (mixed lengths: blocks start at
    different offsets)."""
    return [torch.randint(10, 400, (int(torch.randint(16, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _generate_twice(adapter, prompts: list[list[int]], params, device: str) -> tuple[object, list[float]]:
    """(RolloutStats of the second run, [cold wall, warm wall]). On an H100 a cold batch-128 run was 2.6-3x slower
    than the same run warm (its kernels, its allocator segments for the growing KV cache); rollouts repeat, so the
    warm run is the figure and the cold one is kept beside it."""
    from sample.generate import generate

    walls = []
    for _ in range(2):
        _sync(device)
        start = time.perf_counter()
        stats = generate(adapter, prompts, params, progress=False).stats
        _sync(device)
        walls.append(time.perf_counter() - start)
    return stats, walls


def _graphed(adapter, prompts: list[list[int]], params, device: str, eager_tok_s: float) -> dict:
    """The same run with ``cuda_graphs`` (fixed-capacity cache, graphs per batch bucket; eager on CPU): its warm
    tokens/s and the ratio to the eager run, or the error."""
    try:
        stats, walls = _generate_twice(adapter, prompts, dataclasses.replace(params, cuda_graphs=True), device)
    except Exception as exc:  # noqa: BLE001 - reported in the table and counted as a failure
        return {"cuda_graphs": f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "graphs_error": traceback.format_exc(limit=3)}
    graphs_tok_s = stats.generated_tokens / walls[-1]
    return {"graphs_tok_s": graphs_tok_s, "cold_graphs_tok_s": stats.generated_tokens / walls[0],
            "cuda_graphs": f"{graphs_tok_s:.1f} tok/s ({graphs_tok_s / eager_tok_s:.2f}x eager)"}


def sampler_rows(args, device: str) -> list[dict]:
    from sample.params import SamplingParams

    peak_tflops, bandwidth = device_figures(device, args)
    rows = []
    for shape in args.shapes:
        adapter = build_adapter(shape, device, args.dtype)
        params = sum(p.numel() for p in adapter.model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in adapter.model.parameters())
        g = torch.Generator().manual_seed(0)
        for strategy in ("low_confidence_static", "low_confidence_dynamic"):
            sp = SamplingParams(max_tokens=args.tokens, denoising_steps=4, temperature=1.0, seed=0,
                                ignore_eos=True, stop_token_ids=[], remasking_strategy=strategy,
                                dynamic_threshold=0.9, max_active=max(args.batches), cuda_graphs=False)  # eager
            for batch in args.batches:
                prompts = _random_prompts(batch, g)
                stats, walls = _generate_twice(adapter, prompts, sp, device)
                wall = walls[-1]
                tok_s = stats.generated_tokens / wall
                per_forward = stats.generated_tokens / max(stats.forwards, 1)
                row = {"shape": shape, "params_b": params / 1e9, "strategy": strategy.removeprefix("low_confidence_"),
                       "batch": batch, "tok_s": tok_s, "cold_tok_s": stats.generated_tokens / walls[0],
                       "forwards_per_token": 1 / per_forward, **_graphed(adapter, prompts, sp, device, tok_s)}
                if batch == 1 and bandwidth:
                    row["bandwidth_roofline_pct"] = 100 * tok_s / (per_forward * bandwidth * 1e9 / weight_bytes)
                if batch == max(args.batches) and peak_tflops and strategy.endswith("static"):
                    flops = 2 * params * stats.generated_tokens * (4 + 1)
                    row["compute_roofline_pct"] = 100 * flops / wall / (peak_tflops * 1e12)
                rows.append(row)
                print(f"  sampler {json.dumps(row)}", flush=True)
        del adapter
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def fuse_rows(args, device: str) -> list[dict]:
    """Fused vs separate stores of finished blocks (``sample/block_sampler.FUSE_MAX_TOKENS``): the sampler at each
    batch size with fusing always on and always off, prompts of mixed lengths (rows finish blocks at different
    steps, so some carry a block and some do not). Where fusing stops paying sets that constant for this device."""
    from sample import block_sampler
    from sample.params import SamplingParams

    shape = args.shapes[0]
    adapter = build_adapter(shape, device, args.dtype)
    sp = SamplingParams(max_tokens=args.tokens, denoising_steps=4, temperature=1.0, seed=0, ignore_eos=True,
                        stop_token_ids=[], remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.9,
                        max_active=max(args.batches), cuda_graphs=False)
    g = torch.Generator().manual_seed(1)
    rows, saved, share = [], dict(block_sampler.FUSE_MAX_TOKENS), block_sampler.FUSE_CARRYING_SHARE
    try:
        for batch in args.batches:
            prompts = _random_prompts(batch, g)
            speed = {}
            for mode, limit in (("fused", 1 << 30), ("separate", 0)):  # separate: unless every row carries one
                block_sampler.FUSE_MAX_TOKENS.update(cuda=limit, cpu=limit)
                block_sampler.FUSE_CARRYING_SHARE = share if limit else 1.0
                stats, walls = _generate_twice(adapter, prompts, sp, device)
                speed[mode] = stats.generated_tokens / walls[-1]
            row = {"shape": shape, "batch": batch, "fused_tok_s": speed["fused"],
                   "separate_tok_s": speed["separate"], "fused_over_separate": speed["fused"] / speed["separate"],
                   "fused_forward_tokens": 2 * 4 * batch}
            rows.append(row)
            print(f"  fuse {json.dumps(row)}", flush=True)
    finally:
        block_sampler.FUSE_MAX_TOKENS.update(saved)
        block_sampler.FUSE_CARRYING_SHARE = share
    return rows


# ------------------------------------------------------------------------------------------ training step


def _trajectories(n: int, vocab: int, prompt: int, response: int, block: int = 4):
    """Synthetic records: every block decodes one token per step, in a random order inside the block."""
    import random

    from sample.trajectory import Trajectory

    rng = random.Random(0)
    out = []
    for i in range(n):
        steps = []
        for k in range(response // block):
            order = list(range(1, block + 1))
            rng.shuffle(order)
            steps += [k * block + s for s in order]
        out.append(Trajectory(prompt_ids=[rng.randrange(10, 400) for _ in range(prompt)],
                              response_ids=[rng.randrange(10, 400) for _ in range(response)], step_map=steps,
                              logprobs=[-5.0] * response, sample_id=str(i)))
    return out


def training_rows(args, device: str) -> list[dict]:
    from train.accelerator import build_accelerator
    from train.policy_trainer import PolicyTrainer
    from train.settings import OptimizerParams, RLTrainingConfig

    rows = []
    shape = args.train_shape
    prompt, response = (128, 512) if not args.quick else (16, 32)
    for backend in ("sdpa", "flex") if device.startswith("cuda") else ("sdpa",):  # no flex backward on CPU
        try:
            adapter = build_adapter(shape, device, args.dtype, attn_backend=backend)
            cfg = RLTrainingConfig(batch_size_lm=1, gradient_checkpointing_enable=True, mixed_precision="no")
            acc = build_accelerator(mixed_precision="no", micro_batch_size=1)
            trainer = PolicyTrainer(adapter, cfg, OptimizerParams(learning_rate=1e-6), accelerator=acc)
            trajs = _trajectories(args.train_samples, adapter.model.config.vocab_size, prompt, response)
            advantages = {t.sample_id: (1.0 if i % 2 else -1.0) for i, t in enumerate(trajs)}
            trainer.train_step(trajs, advantages)  # warm-up (kernels; FlexAttention compiles here)
            _sync(device)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            trainer.train_step(trajs, advantages)
            _sync(device)
            row = {"shape": shape, "attention": backend, "samples": len(trajs), "seconds": time.perf_counter() - start,
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None}
        except Exception as err:  # noqa: BLE001 - reported in the table; the run goes on
            row = {"shape": shape, "attention": backend, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            traceback.print_exc()
        rows.append(row)
        print(f"  training {json.dumps(row)}", flush=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ profile


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def profile_rows(args, device: str) -> list[dict]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from sample.generate import generate
    from sample.params import SamplingParams

    cuda = device.startswith("cuda")
    shape, batch, tokens = args.shapes[-1], max(args.batches), min(args.tokens, 64)
    adapter = build_adapter(shape, device, args.dtype)
    g = torch.Generator().manual_seed(2)
    prompts = _random_prompts(batch, g)
    rows = []
    for mode, graphs in (("eager", False), ("graphs", True)):
        sp = SamplingParams(max_tokens=tokens, denoising_steps=4, temperature=1.0, seed=0, ignore_eos=True,
                            stop_token_ids=[], remasking_strategy="low_confidence_static", max_active=batch,
                            cuda_graphs=graphs)
        run = lambda sp=sp: generate(adapter, prompts, sp, progress=False)  # noqa: E731
        run()  # warm: kernels, allocator, captures
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            out = run()
            _sync(device)
            wall = time.perf_counter() - start
        events = prof.key_averages()
        # the device's own events (kernels, copies): a CPU op's device time repeats its kernels'
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        busy_us = sum(e.self_device_time_total for e in kernels) if cuda else None
        launches = sum(e.count for e in events if e.key in LAUNCH_CALLS)
        by = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = Path(args.out).with_suffix(f".profile_{mode}.txt")
        table.write_text(events.table(sort_by=by, row_limit=30))
        top = sorted(kernels if cuda else events, key=lambda e: getattr(e, by), reverse=True)[:6]
        row = {"shape": shape, "batch": batch, "mode": mode, "tokens": out.stats.generated_tokens,
               "forwards": out.stats.forwards, "wall_s": wall, "tok_s": out.stats.generated_tokens / wall,
               "device_busy_s": None if busy_us is None else busy_us / 1e6,
               "device_busy_pct": None if busy_us is None else 100 * busy_us / 1e6 / wall,
               "kernel_launches": launches if cuda else None, "host_syncs": _host_syncs(device, run),
               "top_ms": {e.key[:60]: getattr(e, by) / 1e3 for e in top}, "table": str(table)}
        rows.append(row)
        print(f"  profile {json.dumps(row)}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ decode attention


def attention_rows(args, device: str) -> list[dict]:
    """One decode step's attention, alone: a block of 4 queries per row over a cache of ``keys`` columns whose
    tail is invalid (each row's valid length drawn from [keys / 2, keys], as in the fixed-capacity cache), for
    each ``--shapes`` at the largest ``--batches``. Three ways: SDPA with ``enable_gqa`` and the additive mask;
    the query heads that share a K/V head folded into the query axis (``models.common._grouped_query_attention``);
    and no mask at all, a lower bound that ignores validity. The measurement behind
    ``models.common.FOLD_QUERY_HEADS["cuda"]`` (the batch-128 profile put a quarter of the graphed step in this
    call; folded, it was 2.0-2.8x faster on the SDAR-4B shape on an H100)."""
    batch, rows = max(args.batches), []
    for shape in args.shapes:
        for keys in ((32, 64) if args.quick else (128, 512, 2048)):
            rows.append(_decode_attention_row(shape, batch, keys, device, args.dtype))
            print(f"  attention {json.dumps(rows[-1])}", flush=True)
    return rows


def _decode_attention_row(shape: str, batch: int, keys: int, device: str, dtype: torch.dtype) -> dict:
    from models.common import _grouped_query_attention, mask_per_group

    _, _, heads, kv, head_dim, _, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(keys)
    q = torch.randn(batch, heads, 4, head_dim, generator=g).to(device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv, keys, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    valid = torch.arange(keys)[None] < torch.randint(keys // 2, keys + 1, (batch, 1), generator=g)
    mask = torch.zeros(batch, 1, 4, keys, dtype=dtype).masked_fill_(~valid[:, None, None], float("-inf")).to(device)
    folded_mask = mask_per_group(mask, heads // kv)

    def gqa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def folded() -> torch.Tensor:
        return _grouped_query_attention(q, k, v, folded_mask)

    def unmasked() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with torch.no_grad():
        row = {"shape": shape, "batch": batch, "keys": keys, "gqa_ms": _best_ms(device, gqa),
               "folded_ms": _best_ms(device, folded), "no_mask_ms": _best_ms(device, unmasked),
               "max_diff": float((folded() - gqa()).float().abs().max())}
        if device.startswith("cuda"):  # which fused kernel SDPA picks decides the masked forms' cost: each one alone
            row["one_kernel_ms"] = {f"{name}_{kernel.split('_')[0].lower()}": _kernel_ms(device, fn, kernel)
                                    for kernel in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
                                    for name, fn in (("gqa", gqa), ("folded", folded))}
        return row


def _kernel_ms(device: str, fn, kernel: str) -> float | None:
    """``fn``'s best time with SDPA held to one kernel; None where that kernel refuses the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, kernel)]):
            return _best_ms(device, fn)
    except RuntimeError:
        return None


# ------------------------------------------------------------------------------------------ MoE layer

MOE_LAYER = {"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}


def _host_syncs(device: str, fn) -> int | None:
    """How many times ``fn`` makes the host wait for the device (torch's sync debug mode warns at each), warm: the
    first call is not counted (on an H100 the bench's first MoE block forward synced once, its later shapes never)."""
    if not device.startswith("cuda"):
        return None
    import warnings

    fn()
    _sync(device)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _best_ms(device: str, fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def moe_rows(args, device: str) -> list[dict]:
    from types import SimpleNamespace

    from bench.moe import COMPUTE
    from models.moe import SparseMoeBlock

    layer = dict(MOE_LAYER) if not args.quick else {**MOE_LAYER, "hidden_size": 128, "num_experts": 16,
                                                     "moe_intermediate_size": 64}
    torch.manual_seed(0)
    block = SparseMoeBlock(SimpleNamespace(**layer, norm_topk_prob=True)).to(device=device, dtype=args.dtype)
    grouped, split, every = COMPUTE["grouped"], COMPUTE["split"], COMPUTE["every"]
    rows = []
    for name, tokens, train in (("decode batch 1", 4, False), ("decode batch 32", 128, False),
                                ("training fwd+bwd", 512 if args.quick else 4096, True)):
        x = torch.randn(tokens, layer["hidden_size"], device=device, dtype=args.dtype, requires_grad=train)
        with torch.no_grad():
            _, weights, index = block.route(x)
        weights = weights.to(args.dtype)

        def call(compute, x=x, weights=weights, index=index, train=train):
            with torch.set_grad_enabled(train):
                out = compute(x, weights, index, block.experts)
                if train:
                    out.float().square().mean().backward()
            return out

        diff = float((call(grouped) - call(every)).detach().float().abs().max())
        row = {"layer": "sdar-30b-a3b", "shape": name, "tokens": tokens,
               "grouped_ms": _best_ms(device, lambda: call(grouped)),
               "split_ms": _best_ms(device, lambda: call(split)),
               "all_experts_ms": _best_ms(device, lambda: call(every)), "max_diff": diff,
               "host_syncs_per_forward": _host_syncs(device, lambda x=x: block(x.detach()))}
        rows.append(row)
        print(f"  moe {json.dumps(row)}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ smoke runs


def _zero3_single_gpu_config(out: Path) -> Path:
    text = (ROOT / "accelerate_configs" / "cpu_zero3_2proc.yaml").read_text()
    path = out / "zero3_1gpu.yaml"
    path.write_text(text.replace("num_processes: 2", "num_processes: 1"))
    return path


def smoke_commands(tmp: Path, quick: bool) -> dict[str, list[str]]:
    py = sys.executable
    runs = f"experiment.output_dir={tmp / 'runs'}"
    # no evaluation inside the RL runs: eval.py is its own smoke run, and the demo's held-out set takes minutes
    rl = ["config=configs/demo/rl_demo.yaml", runs, "experiment.total_step=2", "experiment.eval_every=0",
          "experiment.save_every=2", "rollout.num_task_per_step=8", "rollout.num_response_per_task=4"]
    lora = ["lora.enabled=true", "lora.rank=8", "lora.alpha=16"]
    return {
        "eval.py": [py, "eval.py", "config=configs/demo/eval_demo.yaml", runs, "rollout.num_response_per_task=1"],
        "rl.py 2 steps": [py, "rl.py", *rl],
        "rl.py LoRA 2 steps": [py, "rl.py", *rl, "experiment.project=rl_lora", *lora],
        "rl.py QLoRA 2 steps": [py, "rl.py", *rl, "experiment.project=rl_qlora", *lora, "lora.load_in_4bit=true"],
        "SFT 2 steps": [py, "train/sft_sdar.py", "config=configs/demo/sft_demo.yaml", runs,
                        "experiment.project=sft_smoke", "training.max_steps=2"],
        "ZeRO-3 RL step (1 GPU)": [py, "-m", "accelerate.commands.launch", "--config_file",
                                   str(_zero3_single_gpu_config(tmp)), "rl.py", *rl, "experiment.project=rl_zero3",
                                   "experiment.total_step=1", "experiment.save_every=1", "experiment.eval_every=0"],
    }


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root, output captured; past ``timeout`` it is killed and reported as failed (one
    hung run must not take the rest of the acceptance run with it)."""
    try:
        return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        return subprocess.CompletedProcess(cmd, -1, out, f"timed out after {timeout:.0f} s")


def smoke_rows(args, device: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, cmd in smoke_commands(Path(d), args.quick).items():
            if (name.startswith("ZeRO-3") or "QLoRA" in name) and not device.startswith("cuda"):
                continue  # the CPU ZeRO-3 path has its own 2-process tests; QLoRA is CUDA only
            start = time.perf_counter()
            proc = _run(cmd, timeout=1800)
            row = {"run": name, "ok": proc.returncode == 0, "seconds": time.perf_counter() - start,
                   "last_line": (proc.stdout.strip().splitlines() or [""])[-1][:300]}  # e.g. the step's timings
            if proc.returncode != 0:
                row["command"] = " ".join(cmd)
                row["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
                print(proc.stderr[-3000:], file=sys.stderr)
            rows.append(row)
            print(f"  smoke {json.dumps(row)}", flush=True)
    return rows


def serve_rows(args, device: str) -> list[dict]:
    """``python -m bench.serve`` on this device (its own processes: server, clients, offline baseline), SDAR-1.7B
    shape in bf16 (``--quick``: the CPU demo shape): 1, 8 and 32 streaming clients against offline batched
    ``generate``; the serving targets are >= 0.8x offline batch 32 and >= 8x one client at 32 clients."""
    quick = ["--preset", "cpu-small", "--prompts", "4", "--clients", "1,2", "--max-tokens", "8"]
    full = ["--preset", "1.7b", "--dtype", "bfloat16", "--prompts", "32", "--clients", "1,8,32"]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "serve.json"
        cmd = [sys.executable, "-m", "bench.serve", "--device", device, "--rounds", "1", "--json", str(out),
               *(quick if args.quick else full)]
        proc = _run(cmd, timeout=900)
        if proc.returncode != 0 or not out.is_file():
            print(proc.stderr[-3000:], file=sys.stderr)
            return [{"error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300],
                     "command": " ".join(cmd)}]
        result = json.loads(out.read_text())
    rows = [{"preset": result["preset"], "offline_batch_tok_s": result["offline_batch_tok_s"], **level}
            for level in result["levels"]]
    for row in rows:
        print(f"  serve {json.dumps(row)}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ report


def report(result: dict) -> str:
    lines = [result["device"], "", "sampler (tokens/s; forwards/token; % of the roofline):"]
    for r in result.get("sampler", []):
        roof = "".join(f"  {k.split('_')[0]} {r[k]:.0f}%" for k in ("bandwidth_roofline_pct", "compute_roofline_pct")
                       if k in r)
        lines.append(f"  {r['shape']:<10} {r['strategy']:<8} batch {r['batch']:>4}: {r['tok_s']:>9.1f} tok/s  "
                     f"{r['forwards_per_token']:.3f} fwd/tok{roof}  CUDA graphs: {r['cuda_graphs']}")
    lines.append("training step (TraceRL, gradient checkpointing):")
    for r in result.get("training", []):
        what = (f"{r['seconds']:.2f} s, peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None
                else f"{r['seconds']:.2f} s") if "error" not in r else f"FAILED {r['error']}"
        lines.append(f"  {r['shape']} {r['attention']:<5}: {what}")
    if result.get("fuse"):
        lines.append("finished blocks stored fused vs separately (FUSE_MAX_TOKENS; tokens/s, warm):")
        for r in result["fuse"]:
            lines.append(f"  {r['shape']:<10} batch {r['batch']:>4} ({r['fused_forward_tokens']:>5} tokens fused): "
                         f"fused {r['fused_tok_s']:.1f}, separate {r['separate_tok_s']:.1f} "
                         f"({r['fused_over_separate']:.2f}x)")
    if result.get("moe"):
        lines.append("MoE layer (SDAR-30B-A3B shape; grouped vs every expert on every token):")
        for r in result["moe"]:
            lines.append(f"  {r['shape']:<18} {r['tokens']:>5} tokens: grouped {r['grouped_ms']:.2f} ms, split "
                         f"{r['split_ms']:.2f} ms, all experts {r['all_experts_ms']:.2f} ms "
                         f"({r['all_experts_ms'] / r['grouped_ms']:.1f}x), "
                         f"host syncs per forward {r['host_syncs_per_forward']}")
    if result.get("attention"):
        lines.append("decode attention (4 queries per row over a cache with an invalid tail; ms per call):")
        for r in result["attention"]:
            lines.append(f"  {r['shape']:<10} batch {r['batch']:>4}, {r['keys']:>5} keys: enable_gqa + mask "
                         f"{r['gqa_ms']:.3f}, heads folded {r['folded_ms']:.3f} "
                         f"({r['gqa_ms'] / r['folded_ms']:.2f}x), no mask {r['no_mask_ms']:.3f}; "
                         f"max diff {r['max_diff']:.1e}")
            if r.get("one_kernel_ms"):
                lines.append("    one kernel: " + ", ".join(f"{k} {'refused' if v is None else f'{v:.3f}'}"
                                                         for k, v in r["one_kernel_ms"].items()))
    if result.get("profile"):
        lines.append("where a sampler run's time goes (static decoding, under torch.profiler):")
        for r in result["profile"]:
            busy = "" if r["device_busy_pct"] is None else f", device busy {r['device_busy_pct']:.0f}% of it"
            lines.append(f"  {r['shape']} batch {r['batch']} {r['mode']:<6}: {r['wall_s']:.2f} s{busy}, "
                         f"{r['kernel_launches']} launches, {r['host_syncs']} host syncs in {r['forwards']} "
                         f"forwards; top: " + ", ".join(f"{k} {v:.0f} ms" for k, v in list(r["top_ms"].items())[:3]))
    if result.get("serve"):
        lines.append("serving (streaming clients vs offline batched generate; targets 0.8x batch, 8x one client):")
        for r in result["serve"]:
            lines.append(f"  FAILED {r['error']}" if "error" in r else
                         f"  {r['preset']} {r['clients']:>3} clients: {r['tok_s']:9.1f} tok/s, first text p50 "
                         f"{r['ttft_p50']:.3f} s, {r['vs_batch']:.2f}x offline batch, "
                         f"{r['vs_one_client']:.2f}x one client")
    lines.append("smoke runs:")
    for r in result.get("smoke", []):
        lines.append(f"  {r['run']:<24} {'ok' if r['ok'] else 'FAILED ' + r['error']} ({r['seconds']:.0f} s)")
    return "\n".join(lines)


SECTIONS = {"sampler": sampler_rows, "fuse": fuse_rows, "training": training_rows, "moe": moe_rows,
            "smoke": smoke_rows, "serve": serve_rows, "profile": profile_rows, "attention": attention_rows}
DEFAULT_SECTIONS = ["sampler", "fuse", "training", "moe", "attention", "smoke", "serve"]


def _fold_query_heads(device: str, choice: str) -> bool:
    """Sets (``on`` / ``off``) or reads (``default``) whether decode attention folds query heads on ``device``."""
    from models import common

    kind = torch.device(device).type
    if choice != "default":
        common.FOLD_QUERY_HEADS[kind] = choice == "on"
    return common.FOLD_QUERY_HEADS.get(kind, True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, batches 1 and 4 (a smoke run of this script)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens sampled per prompt")
    ap.add_argument("--train-samples", type=int, default=8)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by device name)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: by device name)")
    ap.add_argument("--out", default="bench_gpu.json")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"some of {','.join(SECTIONS)}")
    ap.add_argument("--shapes", default=None, help=f"sampler model shapes, some of {','.join(SHAPES)}")
    ap.add_argument("--batches", default=None, help="sampler batch sizes, e.g. 1,32,128")
    ap.add_argument("--fold-query-heads", choices=("default", "on", "off"), default="default",
                    help="fold query heads in decode attention (models.common.FOLD_QUERY_HEADS), in-process sections")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := [s for s in sections if s not in SECTIONS]:
        ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    args.shapes = args.shapes.split(",") if args.shapes else ["tiny"] if args.quick else ["sdar-1.7b", "sdar-4b"]
    args.train_shape = "tiny" if args.quick else "sdar-1.7b"
    args.batches = ([int(b) for b in args.batches.split(",")] if args.batches
                    else [1, 4] if args.quick else [1, 32, 128])
    args.tokens = 16 if args.quick else args.tokens
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if not args.device.startswith("cuda") and not args.quick:
        print("bench.gpu: no CUDA device; run with --quick --device cpu for a smoke run of this script",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    result = {"device": f"device: {name}, torch {torch.__version__}", "command": " ".join(sys.argv),
              "fold_query_heads": _fold_query_heads(args.device, args.fold_query_heads)}
    print(result["device"], flush=True)
    for section in sections:
        result[section] = SECTIONS[section](args, args.device)
        Path(args.out).write_text(json.dumps(result, indent=1))  # kept if a later section is cut off
    print(report(result))
    failed = ([r for r in result.get("training", []) if "error" in r]
              + [r for r in result.get("sampler", []) if "graphs_error" in r]
              + [r for r in result.get("smoke", []) if not r["ok"]]
              + [r for r in result.get("serve", []) if "error" in r])
    print(f"{len(failed)} failure(s); numbers in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
