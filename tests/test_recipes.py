"""Every shipped recipe in configs/ loads and runs, in-process, on tiny substitutes.

Each config keeps its own recipe (sampler family settings, value model, process reward, thinking prompts, paired
evaluation lists); the test swaps only what a CPU test cannot have: the tiny checkpoint of the family (TraDo uses the
tiny SDAR model under ``model_base: trado``), the built-in datasets of the config's data type, tiny sizes, one
process (``num_node=1``, no launcher: tests/test_cluster.py covers the multi-node launch), float32, and a loopback
judge for the process reward. RL runs use the stand-in reward of tests/rl_harness.py (tiny random models never
answer correctly, so every group would be filtered).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from jobs.config import job_kind, load_config
from models.kinds import ATTENTION_OF
from models.tiny import save_tiny_checkpoint
from sample.trajectory import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if job_kind(p) in ("rl", "eval"))
FAMILIES = ("sdar", "dream", "llada", "mmada", "llada2", "llada_moe")
BUILTIN = {"math": "builtin:arithmetic", "code": "builtin:code"}
TOKENS = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, demo_tokenizer):
    base = tmp_path_factory.mktemp("recipe_ckpts")
    made = {m: save_tiny_checkpoint(base / m, m, demo_tokenizer, size="test") for m in FAMILIES}
    return {**made, "trado": made["sdar"]}  # TraDo checkpoints are SDAR models


def _file_config(path: Path, kind: str):
    return load_config([f"config={path}"], kind, stream=io.StringIO())


def _tiny(section: str, params, full_attention: bool) -> list[str]:
    """Size overrides of a sampler section: a few tokens, and as few denoising steps for full attention."""
    out = [f"{section}.max_token={TOKENS}"]
    if full_attention and params.steps is not None:
        out.append(f"{section}.steps={TOKENS}")
    return out


def _overrides(path: Path, kind: str, ckpts: dict, out: Path, judge_url: str | None) -> list[str]:
    cfg = _file_config(path, kind)
    base = cfg.model.model_base
    full = ATTENTION_OF[base] == "full"
    args = [f"config={path}", f"experiment.output_dir={out}", "experiment.num_node=1",
            "experiment.deepspeed_file=null", f"model.pretrained_model={ckpts[base]}", "model.dtype=float32",
            "system.base_dir=null"]
    if kind == "eval":
        runs = cfg.rollout.runs()
        return [*args, f"dataset.eval_dataset={BUILTIN[cfg.dataset.data_type]}", "rollout.num_response_per_task=2",
                *_tiny("rollout", runs[0], full)]
    args += [f"dataset.train_dataset={BUILTIN[cfg.dataset.data_type]}",
             f"evaluation.eval_dataset={BUILTIN[cfg.evaluation.data_type]}",
             "experiment.total_step=1", "experiment.save_every=1", "experiment.eval_every=1",
             "rollout.num_task_per_step=2", "rollout.num_response_per_task=2", *_tiny("rollout", cfg.rollout, full),
             "evaluation.num_response_per_task=1", *_tiny("evaluation", cfg.evaluation.runs()[0], full),
             "reward.acc_low=0.0", "reward.acc_high=1.0", "reward.filter_all_equal=false",
             "training.mixed_precision=no", "training.gradient_checkpointing_enable=false",
             "training.gradient_accumulation_steps=1", "training.max_prompt_len=null", "execute.num_chunk=2"]
    if cfg.model.value_base_model:
        args.append(f"model.value_base_model={ckpts[base]}")
    if cfg.model.process_reward_model:
        assert judge_url is not None
        args += ["model.process_reward_model=judge-model", f"process_reward.base_url={judge_url}",
                 "process_reward.chunk_length=3", "process_reward.k_sample=1"]
    return args


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_on_tiny_substitutes(path, ckpts, tmp_path, judge_endpoint, monkeypatch, demo_tokenizer):
    monkeypatch.setattr("data.builtin.BUILTIN_SIZE", 2)  # tasks of a built-in dataset (evaluation, eval.py)
    kind = job_kind(path)
    recipe = _file_config(path, kind)
    url, judge = judge_endpoint() if kind == "rl" and recipe.model.process_reward_model else (None, None)
    argv = _overrides(path, kind, ckpts, tmp_path, url)
    run = tmp_path / path.stem  # the project defaults to the file's stem
    if kind == "eval":
        import eval as eval_entry

        assert eval_entry.main(argv) == 0
        results = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
        settings = recipe.rollout.runs()
        assert len(results) == len(settings) and all(r["responses"] == 4 for r in results)
        assert [r["setting"]["remasking_strategy"] for r in results] == [s.remasking_strategy for s in settings]
        trajs = [t for f in sorted(run.glob("trajectories-*.jsonl")) for t in read_jsonl(f)]
        assert len(trajs) == 4 * len(settings) and all(len(t.response_ids) <= TOKENS for t in trajs)
        assert bool(list(run.glob("trace-*.html"))) == recipe.rollout.output_unmasking_history
        header = "<|im_start|>assistant\n"
        for t in trajs:
            prompt = demo_tokenizer.decode(t.prompt_ids)
            turn = prompt[prompt.rindex(header) + len(header):]
            assert turn == ("<think>\n" if recipe.rollout.start_with_think else "")
        return

    import rl
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    assert rl.main(argv) == 0
    metrics = json.loads((run / "step_1" / "metrics.json").read_text())
    assert metrics["optimizer_steps"] >= 1 and metrics["kept"] > 0
    assert (run / "step_1" / "ckpt" / "DONE").is_file()
    results = (run / "step_1" / "eval" / "results.jsonl").read_text().splitlines()
    assert len(results) == len(recipe.evaluation.runs())
    if recipe.model.value_base_model:
        assert (run / "step_1" / "ckpt" / "value").is_dir()
    if judge is not None:
        assert metrics["judgments"] == len(judge.requests) > 0 and metrics["judge_unparseable"] == 0


def test_every_multinode_recipe_names_an_existing_launch_config():
    """multinode_*.yaml: num_node > 1 and a launcher config of that many machines (ZeRO-3 where a value model runs:
    it trains beside the policy, each with its own engine)."""
    from jobs.cluster import accelerate_config_for, accelerate_config_size

    multinode = [p for p in RECIPES if p.stem.startswith("multinode_")]
    assert len(multinode) >= 12
    for path in multinode:
        cfg = _file_config(path, job_kind(path))
        launch = accelerate_config_for(cfg.experiment.deepspeed_file, cfg.experiment.num_node)
        assert cfg.experiment.num_node > 1 and accelerate_config_size(launch)[1] == cfg.experiment.num_node, path.name
        if getattr(cfg.model, "value_base_model", None):
            assert "zero_stage: 3" in launch.read_text(), path.name
