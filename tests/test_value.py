"""Value model: step-level GAE against hand computations, values read at the sampler's states, learning, save/load."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.value import ValueModel, load_value_model, value_model_from_policy
from sample.generate import generate
from sample.params import SamplingParams
from tests.conftest import reset_accelerate_state
from train.accelerator import build_accelerator
from train.gae import outcome_token_rewards, step_gae
from train.settings import OptimizerParams, RLTrainingConfig
from train.value_trainer import ValueTrainer, value_advantages

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- GAE


def test_outcome_reward_sits_on_the_last_step():
    sample = torch.tensor([0, 0, 0, 1, 1])
    steps = torch.tensor([3, 1, 3, 2, 5])
    assert outcome_token_rewards(sample, steps, torch.tensor([2.0, -1.0])).tolist() == [2.0, 0.0, 2.0, 0.0, -1.0]


def test_gamma_lam_one_gives_return_reward_and_advantage_reward_minus_value():
    g = torch.Generator().manual_seed(0)
    sample = torch.tensor([0] * 7 + [1] * 5)
    steps = torch.tensor([1, 1, 2, 4, 4, 5, 7, 2, 3, 3, 6, 8])
    values = torch.randn(12, generator=g)
    reward = torch.tensor([1.5, -0.5])
    adv, ret = step_gae(sample, steps, outcome_token_rewards(sample, steps, reward), values, 1.0, 1.0)
    torch.testing.assert_close(ret, reward[sample])
    torch.testing.assert_close(adv, reward[sample] - values)


def test_lam_zero_gives_the_one_step_form():
    sample = torch.tensor([0, 0, 0, 0])
    steps = torch.tensor([1, 2, 2, 3])
    values = torch.tensor([0.1, 0.2, 0.4, 0.5])
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0])
    adv, _ = step_gae(sample, steps, rewards, values, 1.0, 0.0)
    v_star_next = torch.tensor([0.3, 0.5, 0.5, 0.0])  # mean value of the next step (terminal: 0)
    torch.testing.assert_close(adv, rewards - values + v_star_next)


def test_hand_computed_example_with_several_steps():
    # one sample, steps 1, 2 (two tokens), 3; reward 1 on the last step; gamma 0.5, lam 0.5
    sample, steps = torch.zeros(4, dtype=torch.long), torch.tensor([1, 2, 2, 3])
    v = torch.tensor([0.2, 0.4, 0.6, 0.8])
    r = outcome_token_rewards(sample, steps, torch.tensor([1.0]))
    adv, ret = step_gae(sample, steps, r, v, 0.5, 0.5)
    # step means: r* = [0, 0, 1], V* = [0.2, 0.5, 0.8]; R* = [0.25, 0.5, 1]
    # delta = [0 - 0.2 + 0.5*0.5, 0 - 0.5 + 0.5*0.8, 1 - 0.8] = [0.05, -0.1, 0.2]; A* = [0.05 + 0.25*A*_2, ...]
    a3 = 0.2
    a2 = -0.1 + 0.25 * a3
    want_ret = torch.tensor([0 + 0.5 * 0.5, 0 + 0.5 * 1.0, 0 + 0.5 * 1.0, 1.0])
    want_adv = torch.tensor([(0 - 0.2) + 0.5 * 0.5 + 0.25 * a2, (0 - 0.4) + 0.5 * 0.8 + 0.25 * a3,
                             (0 - 0.6) + 0.5 * 0.8 + 0.25 * a3, (1 - 0.8)])
    torch.testing.assert_close(ret, want_ret)
    torch.testing.assert_close(adv, want_adv)


# ---------------------------------------------------------------- the value model on sampled trajectories


def _trainer(adapter, lr: float = 3e-3, random_head: bool = True, **kw) -> ValueTrainer:
    reset_accelerate_state()
    value = value_model_from_policy(adapter.model)
    if random_head:  # a non-zero head so values depend on the state
        with torch.no_grad():
            value.value_head.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    import dataclasses

    v_adapter = dataclasses.replace(adapter, model=value)
    cfg = RLTrainingConfig(**{"batch_size_lm": 2, "shuffle": False, **kw})
    return ValueTrainer(v_adapter, cfg, OptimizerParams(learning_rate=lr),
                        accelerator=build_accelerator())


def _sampled(adapter, prompts, **kw):
    per_block = {"denoising_steps": 3} if adapter.attention == "block" else {}  # full attention: kw's steps
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=10, remasking_strategy="low_confidence_dynamic",
                            dynamic_threshold=0.05, **per_block, **kw)
    trajs = list(generate(adapter, prompts, params, progress=False))
    for i, t in enumerate(trajs):
        t.sample_id = f"s{i}"
    return trajs


@pytest.mark.parametrize("base", ["sdar", "llada", "sdar_moe", "llada2", "llada_moe"])
def test_values_are_read_at_the_state_before_each_step(tiny, demo_tokenizer, base):
    adapter = tiny(base, seed=2)
    extra = {"block_size": 4, "steps": 10, "cache": "none"} if base == "llada" else {}
    trajs = _sampled(adapter, [demo_tokenizer.encode("Tom has three apples"), [40, 41, 42]], **extra)
    trainer = _trainer(adapter)
    before = trainer.token_values(trajs)
    t = trajs[0]
    later = max(range(len(t.step_map)), key=lambda i: t.step_map[i])  # the token decoded last
    changed = t.response_ids[:later] + [(t.response_ids[later] + 1) % 400] + t.response_ids[later + 1:]
    trajs[0] = type(t)(**{**t.to_dict(), "response_ids": changed})
    after = trainer.token_values(trajs)
    earlier = [i for i, s in enumerate(t.step_map) if s < t.step_map[later]]
    assert earlier and torch.equal(before["s0"][earlier], after["s0"][earlier])  # earlier states never saw it
    assert torch.equal(before["s1"], after["s1"])
    first = min(range(len(t.step_map)), key=lambda i: (t.step_map[i], i))  # a token decoded at the first step
    changed = t.response_ids[:first] + [(t.response_ids[first] + 1) % 400] + t.response_ids[first + 1:]
    trajs[0] = type(t)(**{**t.to_dict(), "response_ids": changed})
    seen = trainer.token_values(trajs)
    # later states of its own block saw it (a later block sees it as clean context whatever the in-block order)
    def block(i):
        return (len(t.prompt_ids) + i) // t.block_size if t.block_size else 0

    later_states = [i for i, s in enumerate(t.step_map) if s > t.step_map[first] and block(i) == block(first)]
    assert later_states and (before["s0"][later_states] != seen["s0"][later_states]).all()


@pytest.mark.parametrize("base", ["sdar_moe", "llada2", "llada_moe"])
def test_moe_value_model_copies_the_policy_backbone_and_round_trips(tmp_path, tiny, base):
    policy = tiny(base, seed=5).model
    value = value_model_from_policy(policy)
    for name, tensor in policy.model.state_dict().items():  # weights and the router's expert_bias buffers
        assert torch.equal(value.model.state_dict()[name], tensor), name
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        value.value_head.weight.normal_()
        expected = value(ids)
    value.save_pretrained(tmp_path)
    loaded = load_value_model(tmp_path)
    assert type(loaded.model) is type(policy.model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), expected, rtol=0, atol=1e-5)


def test_packed_equals_per_round_values(tiny, demo_tokenizer):
    adapter = tiny("sdar", seed=2)
    trajs = _sampled(adapter, [demo_tokenizer.encode("The quick brown fox"), [30, 31, 32, 33, 34]])
    packed = _trainer(adapter, layout="packed").token_values(trajs)
    per_round = _trainer(adapter, layout="per_round").token_values(trajs)
    for sid in packed:
        torch.testing.assert_close(packed[sid], per_round[sid], atol=1e-5, rtol=0)
        assert not torch.isnan(packed[sid]).any()


def test_value_loss_falls_by_half_on_a_fixed_reward(tiny, demo_tokenizer):
    adapter = tiny("sdar", seed=2)
    trajs = _sampled(adapter, [demo_tokenizer.encode(p) for p in ("a b c", "Tom has", "one two three four")])
    rewards = {t.sample_id: r for t, r in zip(trajs, (1.0, -1.0, 0.5), strict=True)}
    trainer = _trainer(adapter, lr=3e-3, eps=10.0, random_head=False)  # the head starts at 0, as in training
    losses = []
    for _ in range(30):
        values = trainer.token_values(trajs)
        _, returns = value_advantages(trajs, rewards, values, 1.0, 1.0)
        losses.append(trainer.train_step(trajs, returns)[-1]["loss"])
    assert losses[-1] < 0.5 * losses[0]


def test_save_load_reproduces_values_and_autoclass(tiny, demo_tokenizer, tmp_path):
    from transformers import AutoModel

    adapter = tiny("sdar", seed=2)
    trajs = _sampled(adapter, [demo_tokenizer.encode("hello there")])
    trainer = _trainer(adapter)
    before = trainer.token_values(trajs)
    value = trainer.accelerator.unwrap_model(trainer.model)
    value.save_pretrained(tmp_path / "v")
    for reloaded in (load_value_model(tmp_path / "v"), AutoModel.from_pretrained(str(tmp_path / "v"))):
        assert isinstance(reloaded, ValueModel)
        import dataclasses

        trainer.adapter = dataclasses.replace(trainer.adapter, model=reloaded)
        trainer.model = reloaded
        assert torch.equal(trainer.token_values(trajs)["s0"], before["s0"])


def test_value_model_starts_at_zero_from_a_policy(tiny):
    adapter = tiny("dream", seed=1)
    value = value_model_from_policy(adapter.model)
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(value(x), torch.zeros(1, 4))
    assert value.config.model_type == "dllm_value" and value.config.policy["model_type"] in ("Dream", "dream")


@pytest.mark.slow
def test_two_process_value_step(tmp_path):
    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    out = tmp_path / "r.txt"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_zero3_2proc.yaml"), "--main_process_port", str(_free_port()),
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = sorted(out.parent.glob("r.txt.*"))
    digests = [p.read_text().split() for p in lines]
    assert len(digests) == 2 and digests[0][1] == digests[1][1] and digests[0][0] == "2"
    assert digests[0][2:] == digests[1][2:] and digests[0][4] == "5" and int(digests[0][3]) > 0  # every sample valued


if __name__ == "__main__":  # a ZeRO-3 value step on 2 processes; each rank writes a digest of its whole weights
    import hashlib

    from models.tiny import build_tiny
    from models.tokenizers import build_demo_tokenizer
    from tests.launched import leave
    from tests.test_train_views import fake_block_trajectory

    tok = build_demo_tokenizer()
    adapter = build_tiny("sdar", tok, seed=0)
    import dataclasses
    import random

    value = value_model_from_policy(adapter.model)
    acc = build_accelerator(micro_batch_size=2)
    trainer = ValueTrainer(dataclasses.replace(adapter, model=value), RLTrainingConfig(batch_size_lm=2),
                           OptimizerParams(learning_rate=1e-2), accelerator=acc)
    rng = random.Random(0)
    trajs = [fake_block_trajectory(rng, f"t{i}", 5, 9, 4, 3, len(tok), adapter.mask_id) for i in range(4)]
    returns = {t.sample_id: [1.0] * len(t.response_ids) for t in trajs}
    trainer.train_step(trajs, returns)
    # 5 samples: 2 micro-batches on rank 0, 1 on rank 1; the short rank's filler keeps ZeRO-3's forwards in step
    more = trajs + [fake_block_trajectory(rng, "t4", 5, 9, 4, 3, len(tok), adapter.mask_id)]
    values = trainer.token_values(more)
    known = sum(int((~v.isnan()).sum()) for v in values.values())
    values_digest = hashlib.sha256(b"".join(values[t.sample_id].numpy().tobytes() for t in more)).hexdigest()[:16]
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
        digest = hashlib.sha256(b"".join(p.detach().float().numpy().tobytes()
                                         for _, p in sorted(trainer.model.named_parameters()))).hexdigest()
    Path(f"{sys.argv[1]}.{acc.process_index}").write_text(f"{acc.num_processes} {digest} {values_digest} {known} "
                                                          f"{len(values)}")
    leave(acc)


def test_process_rewards_on_untrained_tokens_count_on_the_last_trained_step():
    from sample.trajectory import Trajectory

    traj = Trajectory(prompt_ids=[1], response_ids=[5, 6, 7], step_map=[1, 2, 3], logprobs=[0.0] * 3, sample_id="a")
    values = {"a": torch.tensor([0.0, 0.5, float("nan")])}  # the third token is not trained
    adv, ret = value_advantages([traj], {"a": [0.1, 0.2, 0.7]}, values, 1.0, 1.0)
    # gamma = lam = 1: returns are rewards to go, 0.7 moved onto step 2 (the last trained step)
    assert ret["a"] == pytest.approx([1.0, 0.9, 0.0]) and adv["a"] == pytest.approx([1.0, 0.4, 0.0])


@pytest.mark.parametrize("base", ["llada", "sdar"])
def test_every_value_model_parameter_gets_a_gradient(tiny, base):
    # DDP stops at the second step on a trainable parameter without a gradient (LLaDA's backbone holds its LM head)
    value = value_model_from_policy(tiny(base).model)
    ids = torch.randint(0, 50, (2, 8))
    value.value_head.weight.data.fill_(0.1)  # a zero head would give the backbone zero gradients
    value(ids, position_ids=torch.arange(8).expand(2, 8)).sum().backward()
    assert [n for n, p in value.named_parameters() if p.grad is None] == []


def test_value_settings_without_a_value_model_and_a_mistyped_value_path_are_one_line(tmp_path, capsys):
    import rl
    from jobs.config import ConfigError, load_config

    demo = "config=configs/demo/rl_demo.yaml"
    for setting in ("optimizer.params.value_learning_rate=1e-4", "experiment.train_value_every=2",
                    "model.optimized_value_name=value", "training.gam=0.9", "training.lam=0.95"):
        with pytest.raises(ConfigError, match=re.escape(f"key '{setting.split('=')[0]}': a value-model setting, and "
                                                        "this run has no value model: set model.value_base_model")):
            load_config([demo, setting], "rl")
    load_config([demo, "training.gam=1.0"], "rl", stream=io.StringIO())  # the default, written out: no effect lost
    missing = tmp_path / "sft_dmeo"
    assert rl.main([demo, f"model.value_base_model={missing}", f"experiment.output_dir={tmp_path}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: model.value_base_model '{missing}' is not a folder with a config.json (weights cannot "
                   "be downloaded at run time; download the checkpoint first)"]
