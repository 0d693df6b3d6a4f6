"""Every key a job accepts is consumed by that job (read while it runs), or rejected with a reason.

The job runs in-process on tiny models with read recording on (core.schema.record_reads); the union of the runs
must cover every leaf key of the job's schema. Copies made by the config code itself (``runs()``, ``replace``) do
not count as reads, so a key counts only when the code that uses it reads it.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
from pathlib import Path

import pytest

from core.schema import config_fields, record_reads
from jobs.config import NO_EFFECT, SCHEMAS, UNSUPPORTED
from models.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def leaf_keys(cls: type, prefix: str = "") -> dict[str, tuple[type, str]]:
    """Dotted leaf key -> (section class, field name)."""
    out: dict[str, tuple[type, str]] = {}
    for name, (tp, _) in config_fields(cls).items():
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(leaf_keys(tp, f"{prefix}{name}."))
        else:
            out[prefix + name] = (cls, name)
    return out


def consumed(reads: set[tuple[type, str]], cls: type, name: str) -> bool:
    """Read on an object of the section's class or of a class it derives its objects from (e.g. ``runs()``)."""
    return any(field == name and (issubclass(cls, c) or issubclass(c, cls)) for c, field in reads)


def _eval_runs(tmp_path: Path, demo_tokenizer) -> list[list[str]]:
    sdar = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    dream = save_tiny_checkpoint(tmp_path / "dream", "dream", demo_tokenizer, size="test")
    common = ["config=configs/demo/eval_demo.yaml", f"experiment.output_dir={tmp_path / 'out'}",
              "rollout.max_token=4", "rollout.num_response_per_task=2", "rollout.pass_k=[1,2]",
              f"system.base_dir={ROOT}", "system.env={DLLM_COVERAGE_TEST: '1'}"]
    return [
        [*common, f"model.pretrained_model={sdar}", "experiment.project=a",
         "rollout.remasking_strategy=[low_confidence_dynamic,entropy_bounded]", "rollout.top_k=[0,1]",
         "rollout.stop_token_list=[<|im_end|>]", "rollout.editing_threshold=0.9", "rollout.max_post_steps=2"],
        [*common, f"model.pretrained_model={dream}", "model.model_base=dream", "experiment.project=b",
         "rollout.block_size=2", "rollout.steps=4", "rollout.max_active=3"],
        [*common, f"model.pretrained_model={sdar}", "experiment.project=c", "dataset.eval_dataset=builtin:code",
         "dataset.data_type=code", "rollout.max_token=8", "execute.num_chunk=2"],
    ]


def test_every_eval_key_is_consumed(tmp_path, demo_tokenizer, monkeypatch):
    import eval as eval_entry

    monkeypatch.setattr("data.builtin.BUILTIN_SIZE", 4)
    reads: set[tuple[type, str]] = set()
    for argv in _eval_runs(tmp_path, demo_tokenizer):
        with record_reads() as seen:
            assert eval_entry.main(argv) == 0
        reads |= seen
    missing = [key for key, (cls, name) in leaf_keys(SCHEMAS["eval"]).items() if not consumed(reads, cls, name)]
    assert missing == []


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_rejected_keys_have_reasons(kind):
    """Keys a job does not implement are refused with a reason, and are never also schema keys."""
    keys = set(leaf_keys(SCHEMAS[kind]))
    for key, reason in UNSUPPORTED[kind].items():
        assert reason and key not in keys
    for key, reason in NO_EFFECT[kind].items():
        assert reason and key not in keys


class _FakeWandb:
    """Stands in for the wandb package: records what the job sends (its spec lets find_spec see it installed)."""

    __spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def __init__(self):
        self.inits, self.logs = [], []

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def define_metric(self, name, step_metric=None):
        pass

    def log(self, data, step=None):
        assert step is None  # the job's step is a metric (jobs/trackers.WandbRun)
        self.logs.append((data["step"], data))

    def finish(self):
        pass


