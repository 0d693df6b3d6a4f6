"""TensorBoard logging beside metrics.jsonl: event files written by an RL run, read back, same scalars."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from jobs.config import load_config
from models.tiny import save_tiny_checkpoint
from tests.test_rl import demo_args


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Scalars of every event file under ``log_dir`` (TFRecord framing: length, crc, event proto, crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_an_rl_run_writes_tensorboard_scalars_equal_to_its_metrics(tmp_path, demo_tokenizer, monkeypatch):
    pytest.importorskip("tensorboardX")
    from jobs.rl import run_rl
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    model = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    cfg = load_config(demo_args(tmp_path, model, **{"experiment.total_step": 2, "experiment.eval_every": 2,
                                                   "tensorboard.enabled": "true"}), "rl")
    run_rl(cfg, progress=False)
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert scalars["reward"] == pytest.approx({m["step"]: m["reward"] for m in metrics if "reward" in m})
    assert scalars["eval_acc"] == pytest.approx({0: metrics[0]["eval_acc"], 2: metrics[2]["eval_acc"]})
    assert set(scalars["optimizer_steps"]) == {1, 2}


def test_a_resumed_run_purges_the_steps_it_redoes_from_tensorboard(tmp_path, demo_tokenizer, monkeypatch):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2

    from jobs.rl import run_rl
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    model = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    over = {"experiment.eval_every": 0, "experiment.save_every": 1, "tensorboard.enabled": "true"}
    run_rl(load_config(demo_args(tmp_path, model, **over, **{"experiment.total_step": 2}), "rl"), progress=False)
    run_rl(load_config(demo_args(tmp_path, model, **over, **{"experiment.total_step": 3,
                                                             "experiment.start_from_scratch": "false"}), "rl"),
           progress=False)
    files = sorted((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2
    data, pos, starts = files[-1].read_bytes(), 0, []
    while pos < len(data):  # the resumed writer's file opens with a session start at the first step it redoes
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            starts.append(event.step)
    assert starts == [3]
    assert set(read_scalars(tmp_path / "run" / "tensorboard")["reward"]) == {1, 2, 3}


def test_a_writer_opened_in_the_same_second_keeps_the_earlier_file(tmp_path, monkeypatch):
    """TensorBoard names an event file by the second it opens in and the host: a resume within the same second
    must not write over the attempt before it."""
    pytest.importorskip("tensorboardX")
    import time

    from jobs.trackers import TensorBoard

    monkeypatch.setattr(time, "time", lambda: 1795636206.0)
    first = TensorBoard(tmp_path)
    first.log({"reward": 0.25}, step=1)
    first.finish()
    second = TensorBoard(tmp_path, purge_step=2)
    second.log({"reward": 0.5}, step=2)
    second.finish()
    assert len(list(tmp_path.glob("events.out.tfevents.1795636206.*"))) == 2
    assert read_scalars(tmp_path)["reward"] == pytest.approx({1: 0.25, 2: 0.5})


def test_wandb_keeps_the_values_of_a_redone_step(tmp_path, monkeypatch):
    """A resumed run logs the steps it redoes again: with the job's step as wandb's x axis (a metric, not wandb's
    own step counter, which refuses a step below its last) the redone step's values are kept (wandb offline)."""
    wandb = pytest.importorskip("wandb")
    from jobs.trackers import WandbRun

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = WandbRun(wandb.init(project="t", dir=str(tmp_path), mode="offline"))
    for step, reward in ((1, 0.1), (2, 0.2), (3, 0.3), (2, 0.5)):  # step 2 redone after a resume
        run.log({"reward": reward}, step=step)
    summary = dict(run.run.summary)
    run.finish()
    assert summary["reward"] == 0.5 and summary["step"] == 2


def test_a_missing_tracker_package_is_refused_before_an_overwritten_run_is_emptied(tmp_path, demo_tokenizer,
                                                                                   monkeypatch):
    import importlib.util
    import sys

    from core.files import RunDirError
    from jobs.rl import run_rl

    monkeypatch.delitem(sys.modules, "wandb", raising=False)  # another test may have planted a stand-in
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real_find_spec(name, *a))
    old = tmp_path / "run" / "step_5" / "metrics.json"
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    model = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    cfg = load_config(demo_args(tmp_path, model, **{"experiment.overwrite": "true", "wandb.enabled": "true"}), "rl")
    with pytest.raises(RunDirError, match="wandb.enabled is true but wandb is not installed"):
        run_rl(cfg, progress=False)
    assert old.read_text() == "{}"
