"""Memory and time of one SFT step and one RL step: full fine-tuning vs LoRA r=16 and r=128, in the same run.

    python -m bench.memory                 # a ~100M-parameter SDAR built from a config (no download), on CPU
    python -m bench.memory --quick         # a ~10M model, for a smoke run

Every (mode, job) pair runs in a fresh process: load the job (``SFTJob`` / ``RLJob`` from the demo configs, the
model swapped for the bench model), one warm-up step (thread pools, kernel workspaces and the optimizer's states
are allocated once), then one measured step. Reported per pair: trainable parameters, optimizer-state bytes
(AdamW's two moments; what LoRA saves most), the measured step's wall time and its peak memory. Peak memory: on
CUDA ``torch.cuda.max_memory_allocated`` over the step; on CPU the process's peak resident set over the step
(``/proc/self/clear_refs`` resets it before the step) with glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensor
buffers go back to the OS and the resident set follows live tensors. It holds the weights, the gradients, the
optimizer states and the step's activations; the resident set of the interpreter after its imports, measured before
the job loads, is subtracted. An RL step is sampling
(with LoRA on CPU: the packed products, the base weights packed and the adapters beside them) + scoring + old
log-probs + training; an SFT step is one optimizer step on ``--sft-samples`` samples. Last, the LoRA r=16 policy's
sampling speed on the packed products (what rollouts use) vs through peft's own layers (each adapted projection
runs unpacked and adds its low-rank product).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import hardware_line

MODES = {"full": None, "lora_r16": 16, "lora_r128": 128}
SIZES = {  # hidden, layers, heads, kv heads, MLP
    "100m": (768, 14, 12, 4, 2304),
    "quick": (256, 4, 8, 2, 768),
}


def _rss_kib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current resident set


def _peak_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return float(next(line.split()[1] for line in f if line.startswith("VmHWM:"))) / 1024


def save_model(out: Path, size: str) -> tuple[Path, int]:
    """A random SDAR of ``size`` written as a checkpoint; returns the folder and its parameter count."""
    from models.sdar import SDARConfig, SDARForCausalLM
    from models.tokenizers import build_demo_tokenizer

    tok = build_demo_tokenizer()
    hidden, layers, heads, kv, mlp = SIZES[size]
    cfg = SDARConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, block_size=4,
                     max_position_embeddings=2048, mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                     eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = SDARForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def _lora_args(mode: str) -> list[str]:
    rank = MODES[mode]
    return [] if rank is None else ["lora.enabled=true", f"lora.rank={rank}", f"lora.alpha={2 * rank}"]


def _optimizer_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def measure_sft(model: Path, mode: str, out: Path, args) -> dict:
    from jobs.config import load_config
    from jobs.sft import SFTJob

    cfg = load_config(["config=configs/demo/sft_demo.yaml", f"model.pretrained_model={model}",
                       f"experiment.output_dir={out}", "experiment.project=sft", "model.init_tiny_if_missing=false",
                       f"training.samples_per_step={args.sft_samples}", f"training.batch_size_lm={args.micro_batch}",
                       "dataset.builtin_size=64", *_lora_args(mode)], "sft")
    job = SFTJob(cfg, progress=False)
    job.prepare()
    try:
        job.trainer.train_samples(job.batch(0))  # warm-up: allocates the optimizer's states
        _reset_peak()
        start = time.perf_counter()
        job.trainer.train_samples(job.batch(1))
        seconds = time.perf_counter() - start
        return {"trainable": _trainable(job.trainer.model), "optimizer_bytes": _optimizer_bytes(job.trainer.optimizer),
                "seconds": seconds, "peak_mib": _peak_mib()}
    finally:
        job.close()


def measure_rl(model: Path, mode: str, out: Path, args) -> dict:
    from jobs.config import load_config
    from jobs.rl import RLJob

    cfg = load_config(["config=configs/demo/rl_demo.yaml", f"model.pretrained_model={model}",
                       f"experiment.output_dir={out}", "experiment.project=rl", "model.init_tiny_if_missing=false",
                       "experiment.eval_every=0", "experiment.total_step=2", f"rollout.num_task_per_step={args.tasks}",
                       f"rollout.num_response_per_task={args.k}", f"rollout.max_tokens={args.tokens}",
                       "reward.filter_all_equal=false", "reward.acc_low=0.0", "reward.acc_high=1.0",
                       f"training.batch_size_lm={args.micro_batch}", *_lora_args(mode)], "rl")
    job = RLJob(cfg, progress=False)
    job.prepare()
    try:
        job.root.mkdir(parents=True, exist_ok=True)
        job.one_step(1, job.root)  # warm-up
        _reset_peak()
        start = time.perf_counter()
        metrics = job.one_step(2, job.root)
        seconds = time.perf_counter() - start
        return {"trainable": _trainable(job.trainer.model), "optimizer_bytes": _optimizer_bytes(job.trainer.optimizer),
                "seconds": seconds, "peak_mib": _peak_mib(), "sample_s": job.timers.get("sample", 0.0),
                "optimizer_steps": metrics.get("optimizer_steps", 0)}
    finally:
        job.close()


def measure_sampling(model: Path, mode: str, out: Path, args) -> dict:
    """Tokens/s of the LoRA r=16 policy sampling on the packed products (ours) vs through peft's own layers."""
    import contextlib

    import models.layers as layers
    import sample.generate as gen
    from models.lora import LoraSettings, wrap
    from models.registry import load_model
    from sample.params import SamplingParams

    adapter = wrap(load_model({"pretrained_model": str(model), "model_base": "sdar", "dtype": "float32"}),
                   LoraSettings(enabled=True, rank=16, alpha=32.0))
    with torch.no_grad():  # non-zero adapters, as after training (the speed does not depend on their values)
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(0))
    prompts = [f"What is {a} + {a + 3}?" for a in range(args.tasks * args.k)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, seed=0)
    merged, packable = gen.merged_for_sampling, layers._packable
    out_rates = {}
    for name in ("unmerged", "merged", "unmerged", "merged"):  # interleaved; the faster of two runs each
        # unmerged: no merging, and adapter layers left out of the packed products (they run peft's forward)
        gen.merged_for_sampling = merged if name == "merged" else (lambda model: contextlib.nullcontext())
        layers._packable = packable if name == "merged" else (lambda m: m if type(m) is torch.nn.Linear else None)
        rollout = gen.generate(adapter, prompts, params, progress=False)
        rate = rollout.stats.generated_tokens / rollout.stats.wall_time
        out_rates[name] = max(out_rates.get(name, 0.0), rate)
    gen.merged_for_sampling, layers._packable = merged, packable
    return {"merged_tok_s": out_rates["merged"], "unmerged_tok_s": out_rates["unmerged"], "peak_mib": 0.0}


