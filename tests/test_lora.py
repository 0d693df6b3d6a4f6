"""LoRA through peft: exact at init, merged sampling, adapter checkpoints, merge into a whole checkpoint, RL / SFT
runs and their resume, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.config import ConfigError, load_config
from models.common import AttentionLayout
from models.layers import Projections, packed_projections
from models.lora import LoraSettings, load_adapter, merged_for_sampling, wrap
from models.registry import ModelLoadError, load_model
from models.tiny import save_tiny_checkpoint
from tests.test_rl import _harness, comparable, demo_args
from tests.test_sft import sft_args

ROOT = Path(__file__).resolve().parents[1]
LORA = {"lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, demo_tokenizer):
    base = tmp_path_factory.mktemp("lora_ckpts")
    return {m: save_tiny_checkpoint(base / m, m, demo_tokenizer, size="test") for m in ("sdar", "llada", "sdar_moe")}


def logits(adapter, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        return adapter.forward(ids, pos, AttentionLayout.full(torch.ones(2, 12, dtype=torch.bool)))


def base_state(model) -> dict[str, torch.Tensor]:
    """The frozen base weights of a (wrapped) model, by their names in the plain model."""
    return {k.removeprefix("base_model.model.").replace(".base_layer", ""): v.detach().clone()
            for k, v in model.state_dict().items() if "lora_" not in k}


def adapted_tiny(tiny, rank: int, std: float, base: str = "sdar"):
    """A tiny policy of family ``base`` with LoRA adapters of ``rank`` whose B matrices are drawn from N(0, std) (so
    they change the outputs; a fresh adapter is the base model exactly)."""
    adapter = tiny(base)
    wrap(adapter, LoraSettings(enabled=True, rank=rank, alpha=2 * rank))
    with torch.no_grad():
        for n, p in adapter.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return adapter


@pytest.mark.parametrize("base", ["sdar", "llada", "sdar_moe", "llada2", "llada_moe"])
def test_fresh_adapter_is_the_base_model_exactly_and_only_adapters_train(tiny, base):
    adapter = tiny(base)
    before = logits(adapter)
    wrap(adapter, LoraSettings(enabled=True, rank=4, alpha=8))
    assert torch.equal(logits(adapter), before)  # B = 0
    trainable = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    spec = __import__("models.registry").registry.family_spec(base)
    adapted = {n.split(".")[-1] for n, m in adapter.model.named_modules()
               if hasattr(m, "lora_A") and not hasattr(m, "parameter_name")}
    # (the tiny sdar_moe has no dense MLP layer: every layer is sparse, as in SDAR-30B-A3B)
    assert adapted == set(spec.lora_targets) - ({"gate_proj", "up_proj", "down_proj"} if base == "sdar_moe" else set())
    # a MoE family's routed experts: their fused tensors, adapted in place (peft's target_parameters)
    tensors = {"experts." + m.parameter_name for m in adapter.model.modules() if hasattr(m, "parameter_name")}
    assert tensors == set(spec.lora_parameters) and bool(tensors) == (base in ("sdar_moe", "llada2", "llada_moe"))
    vocab = adapter.model.get_input_embeddings().num_embeddings
    heads = [m for m in adapter.model.modules() if getattr(m, "out_features", 0) == vocab
             or getattr(getattr(m, "base_layer", None), "out_features", 0) == vocab]
    assert heads and all(type(m) is torch.nn.Linear for m in heads)  # the LM head is not adapted (LLaDA: ff_out)


@pytest.mark.parametrize("rank", [1, 4])
def test_merged_sampling_weights_equal_the_adapter_and_restore_bit_for_bit(tiny, rank):
    adapter = adapted_tiny(tiny, rank, std=0.05)
    base = base_state(adapter.model)
    unmerged = logits(adapter)
    projections = [m for m in adapter.model.modules() if isinstance(m, Projections)]
    with merged_for_sampling(adapter.model):  # without packing (GPU): the adapters merged into copies
        merged = logits(adapter)
        assert all(m.merged for m in adapter.model.modules() if hasattr(m, "lora_A"))
    assert (merged - unmerged).abs().max() < 1e-5 and not torch.equal(merged, logits(tiny("sdar")))
    after = base_state(adapter.model)
    assert all(torch.equal(base[k], after[k]) for k in base)
    assert not any(m.merged for m in adapter.model.modules() if hasattr(m, "lora_A"))
    assert torch.equal(logits(adapter), unmerged)
    # with packing (CPU, fp32; sample.generate's order): every group is packed and merging then touches nothing
    # (no layer merged, no weight copied). A group whose adapters cost little beside it (rank 1 here) holds the
    # base weights exactly and adds the adapters as a side product: its base weights are parked inside and back
    # bit for bit after; a costlier one (rank 4 on 32-wide layers: the attention groups) holds base + delta
    # merged and parks nothing
    weights = {id(p): n for n, p in adapter.model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in adapter.model.named_parameters()}
    with packed_projections(adapter.model, park=True), merged_for_sampling(adapter.model):
        assert all(len(m._packed) == len(m.projection_groups) for m in projections)
        assert not any(m.merged for m in adapter.model.modules() if hasattr(m, "lora_A"))
        exact = {weights[id(getattr(getattr(m, name), "base_layer", getattr(m, name)).weight)] for m in projections
                 for group, names in m.projection_groups.items() if m._packed[group].exact for name in names}
        assert (exact == set(pointers) & {n for n in pointers if n.endswith(("base_layer.weight", "lm_head.weight"))}
                ) == (rank == 1)
        assert {n for n, p in adapter.model.named_parameters() if p.numel() == 0} == exact
        assert {n: p.data_ptr() for n, p in adapter.model.named_parameters() if n not in exact} == \
            {n: ptr for n, ptr in pointers.items() if n not in exact}
        packed = logits(adapter)
    assert (packed - unmerged).abs().max() < 1e-5 and (packed - merged).abs().max() < 1e-5
    assert not any("_served_packed" in m.__dict__ for m in adapter.model.modules())
    after = base_state(adapter.model)
    assert all(torch.equal(base[k], after[k]) for k in base)
    assert torch.equal(logits(adapter), unmerged)


@pytest.mark.usefixtures("bf16_products")
@pytest.mark.parametrize("rank", [1, 4])
def test_bf16_packed_products_keep_the_adapters(tiny, rank):
    """Under bf16 autocast (``compute_dtype="bfloat16"``) a LoRA policy's packed groups are bf16 copies that keep its
    adapters, beside the product (rank 1) or merged into it (rank 4): logits agree with the unpacked adapter's under
    the same autocast to bf16 rounding and are far from the base model's; nothing is parked and the fp32 base and
    adapter weights are untouched."""
    adapter = adapted_tiny(tiny, rank, std=0.2)
    before = {n: p.detach().clone() for n, p in adapter.model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unpacked = logits(adapter).float()
        plain = logits(tiny("sdar")).float()
        with packed_projections(adapter.model, park=True), merged_for_sampling(adapter.model):
            groups = [(m._packed[g], any(hasattr(getattr(m, n), "lora_A") for n in names))
                      for m in adapter.model.modules() if isinstance(m, Projections)
                      for g, names in m.projection_groups.items()]
            assert groups and all(p.dtype == torch.bfloat16 and not p.exact for p, _ in groups)
            beside = [p.low_rank is not None for p, adapted in groups if adapted]
            assert any(beside) and all(beside) == (rank == 1)  # rank 4: the narrow attention groups merged
            packed = logits(adapter).float()
    scale = unpacked.abs().max()
    torch.testing.assert_close(packed, unpacked, atol=0.03 * scale, rtol=0)
    assert (plain - unpacked).abs().max() > 0.1 * scale  # the adapters matter at this size
    assert all(torch.equal(p, before[n]) for n, p in adapter.model.named_parameters())


@pytest.mark.parametrize("base", ["sdar_moe", "llada2"])
def test_merged_sampling_of_adapted_expert_tensors_restores_them_bit_for_bit(tiny, base):
    adapter = adapted_tiny(tiny, 4, std=0.05, base=base)
    wrappers = [m for m in adapter.model.modules() if hasattr(m, "parameter_name")]
    experts = {id(m.get_base_layer()): m.get_base_layer() for m in wrappers}.values()
    before = [(e.gate_up_proj, e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for e in experts]
    unmerged = logits(adapter)
    assert not torch.equal(unmerged, logits(tiny(base)))  # the expert adapters change the outputs
    with packed_projections(adapter.model), merged_for_sampling(adapter.model):
        assert wrappers and all(m.merged for m in wrappers)  # experts are not packed: merged into copies
        assert any(not torch.equal(e.gate_up_proj, gate_up) for e, (_, gate_up, _) in zip(experts, before))
        merged = logits(adapter)
    assert (merged - unmerged).abs().max() < 1e-5
    assert not any(m.merged for m in wrappers)
    for e, (param, gate_up, down) in zip(experts, before, strict=True):
        assert e.gate_up_proj is param and torch.equal(e.gate_up_proj, gate_up) and torch.equal(e.down_proj, down)
    assert torch.equal(logits(adapter), unmerged)


def test_a_moe_value_model_adapts_its_backbone_experts_and_trains_its_head_whole(tiny):
    """jobs/rl.py's LoRA value model on a MoE policy: the backbone's fused experts adapted in place (the family's
    target parameters), the value head trained whole, values zero at the start (zero head)."""
    from models.lora import wrapped_model
    from models.registry import family_spec
    from models.value import value_model_from_policy

    spec = family_spec("llada2")
    value = value_model_from_policy(tiny("llada2").model)
    model = wrapped_model(value, LoraSettings(enabled=True, rank=4, alpha=8), spec.lora_targets,
                          family_parameters=spec.lora_parameters, also_save=("value_head",))
    tensors = {"experts." + m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")}
    assert tensors == set(spec.lora_parameters)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("value_head" in n for n in trainable) and all("lora_" in n or "value_head" in n for n in trainable)
    ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    values = model(ids, torch.arange(8).expand(2, 8), AttentionLayout.full(torch.ones(2, 8, dtype=torch.bool)))
    assert values.shape == (2, 8) and torch.equal(values, torch.zeros_like(values))
    (values - 1).square().sum().backward()  # a loss away from 0: the head gets a gradient
    assert float(model.base_model.model.value_head.modules_to_save["default"].weight.grad.abs().max()) > 0


@pytest.mark.parametrize("family", ["sdar", "sdar_moe"])  # sdar_moe: routed experts adapted in place
def test_lora_rl_run_trains_the_adapter_only_and_saves_it_in_peft_format(tmp_path, ckpts, monkeypatch, family):
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    from jobs.rl import RLJob

    cfg = load_config(demo_args(tmp_path, ckpts[family], family, **LORA, **{
        "experiment.total_step": 2, "training.check_sampler_logp": "true", "optimizer.params.learning_rate": 5e-2}),
        "rl")
    job = RLJob(cfg, progress=False)
    try:
        first = job.prepare()
        base = base_state(job.adapter.model)
        history = job.run_steps(first)
    finally:
        job.close()
    model = job.adapter.model
    after = base_state(model)
    assert all(torch.equal(base[k], after[k]) for k in base)  # the frozen base, bit for bit
    assert any(float(p.detach().abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)  # moved
    assert all(m["optimizer_steps"] >= 1 for m in history)
    assert all(m["sampler_logp_max_abs_diff"] < 1e-4 for m in history)  # the sampler ran the merged weights
    policy = tmp_path / "run" / "step_2" / "ckpt" / "policy"
    assert {p.name for p in policy.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (policy / "model.safetensors").exists()
    assert (policy / "adapter_model.safetensors").stat().st_size < (ckpts[family] / "model.safetensors").stat().st_size
    # save -> load: PeftModel.from_pretrained on the base gives the same logits
    trained = logits(job.adapter)
    loaded = load_model({"pretrained_model": str(ckpts[family]), "model_base": family, "dtype": "float32"})
    plain = logits(loaded)
    loaded.model = load_adapter(loaded.model, policy)
    assert torch.equal(logits(loaded), trained) and not torch.equal(plain, trained)
    # merged into a whole checkpoint (the command), and eval's model.adapter: the adapter model's logits
    out = tmp_path / "merged"
    from tools.merge_lora import main as merge_main

    assert merge_main(["--base", str(ckpts[family]), "--adapter", str(policy), "--out", str(out),
                       "--model-base", family]) == 0  # python -m tools.merge_lora ...
    merged = load_model({"pretrained_model": str(out), "model_base": family, "dtype": "float32"})
    assert (logits(merged) - trained).abs().max() < 1e-5
    ev = load_config(["config=configs/demo/eval_demo.yaml", f"model.pretrained_model={ckpts[family]}",
                      f"model.model_base={family}", f"model.adapter={policy}"], "eval")
    assert (logits(load_model(ev.model)) - trained).abs().max() < 1e-5
    served = load_config(["config=configs/demo/serve_demo.yaml", f"model.pretrained_model={ckpts[family]}",
                          f"model.model_base={family}", f"model.adapter={policy}"], "serve")
    assert (logits(load_model(served.model)) - trained).abs().max() < 1e-5  # serve.py loads the model as eval does
    # another base of the same shapes (another seed, or a bf16 copy of its own): refused / accepted
    assert (policy / "base_fingerprint.json").is_file()
    other = save_tiny_checkpoint(tmp_path / "other", family, loaded.tokenizer, size="test", seed=7)
    with pytest.raises(ModelLoadError, match=r"the adapter was trained on another base model \(\d+ of \d+ sampled "
                                             r"base weights differ; it was trained on "):
        load_model({"pretrained_model": str(other), "model_base": family, "adapter": str(policy)})
    bf16 = load_model({"pretrained_model": str(ckpts[family]), "model_base": family, "dtype": "bfloat16",
                       "adapter": str(policy)})  # the same base in another dtype loads
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["random_masking", "coupled"])
def test_lora_trains_with_every_rl_method(tmp_path, ckpts, method, monkeypatch):
    from safetensors.torch import load_file

    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)  # rewards that vary within a group (a random model scores 0)
    from jobs.rl import run_rl

    history = run_rl(load_config(demo_args(tmp_path, ckpts["sdar"], **LORA, **{
        "experiment.total_step": 1, "experiment.save_every": 1, "training.method": method,
        "optimizer.params.learning_rate": 5e-2}), "rl"), progress=False)
    assert history[-1]["optimizer_steps"] >= 1
    adapter = load_file(str(tmp_path / "run" / "step_1" / "ckpt" / "policy" / "adapter_model.safetensors"))
    assert any("lora_B" in k and float(t.abs().max()) > 0 for k, t in adapter.items())  # B starts at 0


@pytest.mark.slow
def test_lora_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path, ckpts):
    from safetensors.torch import load_file

    # the value model through LoRA as well (its head trained whole): both adapters resume
    lora = {**LORA, "model.value_base_model": str(ckpts["sdar"])}
    whole = tmp_path / "whole"
    proc = _harness(demo_args(whole, ckpts["sdar"], **lora))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = comparable([json.loads(x) for x in (whole / "run" / "metrics.jsonl").read_text().splitlines()])
    final = load_file(str(whole / "run" / "step_3" / "ckpt" / "policy" / "adapter_model.safetensors"))
    for kill in ("train:3",):  # resumes from the step-2 checkpoint (adapter + optimizer + RNG); one kill keeps it fast
        out = tmp_path / kill.replace(":", "_")
        killed = _harness(demo_args(out, ckpts["sdar"], **lora), kill=kill)
        assert killed.returncode == -9, killed.stderr[-3000:]
        resumed = _harness(demo_args(out, ckpts["sdar"], **lora, **{"experiment.start_from_scratch": "false"}))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        got = comparable([json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()])
        assert [m["step"] for m in got] == [1, 2, 3] and got == reference, kill
        again = load_file(str(out / "run" / "step_3" / "ckpt" / "policy" / "adapter_model.safetensors"))
        assert again.keys() == final.keys() and all(torch.equal(final[k], again[k]) for k in final), kill
    value = whole / "run" / "step_3" / "ckpt" / "value" / "policy"
    assert json.loads((value / "adapter_config.json").read_text())["modules_to_save"] == ["value_head"]
    saved = load_file(str(value / "adapter_model.safetensors"))
    head = [t for k, t in saved.items() if "value_head" in k]
    assert len(head) == 1 and float(head[0].abs().max()) > 0  # the head starts at 0: it was trained, and saved
    assert any("lora_B" in k and float(t.abs().max()) > 0 for k, t in saved.items())  # the backbone's adapters too


def test_lora_sft_writes_an_adapter_and_resumes(tmp_path, ckpts):
    from jobs.sft import run_sft

    run_sft(load_config(sft_args(tmp_path, ckpts["sdar"], **LORA, **{"training.max_steps": 2}), "sft"),
            progress=False)
    final = tmp_path / "sft" / "ckpt" / "optimized"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    run_sft(load_config(sft_args(tmp_path, ckpts["sdar"], **LORA, **{
        "training.max_steps": 3, "experiment.start_from_scratch": "false"}), "sft"), progress=False)
    loaded = load_model({"pretrained_model": str(ckpts["sdar"]), "model_base": "sdar", "dtype": "float32",
                         "adapter": str(final)})
    assert not torch.equal(logits(loaded), logits(load_model({"pretrained_model": str(ckpts["sdar"]),
                                                             "model_base": "sdar", "dtype": "float32"})))


def test_bad_lora_input_is_one_line(tmp_path, tiny, ckpts):
    with pytest.raises(ConfigError, match="lora.rank must be >= 1"):
        load_config(demo_args(tmp_path, ckpts["sdar"], **{**LORA, "lora.rank": 0}), "rl")
    with pytest.raises(ModelLoadError, match=r"match no module .*attn_out.*ff_proj"):
        wrap(tiny("llada"), LoraSettings(enabled=True, target_modules=["o_proj", "nope"]))
    with pytest.raises(ModelLoadError, match=r"target_parameters \['experts.gate_proj'\] match no expert tensor .*"
                                             r"experts.gate_up_proj"):
        wrap(tiny("sdar_moe"), LoraSettings(enabled=True, target_parameters=["experts.gate_proj"]))
    with pytest.raises(ModelLoadError, match=r"match no expert tensor of this SDARForCausalLM \(it has none\)"):
        wrap(tiny("sdar"), LoraSettings(enabled=True, target_parameters=["experts.down_proj"]))
    # an adapter trained on another base: sdar's adapter on llada, and on an sdar of another size
    adapter = tiny("sdar")
    wrap(adapter, LoraSettings(enabled=True, rank=4))
    adapter.model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ModelLoadError, match="does not match this base model"):
        load_adapter(tiny("llada").model, tmp_path / "adapter")
    with pytest.raises(ModelLoadError, match="does not match this base model"):
        load_adapter(tiny("sdar", size="demo").model, tmp_path / "adapter")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="needs a CUDA GPU"):
            load_model({"pretrained_model": str(ckpts["sdar"]), "model_base": "sdar"}, load_in_4bit=True)
        with pytest.raises(ModelLoadError, match="needs a CUDA GPU"):
            from jobs.rl import run_rl

            run_rl(load_config(demo_args(tmp_path / "q", ckpts["sdar"], **LORA, **{"lora.load_in_4bit": "true"}),
                               "rl"), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("config,family", [("cpu_ddp_2proc.yaml", "sdar"), ("cpu_zero2_2proc.yaml", "sdar"),
                                           ("cpu_zero3_2proc.yaml", "sdar"), ("cpu_zero3_2proc.yaml", "sdar_moe")])
def test_lora_under_two_processes_keeps_ranks_identical(tmp_path, ckpts, config, family):
    import os

    from safetensors.torch import load_file

    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RL_HARNESS"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RL_HARNESS_DUMP=str(tmp_path / "w"))
    args = demo_args(tmp_path, ckpts[family], family, **LORA, **{
        "experiment.total_step": 2, "experiment.save_every": 2, "rollout.num_task_per_step": 4,
        "optimizer.params.learning_rate": 5e-2, "training.gradient_checkpointing_enable": "true"})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), "--main_process_port", str(_free_port()),
           str(ROOT / "tests" / "rl_harness.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"w.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[0]["num_processes"] == 2
    adapter = load_file(str(tmp_path / "run" / "step_2" / "ckpt" / "policy" / "adapter_model.safetensors"))
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    # whole adapters, not ZeRO-3 shards: [out, rank] (an expert tensor's: [out, rank x experts])
    assert lora_b and all(t.dim() == 2 and t.shape[-1] in (LORA["lora.rank"], LORA["lora.rank"] * 8) for t in lora_b)
    assert max(float(t.float().abs().max()) for t in lora_b) > 0  # B starts at 0: the adapters were trained


def test_the_base_check_tolerates_another_dtype_and_catches_a_base_moved_by_percents(tmp_path):
    from models.lora import BASE_FINGERPRINT, _check_same_base, spread_indices

    n = 151936 * 2560  # an SDAR-4B embedding: float32 linspace would give index n
    assert spread_indices(n, 8).tolist() == [i * (n - 1) // 7 for i in range(8)] and spread_indices(3, 8).tolist() == [
        0, 1, 2]

    saved = {f"layer{i}.weight": [0.02 * (j - 3.5) for j in range(8)] for i in range(10)}
    (tmp_path / BASE_FINGERPRINT).write_text(json.dumps(saved))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "runs/base"}))
    rounded = {k: [v * (1 + 2 ** -8) for v in vs] for k, vs in saved.items()}  # bf16's worst rounding
    _check_same_base(rounded, tmp_path)
    _check_same_base({"other.weight": [1.0]}, tmp_path)  # no name in common: nothing to compare
    tuned = {k: [v * 1.05 for v in vs] for k, vs in saved.items()}  # every weight moved by 5%
    with pytest.raises(ModelLoadError, match="80 of 80 sampled base weights differ; it was trained on 'runs/base'"):
        _check_same_base(tuned, tmp_path)


def test_merge_lora_refuses_an_out_that_would_lose_a_model(tmp_path, capsys):
    """--out may not be the base or the adapter, nor a folder that holds files without --overwrite: refused in one
    line before any loading, with the folder untouched."""
    from tools.merge_lora import main as merge_main

    base, adapter, kept = tmp_path / "base", tmp_path / "adapter", tmp_path / "kept"
    for folder, name in ((base, "config.json"), (adapter, "adapter_config.json"), (kept, "config.json")):
        folder.mkdir()
        (folder / name).write_text("{}")
    for out, error in ((base, f"--out {base} is (or holds) an input of this command: write to another folder"),
                       (adapter, f"--out {adapter} is (or holds) an input of this command: write to another folder"),
                       (tmp_path, f"--out {tmp_path} is (or holds) an input of this command: write to another folder"),
                       (kept, f"--out {kept} is a folder that holds files: choose another, or pass --overwrite"),
                       (kept / "config.json", f"--out {kept / 'config.json'} is a file: name a folder")):
        assert merge_main(["--base", str(base), "--adapter", str(adapter), "--out", str(out),
                           "--model-base", "sdar"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {error}"]
    assert [(p.name, p.read_text()) for p in sorted(tmp_path.rglob("*.json"))] == [
        ("adapter_config.json", "{}"), ("config.json", "{}"), ("config.json", "{}")]