def test_every_rl_key_is_consumed(tmp_path, demo_tokenizer, monkeypatch, judge_endpoint):
    import sys

    import rl
    from tests import rl_harness
    from tests.test_process_reward import _tiny_ar_judge

    monkeypatch.setattr("data.builtin.BUILTIN_SIZE", 6)
    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    sdar = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    llada = save_tiny_checkpoint(tmp_path / "llada", "llada", demo_tokenizer, size="test")
    common = ["config=configs/demo/rl_demo.yaml", f"experiment.output_dir={tmp_path / 'out'}",
              "experiment.total_step=1", "experiment.eval_every=1", "rollout.num_task_per_step=2",
              "rollout.num_response_per_task=2", "rollout.max_token=4", "evaluation.max_token=4",
              "evaluation.num_response_per_task=2", "evaluation.pass_k=[2]", "reward.acc_low=0.0",
              "training.max_prompt_len=512", "wandb.enabled=true", "wandb.entity=lab", f"system.base_dir={ROOT}"]
    runs = [
        [*common, f"model.pretrained_model={sdar}", "experiment.project=a", "training.ref_beta=0.1",
         f"model.value_base_model={sdar}", "training.gam=0.9", "training.lam=0.8",
         "training.check_sampler_logp=true", "training.eps_high=0.3", "training.samples_per_step=2",
         "rollout.remasking_strategy=low_confidence_dynamic", "evaluation.top_k=[0,0]",
         "evaluation.remasking_strategy=[entropy_bounded,low_confidence_dynamic]", "rollout.editing_threshold=0.9",
         "rollout.max_post_steps=2", "evaluation.editing_threshold=0.9", "evaluation.max_post_steps=1"],
        [*common, f"model.pretrained_model={llada}", "model.model_base=llada", "experiment.project=b",
         "training.method=random_masking", "training.old_logp=recompute", "rollout.block_size=2",
         "rollout.steps=2", "evaluation.block_size=2", "evaluation.steps=2",
         "rollout.remasking_strategy=entropy_bounded", "reward.filter_all_equal=false",
         "tensorboard.enabled=true", f"tensorboard.log_dir={tmp_path / 'tb'}",
         "lora.enabled=true", "lora.rank=2", "lora.alpha=4", "lora.dropout=0.1", "lora.bias=lora_only",
         "lora.target_modules=[q_proj,v_proj,ff_proj]", "lora.modules_to_save=[]", "lora.init_seed=3"],
        [*common, f"model.pretrained_model={sdar}", "experiment.project=c", "dataset.train_dataset=builtin:code",
         "dataset.data_type=code", "evaluation.eval_dataset=builtin:code", "evaluation.data_type=code",
         "execute.num_chunk=2", "reward.filter_all_equal=false"],
    ]
    runs.append([*runs[0], "experiment.overwrite=true"])  # the same run directory again, replaced
    # the process reward, with a local judge and with an endpoint on loopback
    judge = _tiny_ar_judge(tmp_path / "judge", demo_tokenizer)
    url, _ = judge_endpoint()
    runs.append([*runs[0], "experiment.project=d", f"model.process_reward_model={judge}",
                 "process_reward.max_new_tokens=2", "process_reward.concurrency=4", "process_reward.chunk_length=2"])
    runs.append([*runs[0], "experiment.project=e", "model.process_reward_model=judge-model",
                 f"process_reward.base_url={url}", "process_reward.k_sample=1", "process_reward.timeout=30",
                 "process_reward.retries=1", "process_reward.api_key_env=DLLM_TEST_KEY"])
    # algorithms' own keys (train/algorithms/spg.py, bgpo.py)
    runs.append([*common, f"model.pretrained_model={sdar}", "experiment.project=f", "training.method=spg",
                 "training.eubo_beta=1.0", "training.eubo_weight=0.7"])
    runs.append([*common, f"model.pretrained_model={sdar}", "experiment.project=g", "training.method=bgpo",
                 "training.dual_clip=2.0", "training.mask_times_per_sample=2"])
    runs.append([*common, f"model.pretrained_model={sdar}", "experiment.project=h", "training.method=vrpo",
                 "training.preference_beta=0.5"])
    reads: set[tuple[type, str]] = set()
    for i, argv in enumerate(runs):
        if i != 2:  # math runs: the stand-in reward varies within a group, so the update runs
            rl_harness.install(patch=monkeypatch.setattr)
        else:
            monkeypatch.undo()
            monkeypatch.setattr("data.builtin.BUILTIN_SIZE", 6)
            monkeypatch.setitem(sys.modules, "wandb", wandb)
        with record_reads() as seen:
            assert rl.main(argv) == 0
        reads |= seen
    missing = [key for key, (cls, name) in leaf_keys(SCHEMAS["rl"]).items() if not consumed(reads, cls, name)]
    assert missing == [], missing
    assert wandb.inits[0]["entity"] == "lab" and [s for s, _ in wandb.logs][:2] == [0, 1]
    # training.ref_beta's KL to the frozen reference reaches the log (it was computed, then dropped, once)
    logged = [json.loads(line) for line in (tmp_path / "out" / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged if "ref_kl" in row] == [1]
    assert logged[-1]["ref_kl"] > -1e-6  # k3 >= 0 up to rounding


def test_every_sft_key_is_consumed(tmp_path, demo_tokenizer):
    from jobs.sft_entry import main

    sdar = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    common = ["config=configs/demo/sft_demo.yaml", f"experiment.output_dir={tmp_path / 'out'}",
              f"model.pretrained_model={sdar}", "dataset.builtin_size=8", "training.samples_per_step=4",
              "training.max_steps=2", f"system.base_dir={ROOT}", "dataset.builtin_difficulty=2"]
    first = ["training.random_mask_mode=per_position", "training.mask_times_per_sample=2"]
    runs = [[*common, "experiment.project=a", "training.save_every=1", *first],
            # a run resumes under its own config (jobs/checkpoint.py check_resumed_config): longer, saved more rarely
            [*common, "experiment.project=a", "experiment.start_from_scratch=false", "training.max_steps=3", *first],
            [*common, "experiment.project=a", "experiment.overwrite=true", "training.method=trace",
             "training.shrink=2", "training.layout=per_round", "lora.enabled=true", "lora.rank=2", "lora.alpha=4",
             "lora.dropout=0.1", "lora.bias=all", "lora.target_modules=[q_proj,o_proj]", "lora.modules_to_save=[]",
             "lora.init_seed=1"]]
    reads: set[tuple[type, str]] = set()
    for argv in runs:
        with record_reads() as seen:
            assert main("sdar", argv) == 0
        reads |= seen
    missing = [key for key, (cls, name) in leaf_keys(SCHEMAS["sft"]).items() if not consumed(reads, cls, name)]
    assert missing == [], missing
