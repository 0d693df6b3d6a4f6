"""Seconds per stage of one RL demo step, in-process (ours) vs the reference's way, measured in the same run.

    python -m bench.rl_step                       # tiny demo SDAR on CPU, the demo's step size
    python -m bench.rl_step --tasks 16 --k 8 --tokens 64 --repeat 3
    python -m bench.rl_step --value-memory          # also: peak memory of a step with the value model

Ours: the loop of jobs/rl.py: sample with the weights the trainer holds, score, old log-probs, train, evaluate,
save a checkpoint. The reference's way (Gen-Verse/dLLM-RL rl.py): every stage is a new process that reloads the
model from disk: save the policy, load it for sampling, score, load it again for training with a fresh optimiser,
recompute old log-probs, train, save. The same prompts, seeds and updates run both ways; the printed ratios are
the reference's step time over ours, without and with the start-up of the three processes its stages run in
(rollout, reward, ``accelerate launch`` training), measured here as a fresh interpreter importing torch,
transformers, accelerate and deepspeed. On tiny models the reloads themselves are cheap; they grow with the
weights (a 4B bf16 checkpoint is 8 GB written once and read three times per step).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import hardware_line
from jobs.config import load_config
from jobs.rl import RLJob
from models.registry import load_model
from train.policy_trainer import PolicyTrainer


def _config(out: Path, model: Path, args, value: bool = False) -> object:
    over = {"experiment.output_dir": out, "experiment.project": "bench", "model.pretrained_model": model,
            "experiment.total_step": 1, "experiment.eval_every": 1, "experiment.save_every": 1,
            "rollout.num_task_per_step": args.tasks, "rollout.num_response_per_task": args.k,
            "rollout.max_tokens": args.tokens, "evaluation.max_tokens": args.tokens,
            "evaluation.num_response_per_task": 1, "reward.acc_low": 0.0, "reward.acc_high": 1.0,
            "reward.filter_all_equal": "false", "training.old_logp": "recompute",
            "training.max_prompt_len": 512, "experiment.overwrite": "true"}
    if value:
        over["model.value_base_model"] = model
    return load_config(["config=configs/demo/rl_demo.yaml", *(f"{k}={v}" for k, v in over.items())], "rl")


class _Clock:
    def __init__(self):
        self.t: dict[str, float] = {}

    def __call__(self, name, fn):
        start = time.perf_counter()
        out = fn()
        self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - start
        return out


def ours(job: RLJob) -> dict[str, float]:
    clock = _Clock()
    trainer = job.trainer
    old = trainer.compute_old_logprobs
    trainer.compute_old_logprobs = lambda plan: clock("old_logprobs", lambda: old(plan))
    trajs, _ = clock("sampling+scoring", lambda: job._sample(1))
    adv, _ = job._advantages(trajs)
    kept = [t for t in trajs if t.sample_id in adv]
    clock("train_total", lambda: trainer.train_step(kept, adv))
    clock("evaluation", lambda: job._evaluate(job.root / "bench_eval"))
    clock("saving", lambda: job._save(job.root / "bench_ckpt"))
    trainer.compute_old_logprobs = old
    clock.t["training"] = clock.t.pop("train_total") - clock.t.get("old_logprobs", 0.0)
    return clock.t


def reference_way(job: RLJob, tmp: Path) -> dict[str, float]:
    """The same step with a save + reload around every stage."""
    clock, cfg = _Clock(), job.cfg
    policy = tmp / "policy"

    def save():
        job.trainer.model.save_pretrained(policy)
        job.adapter.tokenizer.save_pretrained(policy)

    def load():
        from core.schema import replace

        return load_model(replace(cfg.model, pretrained_model=str(policy)))

    clock("saving", save)
    sampler = clock("reload_for_sampling", load)
    original = job.adapter
    job.adapter = sampler
    trajs, _ = clock("sampling+scoring", lambda: job._sample(1))
    adv, _ = job._advantages(trajs)
    kept = [t for t in trajs if t.sample_id in adv]
    learner = clock("reload_for_training", load)
    trainer = clock("reload_for_training", lambda: PolicyTrainer(learner, cfg.training, cfg.optimizer.params,
                                                                 cfg.lr_scheduler, accelerator=job.acc))
    old = trainer.compute_old_logprobs
    trainer.compute_old_logprobs = lambda plan: clock("old_logprobs", lambda: old(plan))
    clock("train_total", lambda: trainer.train_step(kept, adv))
    clock.t["training"] = clock.t.pop("train_total") - clock.t.get("old_logprobs", 0.0)
    clock("saving", lambda: (learner.model.save_pretrained(policy), None))
    job.adapter = clock("reload_for_eval", load)  # the evaluation stage reads the checkpoint just trained
    clock("evaluation", lambda: job._evaluate(job.root / "bench_eval_ref"))
    job.adapter = original
    return clock.t


def process_startup() -> float:
    """Seconds for a fresh interpreter to import what a reference stage imports."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers, accelerate, deepspeed"], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def memory_run(args) -> dict:
    """One RL step (policy only, or policy + value model) in this process: peak resident memory over the step."""
    import json
    import resource

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        from models.tiny import save_tiny_checkpoint
        from models.tokenizers import build_demo_tokenizer

        model = save_tiny_checkpoint(tmp / "model", "sdar", build_demo_tokenizer(), size=args.size)
        job = RLJob(_config(tmp / "runs", model, args, value=args.memory == "value"), progress=False)
        job.prepare()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        job.root.mkdir(parents=True, exist_ok=True)
        job.one_step(1, job.root)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": args.memory, "peak_mib": peak / 1024, "step_extra_mib": (peak - base) / 1024}))
    return {}