def child(args) -> None:
    import jobs.rl
    import jobs.sft  # noqa: F401 - imported before the baseline: the interpreter's own memory is not the job's

    baseline = _rss_kib() / 1024 if not torch.cuda.is_available() else 0.0
    with tempfile.TemporaryDirectory() as d:
        fn = {"sft": measure_sft, "rl": measure_rl, "sample": measure_sampling}[args.job]
        result = fn(Path(args.model), args.mode, Path(d), args)
        result["peak_mib"] -= baseline  # on CPU: above the interpreter with its imports
        print("RESULT " + json.dumps(result), flush=True)


def _run_child(model: Path, mode: str, job: str, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "bench.memory", "--child", job, "--mode", mode, "--model", str(model),
           "--tasks", str(args.tasks), "--k", str(args.k), "--tokens", str(args.tokens),
           "--sft-samples", str(args.sft_samples), "--micro-batch", str(args.micro_batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench.memory: the {job} / {mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def table(results: dict, params: int, size: str, args) -> str:
    full = {job: results[("full", job)] for job in ("sft", "rl")}
    rows = [f"model: SDAR {size} ({params / 1e6:.1f}M parameters, float32); micro-batch {args.micro_batch} rows, "
            f"SFT {args.sft_samples} samples per step, RL {args.tasks} tasks x {args.k} completions x {args.tokens} "
            "tokens",
            f"{'mode':<10} {'trainable':>11} {'optim MiB':>10} | {'SFT s':>7} {'SFT peak MiB':>12} {'x full':>6} "
            f"| {'RL s':>7} {'x full':>6} {'RL peak MiB':>11} {'x full':>6}"]
    for mode in MODES:
        s, r = results[(mode, "sft")], results[(mode, "rl")]
        rows.append(f"{mode:<10} {r['trainable']:>11,} {r['optimizer_bytes'] / 2**20:>10.1f} | {s['seconds']:>7.2f} "
                    f"{s['peak_mib']:>12.0f} {s['peak_mib'] / full['sft']['peak_mib']:>6.2f} | {r['seconds']:>7.2f} "
                    f"{r['seconds'] / full['rl']['seconds']:>6.2f} {r['peak_mib']:>11.0f} "
                    f"{r['peak_mib'] / full['rl']['peak_mib']:>6.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~10M model (smoke run)")
    ap.add_argument("--tasks", type=int, default=4, help="RL: tasks per step")
    ap.add_argument("--k", type=int, default=4, help="RL: completions per task")
    ap.add_argument("--tokens", type=int, default=32, help="RL: completion length")
    ap.add_argument("--sft-samples", type=int, default=16, help="SFT: samples per step")
    ap.add_argument("--micro-batch", type=int, default=2,
                    help="rows per forward (training.batch_size_lm); activations grow with it, weights and "
                         "optimizer states do not")
    ap.add_argument("--child", choices=("sft", "rl", "sample"), dest="job", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=tuple(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        child(args)
        return 0
    print(hardware_line("cuda" if torch.cuda.is_available() else "cpu"))
    size = "quick" if args.quick else "100m"
    with tempfile.TemporaryDirectory() as d:
        model, params = save_model(Path(d) / "model", size)
        results = {}
        for job in ("sft", "rl"):
            for mode in MODES:
                results[(mode, job)] = _run_child(model, mode, job, args)
                print(f"  {job} {mode}: {json.dumps(results[(mode, job)])}", flush=True)
        speed = _run_child(model, "lora_r16", "sample", args)
    print(table(results, params, size, args))
    print(f"sampling with LoRA r=16 ({args.tasks * args.k} prompts x {args.tokens} tokens, greedy): packed products "
          f"{speed['merged_tok_s']:.1f} tok/s vs peft's own layers {speed['unmerged_tok_s']:.1f} tok/s "
          f"({speed['merged_tok_s'] / speed['unmerged_tok_s']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
