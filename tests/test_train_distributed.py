"""One PolicyTrainer step with 2 CPU processes (DeepSpeed ZeRO-3 and DDP, gloo), launched by `accelerate launch`.

The file is both the pytest test and the launched script: each rank trains on its own shard of the trajectories
(5 over 2 ranks, so the short rank is padded with zero-weight micro-batches and the collective forwards stay in
step); afterwards the parameters must be identical on both ranks and have moved.

    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml tests/test_train_distributed.py \
        --world 2 --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launched(tmp_path: Path, config: str, *flags: str) -> dict:
    """The launched script's summary, run on 2 CPU processes under ``config`` (accelerate_configs/)."""
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), "--main_process_port", str(_free_port()),
           str(Path(__file__).resolve()), "--world", "2", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("config", "kind"),
                         [("cpu_zero3_2proc.yaml", "DEEPSPEED"), ("cpu_ddp_2proc.yaml", "MULTI_CPU")])
def test_policy_trainer_step_two_processes(tmp_path, config, kind):
    r = _launched(tmp_path, config)
    assert r["num_processes"] == 2 and r["distributed_type"] == f"DistributedType.{kind}"
    assert r["micro_batches"] == [3.0, 3.0]  # 3 + 2 samples, packed: the short rank got one zero-weight filler
    # Metrics are global: both ranks report the trained tokens of all 5 samples (filler excluded) and one loss.
    assert r["tokens"][0] == r["tokens"][1] == r["expected_tokens"] > 0
    assert r["losses"][0] == r["losses"][1]
    # ... and the loss of one process on all 5: each rank's weights are normalised over the whole step, not over
    # its own shard (whose units and longest response differ), so no token weighs more for where it landed
    assert r["losses"][0] == pytest.approx(r["expected_loss"], rel=1e-5)
    assert r["identical_across_ranks"]  # the ranks trained on different shards and still hold the same weights
    assert r["max_update"] > 1e-4 and all(abs(x) < 1e3 for x in r["losses"])
    if kind == "DEEPSPEED":  # the engine clips inside its step: training.max_grad_norm, not the launcher's 1.0
        assert r["engine_clipping"] == 0.5


@pytest.mark.slow
@pytest.mark.parametrize(("config", "kind"),
                         [("cpu_zero3_2proc.yaml", "DEEPSPEED"), ("cpu_ddp_2proc.yaml", "MULTI_CPU")])
def test_a_process_whose_samples_give_no_rows_trains_a_zero_weight_filler(tmp_path, config, kind):
    """Rank 1's only sample is dropped (over-long prompt): it joins the collective forwards with a zero-weight copy
    of rank 0's sample, and the step is rank 0's sample's step."""
    r = _launched(tmp_path, config, "--empty-rank")
    assert r["distributed_type"] == f"DistributedType.{kind}" and r["identical_across_ranks"]
    assert r["tokens"][0] == r["tokens"][1] == r["expected_tokens"] > 0  # the dropped sample's tokens: none
    assert r["losses"][0] == r["losses"][1] == pytest.approx(r["expected_loss"], rel=1e-5)
    assert r["max_update"] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("config", "kind", "prompts"),
                         [("cpu_zero3_2proc.yaml", "DEEPSPEED", "both"), ("cpu_ddp_2proc.yaml", "MULTI_CPU", "both"),
                          ("cpu_zero3_2proc.yaml", "DEEPSPEED", "rank0")])
def test_shared_prompts_train_under_two_processes(tmp_path, config, kind, prompts):
    """Each rank's micro-batch holds three samples: of one prompt on both ranks, where the prompt's blocks run in a
    forward of their own before the rows' (train/shared_prefix.py); or only on rank 0, where no rank shares
    (ZeRO-3's forwards are collective: the ranks must run as many). Either way the step is the one-process step
    on all six samples."""
    r = _launched(tmp_path, config, "--shared-prompts", prompts)
    assert r["distributed_type"] == f"DistributedType.{kind}" and r["identical_across_ranks"]
    # old log-probs and the update, on each rank
    assert r["shared_forwards"] == ([2.0, 2.0] if prompts == "both" else [0.0, 0.0])
    assert r["tokens"][0] == r["tokens"][1] == r["expected_tokens"] > 0
    assert r["losses"][0] == r["losses"][1] == pytest.approx(r["expected_loss"], rel=1e-5)
    assert r["max_update"] > 1e-4


# ---------------------------------------------------------------- the launched script


