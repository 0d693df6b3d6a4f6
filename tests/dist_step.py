"""One distributed optimizer step on a tiny SDAR model; launched by tests/test_distributed.py.

Each rank trains on a different batch, so identical parameters afterwards prove that gradients were reduced.
Every rank also replays the step without distribution (same seed, the mean of all ranks' losses, the same
clipping and AdamW) and compares the update direction with the distributed one. Rank 0 writes a JSON summary.

    accelerate launch --config_file accelerate_configs/cpu_ddp_2proc.yaml tests/dist_step.py --world 2 --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.sdar import SDARConfig, SDARForCausalLM  # noqa: E402
from tests.launched import (
    assert_world_size,  # noqa: E402
    leave,  # noqa: E402
)
from train.accelerator import build_accelerator  # noqa: E402

VOCAB, MASK, LR, CLIP = 64, 63, 1e-2, 1.0


def tiny_model(seed: int) -> SDARForCausalLM:
    torch.manual_seed(seed)
    cfg = SDARConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=MASK)
    return SDARForCausalLM(cfg)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed masked-diffusion batch, different for every rank: (input ids with masks, labels)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, MASK, (2, 16), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.5
    masked[:, 0] = True
    return ids.masked_fill(masked, MASK), ids.masked_fill(~masked, -100)


def reference_update(world: int, seed: int) -> torch.Tensor:
    """The step a single process takes on the mean loss of all ranks' batches (flat parameter delta)."""
    model = tiny_model(seed)
    before = flat(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss = sum(model(input_ids=x, labels=y).loss for x, y in map(batch, range(world))) / world
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return flat(model.parameters()) - before


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


def gathered_params(accelerator, model) -> torch.Tensor:
    """Full flat parameters on every rank (ZeRO-3 shards them; gather temporarily)."""
    unwrapped = accelerator.unwrap_model(model)
    params = list(unwrapped.parameters())
    ctx = contextlib.nullcontext()
    if accelerator.distributed_type.name == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with ctx:
        return flat(params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixed_precision", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()

    accelerator = build_accelerator(mixed_precision=args.mixed_precision, micro_batch_size=2)
    assert_world_size(accelerator, args.world)
    assert accelerator.num_processes == args.world
    rank = accelerator.process_index

    model = tiny_model(seed=0)
    init = flat(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)
    start = gathered_params(accelerator, model)  # after prepare: DeepSpeed bf16 casts the weights

    x, y = batch(rank)
    model.train()
    loss = model(input_ids=x.to(accelerator.device), labels=y.to(accelerator.device)).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), CLIP)  # a no-op under DeepSpeed, which clips from its config
    opt.step()
    opt.zero_grad()

    after = gathered_params(accelerator, model)
    all_after = accelerator.gather(after.unsqueeze(0).to(accelerator.device)).cpu()
    all_losses = accelerator.gather(loss.detach().float().reshape(1)).cpu()
    update, ref = after - start, reference_update(args.world, seed=0)
    cos = torch.nn.functional.cosine_similarity(update, ref, dim=0).item()
    result = {
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision": accelerator.mixed_precision,
        "identical_across_ranks": bool(all(torch.equal(all_after[0], r) for r in all_after)),
        "losses": all_losses.tolist(),
        "init_matches_seed": bool(torch.allclose(start, init, atol=1e-2)),
        "max_update": update.abs().max().item(),
        "max_diff_vs_reference": (update - ref).abs().max().item(),
        "cos_vs_reference": cos,
        "seconds": time.perf_counter() - t0,
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    leave(accelerator)


if __name__ == "__main__":
    main()