def memory_table(args) -> None:
    """Peak memory of one step, policy alone vs policy + value model (each in a fresh process)."""
    import json
    import os

    rows = {}
    for mode in ("policy", "value"):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        cmd = [sys.executable, "-m", "bench.rl_step", "--memory", mode, "--size", args.size, "--tasks",
               str(args.tasks), "--k", str(args.k), "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()
        rows[mode] = json.loads(out[-1])
    p, v = rows["policy"], rows["value"]
    print(f"peak memory of one step ({args.size} model): policy {p['peak_mib']:.0f} MiB, policy + value "
          f"{v['peak_mib']:.0f} MiB ({v['peak_mib'] / p['peak_mib']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rl_step", description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="rounds (fastest kept per stage)")
    ap.add_argument("--size", default="demo", choices=["test", "demo", "bench"], help="models/tiny.py size")
    ap.add_argument("--memory", choices=["policy", "value"], help=argparse.SUPPRESS)
    ap.add_argument("--value-memory", action="store_true", help="also report peak memory with a value model")
    args = ap.parse_args(argv)
    if args.memory:
        memory_run(args)
        return 0
    torch.manual_seed(0)
    print(hardware_line("cpu"))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        from models.tiny import save_tiny_checkpoint
        from models.tokenizers import build_demo_tokenizer

        model = save_tiny_checkpoint(tmp / "model", "sdar", build_demo_tokenizer(), size=args.size)
        job = RLJob(_config(tmp / "runs", model, args), progress=False)
        job.prepare()
        best_ours: dict[str, float] = {}
        best_ref: dict[str, float] = {}
        for _ in range(args.repeat):  # interleaved rounds, fastest kept
            for best, fn in ((best_ours, lambda: ours(job)), (best_ref, lambda: reference_way(job, tmp))):
                for k, v in fn().items():
                    best[k] = min(best.get(k, v), v)
    stages = ["saving", "reload_for_sampling", "sampling+scoring", "reload_for_training", "old_logprobs",
              "training", "reload_for_eval", "evaluation"]
    print(f"one demo step: {args.tasks} tasks x {args.k} responses, {args.tokens} tokens, tiny demo SDAR, CPU")
    print(f"{'stage':<22}{'ours s':>10}{'reference s':>13}")
    for s in stages:
        print(f"{s:<22}{best_ours.get(s, 0.0):>10.3f}{best_ref.get(s, 0.0):>13.3f}")
    total_o, total_r = sum(best_ours.values()), sum(best_ref.values())
    startup = process_startup()
    print(f"{'total':<22}{total_o:>10.3f}{total_r:>13.3f}")
    print(f"{'+ 3 process start-ups':<22}{'':>10}{total_r + 3 * startup:>13.3f}   ({startup:.2f} s each)")
    print(f"reference / ours: {total_r / total_o:.2f}x in-process work, "
          f"{(total_r + 3 * startup) / total_o:.2f}x with its process start-ups")
    if args.value_memory:
        memory_table(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