def _gathered(accelerator, model) -> torch.Tensor:
    params = list(accelerator.unwrap_model(model).parameters())
    ctx = contextlib.nullcontext()
    if accelerator.distributed_type.name == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with ctx:
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


def main() -> None:
    import random

    from models.registry import Adapter
    from models.sdar import SDARConfig, SDARForCausalLM
    from tests.launched import assert_world_size, leave
    from tests.test_train_views import fake_block_trajectory
    from train.policy_trainer import PolicyTrainer
    from train.settings import OptimizerParams, RLTrainingConfig
    from train.trainer import accelerator_for
    from train.views import ModelTraits, build_view

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--empty-rank", action="store_true", help="rank 1's only sample has an over-long prompt")
    ap.add_argument("--shared-prompts", choices=("both", "rank0"),
                    help="one micro-batch of 3 samples per rank, of one prompt on both ranks or on rank 0 only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cfg = RLTrainingConfig(batch_size_lm=4 if args.shared_prompts else 1, old_logp="recompute", shuffle=False,
                           beta=0.01, max_prompt_len=8 if args.empty_rank else None, max_grad_norm=0.5)
    accelerator = accelerator_for(cfg)
    assert_world_size(accelerator, args.world)
    torch.manual_seed(0)
    model = SDARForCausalLM(SDARConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                                       mask_token_id=63))
    adapter = Adapter(model=model, model_base="sdar", family="sdar", attention="block", block_size=4, mask_id=63,
                      pad_id=0, eos_ids=(1,), shift_logits=False)
    trainer = PolicyTrainer(adapter, cfg, OptimizerParams(learning_rate=1e-2), accelerator=accelerator)
    start = _gathered(accelerator, trainer.model)
    rng = random.Random(0)
    trajs = [fake_block_trajectory(rng, f"t{i}", rng.randint(1, 9), rng.randint(5, 12), 4, 3, 63, 63)
             for i in range(5)]
    if args.empty_rank:  # dealt round robin, unshuffled: rank 0 gets t0, rank 1 gets t1 (dropped)
        trajs = [fake_block_trajectory(rng, f"e{i}", 4 + 8 * i, 6, 4, 3, 63, 63) for i in range(2)]
    shared_forwards = [0]
    if args.shared_prompts:  # samples 0, 2, 4 (rank 0) answer one 21-token prompt, 1, 3, 5 (rank 1) another
        trajs = [fake_block_trajectory(rng, f"s{i}", 21, rng.randint(5, 9), 4, 3, 63, 63) for i in range(6)]
        for i in range(2, 6) if args.shared_prompts == "both" else (2, 4):  # rank0: rank 1's prompts differ
            trajs[i].prompt_ids = list(trajs[i % 2].prompt_ids)
        import train.trainer

        counted = train.trainer.shared_prefix_hidden

        def counting(*a, **k):
            shared_forwards[0] += 1
            return counted(*a, **k)

        train.trainer.shared_prefix_hidden = counting
    advantages = {t.sample_id: 1.0 for t in trajs}
    whole = build_view(trajs, advantages, cfg, ModelTraits.from_adapter(adapter))  # one process, every sample
    # old log-probs recomputed before the update: ratio 1, so the loss is -sum(weight * advantage) and the KL 0
    expected_tokens, expected_loss = whole.num_tokens, float(-(whole.weights * whole.advantages).sum())
    (metrics,) = trainer.train_step(trajs, advantages)
    after = _gathered(accelerator, trainer.model)
    dev = accelerator.device
    all_after = accelerator.gather(after[None].to(dev)).cpu()
    summary = accelerator.gather(torch.tensor([[metrics["micro_batches"], metrics["tokens"], metrics["loss"],
                                                shared_forwards[0]]], device=dev)).cpu()
    result = {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
              "identical_across_ranks": bool(all(torch.equal(all_after[0], r) for r in all_after)),
              "max_update": float((after - start).abs().max()), "micro_batches": summary[:, 0].tolist(),
              "tokens": summary[:, 1].tolist(), "losses": summary[:, 2].tolist(),
              "shared_forwards": summary[:, 3].tolist(), "expected_tokens": expected_tokens,
              "expected_loss": expected_loss,
              "engine_clipping": trainer.model.gradient_clipping() if hasattr(trainer.model, "gradient_clipping")
              else None,
              "seconds": time.perf_counter() - t0}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(result))
        print(json.dumps(result))
    leave(accelerator)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
