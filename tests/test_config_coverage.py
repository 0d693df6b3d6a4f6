"""Every key a job accepts is consumed by that job (read while it runs), or rejected with a reason.

The job runs in-process on tiny models with read recording on (core.schema.record_reads); the union of the runs
must cover every leaf key of the job's schema. Copies made by the config code itself (``runs()``, ``replace``) do
not count as reads, so a key counts only when the code that uses it reads it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core.config import SCHEMAS, UNSUPPORTED, load_config
from core.loader import NO_EFFECT
from core.schema import config_fields, record_reads
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
         "rollout.stop_token_list=[<|im_end|>]"],
        [*common, f"model.pretrained_model={dream}", "model.model_base=dream", "experiment.project=b",
         "rollout.block_size=2", "rollout.steps=4", "rollout.max_active=3"],
        [*common, f"model.pretrained_model={sdar}", "experiment.project=c", "dataset.eval_dataset=builtin:code",
         "dataset.data_type=code", "rollout.max_token=8", "execute.num_chunk=2"],
    ]


def test_every_eval_key_is_consumed(tmp_path, demo_tokenizer, monkeypatch):
    from jobs import evaluate

    monkeypatch.setattr("jobs.rollout.BUILTIN_SIZE", 4)
    reads: set[tuple[type, str]] = set()
    for argv in _eval_runs(tmp_path, demo_tokenizer):
        with record_reads() as seen:
            cfg = load_config(argv, "eval")
            evaluate.run_eval(cfg, progress=False)
        reads |= seen
    missing = [key for key, (cls, name) in leaf_keys(SCHEMAS["eval"]).items() if not consumed(reads, cls, name)]
    assert missing == []


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_rejected_keys_have_reasons(kind):
    """Keys a job does not implement are refused with a reason, and are never also schema keys."""
    keys = set(leaf_keys(SCHEMAS[kind]))
    for key, reason in UNSUPPORTED[kind].items():
        assert reason and key not in keys
    for key, reason in NO_EFFECT.items():
        assert reason and key not in keys
