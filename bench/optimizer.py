"""Benchmark of one AdamW step on a model's parameters: torch's default (a loop over the tensors), ``foreach`` and
``fused`` (the trainer's choice on CPU and CUDA, train/trainer.py ``_adamw``), in the same run.

On a small CPU the optimiser step is a visible share of a training step: SmolLM2-135M's parameters are 135M floats,
and the default update reads and writes each tensor a dozen times (parameter, gradient, two moments).

    python -m bench.optimizer                   # the 135m preset (SmolLM2-135M's shape), 5 timed steps each
    python -m bench.optimizer --preset 1.7b --device cuda

Each variant starts from the same weights, gradients and moments (two warm-up steps), then times ``--steps``
steps and reports the median; the last line gives the largest difference of the weights after the warm-up and
timed steps against the default's (the kernels round differently; the step is the same Adam).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import hardware_line
from bench.sampler import PRESETS, build_adapter

VARIANTS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def adam_steps(weights: list[torch.Tensor], grads: list[torch.Tensor], steps: int, device: str,
               **kind: bool) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of one AdamW step over ``steps`` timed steps (after two warm-up steps), and the weights."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-5, **kind)
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), [p.detach() for p in params]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.optimizer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(hardware_line(args.device))
    model = build_adapter(args.preset, args.device, torch.float32, 4).model
    weights = [p.detach() for p in model.parameters()]
    g = torch.Generator(device=args.device).manual_seed(0)
    grads = [torch.randn(w.shape, generator=g, device=args.device) * 1e-3 for w in weights]
    print(f"{args.preset}: {sum(w.numel() for w in weights) / 1e6:.1f}M parameters in {len(weights)} tensors, "
          f"{args.device}")
    results = {name: adam_steps(weights, grads, args.steps, args.device, **kind) for name, kind in VARIANTS.items()}
    base_time, base_weights = results["default"]
    for name, (seconds, final) in results.items():
        diff = max(float((a - b).abs().max()) for a, b in zip(final, base_weights))
        print(f"{name:8s} {seconds:.4f} s per step  {base_time / seconds:5.2f}x the default  "
              f"max |weight - default's| {diff:.1e}")


if __name__ == "__main__":
    main()
