"""SFT: samples from data rows, each method's loss against a direct computation, learning, resume, 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from safetensors.torch import load_file

from data.formats import DataFormatError
from jobs.config import load_config
from jobs.sft import SFTJob, build_samples, read_rows, run_sft, turn_end_id
from models.tiny import save_tiny_checkpoint
from train.accelerator import build_accelerator
from train.settings import OptimizerParams, RLTrainingConfig, SFTTrainingConfig
from train.sft_trainer import ANNEAL_PROCESS_STRIDE, ANNEAL_SALT, SFTTrainer, sft_sample
from train.views import ModelTraits, build_view

ROOT = Path(__file__).resolve().parents[1]


def sft_args(out: Path, model: Path, **over) -> list[str]:
    args = {"experiment.output_dir": out, "experiment.project": "sft", "model.pretrained_model": model,
            "dataset.builtin_size": 64, "training.samples_per_step": 8, "training.max_steps": 6,
            "optimizer.params.learning_rate": 3e-3}
    args.update(over)
    return ["config=configs/demo/sft_demo.yaml", *(f"{k}={v}" for k, v in args.items())]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_tokenizer):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("sft") / "sdar", "sdar", demo_tokenizer, size="test")


def test_rows_become_samples_closed_by_the_turn_end(tiny, tmp_path):
    adapter = tiny("sdar")
    end = turn_end_id(adapter)
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 2+2?", "response": "4"},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello<|im_end|>"}]},
            {"prompt": "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", "response": "A B"}]
    n = len(adapter.encode_text("A B"))
    rows[2]["step_map"] = list(range(n))
    data.write_text("\n".join(json.dumps(r) for r in rows))
    samples = build_samples(read_rows(str(data)), adapter, "d")
    assert [s.response_ids[-1] for s in samples] == [end] * 3
    assert samples[0].response_ids == adapter.encode_text("4") + [end]
    assert samples[0].prompt_ids == adapter.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    # a response closed in its text ends with the turn end itself, not with its spelling in pieces
    assert samples[1].response_ids == adapter.encode_text("Hello") + [end]
    tok = adapter.tokenizer
    assert samples[2].prompt_ids == tok.encode(rows[2]["prompt"], add_special_tokens=False)  # pre-templated
    assert samples[2].step_map == list(range(1, n + 2))  # 0-based steps shifted; the appended turn end decodes last
    assert samples[0].step_map == list(range(1, len(samples[0].response_ids) + 1))  # no step map: left to right


def test_a_row_with_its_own_prompt_keeps_it_whatever_else_it_carries(tiny):
    adapter = tiny("sdar")
    rows = [{"question": "id-17", "prompt": "Say hi", "response": "hi"},
            {"question": "What is 2 + 3?", "response": "5"}]  # a built-in task's row: the math prompt
    own, task = build_samples(rows, adapter, "d")
    assert own.prompt_ids == adapter.encode_chat([{"role": "user", "content": "Say hi"}])
    assert adapter.tokenizer.decode(task.prompt_ids).count("What is 2 + 3?") == 1
    assert "id-17" not in adapter.tokenizer.decode(own.prompt_ids)


def test_steps_deal_samples_per_process_and_never_leave_a_process_empty():
    from jobs.sft import step_bounds

    assert step_bounds(64, 16, 1) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert step_bounds(64, 16, 2) == [(0, 32), (32, 64)]  # samples_per_step is per process
    assert step_bounds(65, 16, 2) == [(0, 32), (32, 65)]  # one left over: it joins the last step
    assert step_bounds(66, 16, 2) == [(0, 32), (32, 64), (64, 66)]  # one for each process: a step of its own
    assert step_bounds(10, None, 2) == [(0, 10)]


def test_epochs_are_passes_over_the_data_with_one_schedule(tmp_path, ckpt):
    """num_train_epochs=2: twice the steps, each one optimiser step, the learning rate decaying over all of them
    (not each step repeated per epoch, which ran the schedule down to 0 halfway)."""
    run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 0, "training.num_train_epochs": 2,
                                                    "dataset.builtin_size": 16, "lr_scheduler.scheduler": "linear"}),
                        "sft"), progress=False)
    lines = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    lrs = [line["lr"] for line in lines]
    assert len(lines) == 4 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0


@pytest.mark.parametrize("method", ["semi-ar", "trace"])
def test_sft_loss_equals_a_direct_computation_from_full_logits(tiny, method):
    adapter = tiny("sdar", seed=3)
    samples = [sft_sample([5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25], "a", [2, 1, 3, 3, 5, 4]),
               sft_sample([30, 31], [40, 41, 42], "b")]
    cfg = SFTTrainingConfig(method=method, layout="per_round", samples_per_step=None, seed=1)
    trainer = SFTTrainer(adapter, cfg, OptimizerParams(), accelerator=build_accelerator())
    batch = build_view(samples, {"a": 1.0, "b": 1.0}, trainer.cfg, trainer.traits)
    labels = [sorted(batch.labels[batch.sample_index == i].tolist()) for i in range(2)]
    sequences = [[5, 6, 7, 8, 9, 20, 21, 22, 23, 24, 25], [30, 31, 40, 41, 42]]
    positions = batch.position_ids[batch.rows, batch.token_cols]  # each trained token's place in its sequence
    assert batch.labels.tolist() == [sequences[s][p] for s, p in zip(batch.sample_index.tolist(), positions.tolist())]
    if method == "trace":  # rounds of the step map: block [20..23] at positions 4..7 has steps 1,2,3 -> 3 rounds
        assert batch.num_tokens == 9 and sorted(batch.steps[batch.sample_index == 0].tolist()) == [1, 2, 3, 3, 4, 5]
        assert labels == [[20, 21, 22, 23, 24, 25], [40, 41, 42]]  # every response token trained once, its own
    else:  # random masking: every trained token is masked in its row's copy
        assert 0 < batch.num_tokens <= 9
        assert set(labels[0]) <= {20, 21, 22, 23, 24, 25} and set(labels[1]) <= {40, 41, 42}
    with torch.no_grad():
        got = trainer.loss(batch, trainer.forward_logprobs(trainer.model, batch)).loss
        logits = adapter.forward(batch.input_ids, batch.position_ids, batch.layout).float()
        logp = logits.log_softmax(-1)[batch.rows, batch.cols, batch.labels]
        want = -(batch.weights * logp).sum()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.all(batch.input_ids[batch.rows, batch.token_cols] == adapter.mask_id)  # trained = masked


def test_an_sft_sample_records_no_log_probs_and_its_view_says_so(tiny):
    """Nothing sampled an SFT sample: it carries no log-probs (not zeros), and its views' old log-probs are NaN,
    the value a loss that needed them would refuse."""
    from sample.trajectory import Trajectory

    sample = sft_sample([5, 6, 7], [20, 21, 22, 23, 24], "a")
    assert sample.logprobs == [] and sample.step_map == [1, 2, 3, 4, 5]
    trainer = SFTTrainer(tiny("sdar"), SFTTrainingConfig(method="trace", samples_per_step=None), OptimizerParams(),
                         accelerator=build_accelerator())
    batch = build_view([sample], {"a": 1.0}, trainer.cfg, trainer.traits)
    assert batch.old_logprobs.numel() == 5 and torch.isnan(batch.old_logprobs).all()
    with pytest.raises(ValueError, match="response has 2 tokens but step_map has 2 and logprobs 1"):
        Trajectory(prompt_ids=[1], response_ids=[2, 3], step_map=[1, 2], logprobs=[0.0])


def test_semi_ar_and_ar_views_of_full_attention_models(tiny):
    dream = tiny("dream", seed=1)
    sample = sft_sample([5, 6, 7], [20, 21, 22, 23, 24], "a")
    sample.block_size = 2
    cfg = SFTTrainingConfig(method="semi-ar", lower_p=1.0, upper_p=1.0, samples_per_step=None)
    semi = SFTTrainer(dream, cfg, OptimizerParams(), accelerator=build_accelerator())
    batch = build_view([sample], {"a": 1.0}, semi.cfg, semi.traits)
    # blocks {0,1}, {2,3}, {4}: one row each; a row masks its block (ratio 1 here) and every later block
    assert batch.num_rows == 3 and batch.token_index.tolist() == [0, 1, 2, 3, 4]
    mask = dream.mask_id
    assert batch.input_ids[0, 3:].tolist() == [mask] * 5
    assert batch.input_ids[1, 3:].tolist() == [20, 21, mask, mask, mask]
    assert batch.input_ids[2, 3:].tolist() == [20, 21, 22, 23, mask]
    twice = SFTTrainer(dream, SFTTrainingConfig(method="semi-ar", lower_p=1.0, upper_p=1.0, samples_per_step=None,
                                                mask_times_per_sample=2), OptimizerParams(),
                       accelerator=build_accelerator())
    doubled = build_view([sample], {"a": 1.0}, twice.cfg, twice.traits)  # every block drawn twice, block by block
    assert doubled.num_rows == 6
    assert doubled.input_ids[:, 3:].tolist() == [row for row in batch.input_ids[:, 3:].tolist() for _ in (0, 1)]
    ar = SFTTrainer(dream, SFTTrainingConfig(method="ar", samples_per_step=None), OptimizerParams(),
                    accelerator=build_accelerator())
    batch = build_view([sample], {"a": 1.0}, ar.cfg, ar.traits)
    assert batch.num_rows == 1 and batch.input_ids[0].tolist() == [5, 6, 7, 20, 21, 22, 23, 24]
    assert batch.cols.tolist() == [2, 3, 4, 5, 6]  # shifted: token i from the hidden state before it
    visible = batch.layout.dense_mask()[0, 0]
    assert visible[4].tolist() == [True] * 5 + [False] * 3  # causal
    with pytest.raises(Exception, match="shifted logits"):
        SFTTrainer(tiny("llada"), SFTTrainingConfig(method="ar"), OptimizerParams(), accelerator=build_accelerator())


@pytest.mark.parametrize(("base", "method"), [("dream", "semi-ar"), ("dream", "ar"), ("llada", "random_masking")])
def test_full_attention_sft_loss_equals_a_direct_computation(tiny, base, method):
    adapter = tiny(base, seed=3)
    samples = [sft_sample([5, 6, 7], [20, 21, 22, 23, 24], "a"), sft_sample([30], [40, 41, 42], "b")]
    for s in samples:
        s.block_size = 2
    trainer = SFTTrainer(adapter, SFTTrainingConfig(method=method, samples_per_step=None, seed=2), OptimizerParams(),
                         accelerator=build_accelerator())
    batch = build_view(samples, {"a": 1.0, "b": 1.0}, trainer.cfg, trainer.traits)
    assert batch.num_tokens > 0
    with torch.no_grad():
        got = trainer.loss(batch, trainer.forward_logprobs(trainer.model, batch)).loss
        logits = adapter.forward(batch.input_ids, batch.position_ids, batch.layout).float()
        logp = logits.log_softmax(-1)[batch.rows, batch.cols, batch.labels]
        want = -(batch.weights * logp).sum()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sft_on_the_builtin_task_lowers_the_loss(tmp_path, ckpt):
    out = run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 30, "dataset.builtin_size": 128,
                                                          "training.samples_per_step": 16}), "sft"),
                  progress=False)
    lines = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(x["nll"] for x in lines[:3]) / 3, sum(x["nll"] for x in lines[-3:]) / 3
    assert len(lines) == 30 and last < 0.6 * first
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_resume_after_a_save_continues_like_an_uninterrupted_run(tmp_path, ckpt, monkeypatch):
    run_sft(load_config(sft_args(tmp_path / "whole", ckpt), "sft"), progress=False)
    whole = [json.loads(x) for x in (tmp_path / "whole" / "sft" / "metrics.jsonl").read_text().splitlines()]
    save = SFTJob._save

    def save_then_die(self, step, history):
        save(self, step, history)
        if step == 3:
            raise KeyboardInterrupt  # killed right after the checkpoint of step 3

    monkeypatch.setattr(SFTJob, "_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_sft(load_config(sft_args(tmp_path / "cut", ckpt, **{"training.save_every": 3}), "sft"), progress=False)
    monkeypatch.setattr(SFTJob, "_save", save)
    run_sft(load_config(sft_args(tmp_path / "cut", ckpt, **{"training.save_every": 3,
                                                            "experiment.start_from_scratch": "false"}), "sft"),
            progress=False)
    resumed = [json.loads(x) for x in (tmp_path / "cut" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in resumed] == list(range(1, 7))
    assert [round(x["loss"], 6) for x in resumed] == [round(x["loss"], 6) for x in whole]
    a = load_file(str(tmp_path / "whole" / "sft" / "ckpt" / "optimized" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "sft" / "ckpt" / "optimized" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_kill_between_the_checkpoint_renames_resumes_from_a_complete_checkpoint(tmp_path, ckpt, monkeypatch):
    run_sft(load_config(sft_args(tmp_path / "whole", ckpt), "sft"), progress=False)
    whole = [json.loads(x) for x in (tmp_path / "whole" / "sft" / "metrics.jsonl").read_text().splitlines()]
    rename = Path.rename
    for when in ("before", "after"):  # the kill at step 4's save, around renaming last.partial into last
        def rename_then_die(self, target, when=when):
            step = json.loads((self / "trainer" / "loop.json").read_text())["step"] if self.is_dir() else 0
            if self.name != "last.partial" or step != 4:
                return rename(self, target)
            if when == "after":
                rename(self, target)
            raise KeyboardInterrupt

        args = sft_args(tmp_path / when, ckpt, **{"training.save_every": 2})
        monkeypatch.setattr(Path, "rename", rename_then_die)
        with pytest.raises(KeyboardInterrupt):
            run_sft(load_config(args, "sft"), progress=False)
        monkeypatch.setattr(Path, "rename", rename)
        left = sorted(p.name for p in (tmp_path / when / "sft" / "ckpt").iterdir())
        assert left == (["last.old", "last.partial"] if when == "before" else ["last", "last.old"])
        run_sft(load_config([*args, "experiment.start_from_scratch=false"], "sft"), progress=False)
        resumed = [json.loads(x) for x in (tmp_path / when / "sft" / "metrics.jsonl").read_text().splitlines()]
        assert [round(x["loss"], 6) for x in resumed] == [round(x["loss"], 6) for x in whole]
        assert sorted(p.name for p in (tmp_path / when / "sft" / "ckpt").iterdir()) == ["last", "optimized"]


def test_a_run_resumes_only_under_its_own_config(tmp_path, ckpt):
    from core.files import RunDirError

    run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 2, "training.save_every": 1}), "sft"),
            progress=False)
    with pytest.raises(RunDirError, match="'optimizer.params.learning_rate' was 0.003 and is now 1e-05"):
        run_sft(load_config(sft_args(tmp_path, ckpt, **{
            "training.max_steps": 4, "experiment.start_from_scratch": "false",
            "optimizer.params.learning_rate": 1e-5}), "sft"), progress=False)
    run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 3, "training.save_every": 2,
                                                    "experiment.start_from_scratch": "false"}), "sft"),
            progress=False)  # a longer run, saved more rarely: the same run
    lines = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    with pytest.raises(RunDirError, match="holds step 3, past this run's last step 2"):  # never relabelled
        run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 2,
                                                        "experiment.start_from_scratch": "false"}), "sft"),
                progress=False)
    loop = tmp_path / "sft" / "ckpt" / "last" / "trainer" / "loop.json"
    loop.write_text(json.dumps({**json.loads(loop.read_text()), "num_processes": 2}))  # as a 2-process run saves it
    with pytest.raises(RunDirError, match=r"saved by 2 process\(es\).*resume with 2 process\(es\) \(now 1\)"):
        run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 4,
                                                        "experiment.start_from_scratch": "false"}), "sft"),
                progress=False)
    loop.write_text(json.dumps({**json.loads(loop.read_text()), "num_processes": 1}))
    saved = tmp_path / "sft" / "config.yaml"  # as versions before the null default wrote it: the same setting
    saved.write_text(saved.read_text().replace("builtin_difficulty: null", "builtin_difficulty: 1"))
    assert "builtin_difficulty: 1" in saved.read_text()
    run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 4, "experiment.start_from_scratch": "false"}),
                        "sft"), progress=False)
    assert [json.loads(x)["step"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()] == [1, 2,
                                                                                                            3, 4]


def test_responses_cut_at_max_gen_length_are_reported(tmp_path, ckpt, capsys):
    run_sft(load_config(sft_args(tmp_path, ckpt, **{"training.max_steps": 1, "dataset.builtin_size": 8,
                                                    "training.max_gen_length": 3}), "sft"), progress=False)
    assert "note: 8 of 8 responses are longer than training.max_gen_length (3)" in capsys.readouterr().out


def test_rows_over_max_prompt_len_or_the_models_positions_are_skipped_and_reported(tmp_path, ckpt, capsys):
    """Rows 0-3: short; 4-5: a long prompt (over training.max_prompt_len); 6-7: a long response (over the model's
    positions, set to 48 here, with the prompt): each kind is skipped by id and said so, the rest train."""
    import shutil

    short = shutil.copytree(ckpt, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    rows = [{"prompt": f"What is {i} + 1?", "response": f"{i + 1}"} for i in range(4)]
    rows += [{"prompt": "word " * 40 + f"{i}?", "response": "1"} for i in range(2)]
    rows += [{"prompt": f"Count to {i}.", "response": "one two three " * 12} for i in range(2)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(sft_args(tmp_path, short, **{"training.max_steps": 1, "dataset.optimization_data": data,
                                                   "dataset.builtin_size": "null", "training.max_prompt_len": 40,
                                                   "training.max_gen_length": "null",
                                                   "training.samples_per_step": 4}), "sft")
    job = SFTJob(cfg, progress=False)
    try:
        job.prepare()
        kept = [s.sample_id for s in job.samples]
    finally:
        job.close()
    out = capsys.readouterr().out
    assert kept == ["r0", "r1", "r2", "r3"]
    assert "note: 2 of 8 rows have prompts over training.max_prompt_len (40) and are skipped: ['r4', 'r5']" in out
    assert "note: 2 of 6 rows are longer than the model's 48 positions (prompt and response) and are skipped: " \
        "['r6', 'r7']" in out


def test_script_family_must_match_the_model(tmp_path, ckpt):
    proc = subprocess.run([sys.executable, "train/sft_dream.py", *sft_args(tmp_path, ckpt)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train/sft_sdar.py" in proc.stderr.strip().splitlines()[-1]


def two_process_sft(tmp_path: Path, ckpt: Path, config: str, **overrides) -> Path:
    """Launch this file's SFT under the 2-process accelerate ``config``; checks that both ranks ran and ended with
    identical weights, and returns the saved checkpoint folder."""
    from tests.test_train_distributed import _free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SFT_DIGEST=str(tmp_path / "w"),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), "--main_process_port", str(_free_port()),
           str(Path(__file__).resolve()), *sft_args(tmp_path, ckpt, **overrides)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"w.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["num_processes"] == 2 and ranks[0]["digest"] == ranks[1]["digest"]
    return tmp_path / "sft" / "ckpt" / "optimized"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp_2proc.yaml", "cpu_zero3_2proc.yaml"])
def test_two_process_sft_ends_with_identical_weights(tmp_path, ckpt, config):
    out = two_process_sft(tmp_path, ckpt, config, **{"training.max_steps": 3})
    start = load_file(str(ckpt / "model.safetensors"))
    end = load_file(str(out / "model.safetensors"))
    assert max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-4


if __name__ == "__main__":  # launched by the 2-process test: SFT, then a digest of this rank's whole weights
    import hashlib

    from tests.launched import leave

    job = SFTJob(load_config(sys.argv[1:], "sft"), progress=False)
    job.run(job.prepare())
    from jobs.rl import sampling_weights

    with sampling_weights(job.trainer):
        digest = hashlib.sha256()
        for name, p in sorted(job.adapter.model.named_parameters()):
            digest.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    Path(f"{os.environ['SFT_DIGEST']}.{job.acc.process_index}.json").write_text(json.dumps(
        {"digest": digest.hexdigest(), "num_processes": job.acc.num_processes}))
    leave(job.acc)


def _weights_of(adapter, samples, **cfg):
    trainer = SFTTrainer(adapter, SFTTrainingConfig(samples_per_step=None, layout="per_round", **cfg),
                         OptimizerParams(), accelerator=build_accelerator())
    return build_view(samples, {s.sample_id: 1.0 for s in samples}, trainer.cfg, trainer.traits)


@pytest.mark.parametrize("base", ["sdar", "llada"])
def test_elbo_weighting_divides_each_noised_token_by_its_masking_probability(tiny, base):
    adapter = tiny(base)
    samples = [sft_sample([5, 6, 7], list(range(20, 36)), "a"), sft_sample([8], list(range(40, 51)), "b")]
    for s in samples:
        s.block_size = 4
    fixed = {"method": "random_masking", "lower_p": 0.25, "upper_p": 0.25, "seed": 4}
    plain, elbo = _weights_of(adapter, samples, **fixed), _weights_of(adapter, samples, elbo_weight=True, **fixed)
    assert torch.equal(plain.token_cols, elbo.token_cols) and plain.num_tokens > 0  # same draw, same tokens
    torch.testing.assert_close(elbo.weights, plain.weights * 4.0)  # t = 0.25 -> each token counts 4 times
    # coupled RL views: each draw (t = 0.25) is followed by its complement (t = 0.75)
    ids, adv = ModelTraits.from_adapter(adapter), {"a": 1.0, "b": 1.0}
    fixed.update(method="coupled", layout="per_round")
    plain = build_view(samples, adv, RLTrainingConfig(**fixed), ids)
    elbo = build_view(samples, adv, RLTrainingConfig(elbo_weight=True, **fixed), ids)
    ratio = elbo.weights / plain.weights
    first_copy = plain.unit % 2 == 0
    torch.testing.assert_close(ratio[first_copy], torch.full_like(ratio[first_copy], 4.0))
    torch.testing.assert_close(ratio[~first_copy], torch.full_like(ratio[~first_copy], 4.0 / 3.0))
    # t ~ U(0.2, 0.8) per row: one ratio per unit, equal to 1/t for a t inside the range
    varied = {"method": "random_masking", "lower_p": 0.2, "upper_p": 0.8, "seed": 5, "mask_times_per_sample": 6}
    plain, elbo = _weights_of(adapter, samples, **varied), _weights_of(adapter, samples, elbo_weight=True, **varied)
    ratio = elbo.weights / plain.weights
    per_unit = [ratio[plain.unit == u] for u in plain.unit.unique()]
    assert all(torch.allclose(r, r[0].expand_as(r)) for r in per_unit)
    assert all(1 / 0.8 - 1e-6 <= float(r[0]) <= 1 / 0.2 + 1e-6 for r in per_unit)
    assert len({round(float(r[0]), 6) for r in per_unit}) > 1


def test_elbo_weighting_is_refused_where_nothing_is_masked_at_random():
    with pytest.raises(Exception, match="elbo_weight"):
        SFTTrainingConfig(method="trace", elbo_weight=True)
    with pytest.raises(Exception, match="elbo_weight"):
        SFTTrainingConfig(method="random_masking", lower_p=0.0, elbo_weight=True)


def test_a_datasets_folder_gives_the_same_samples_as_its_jsonl(tiny, tmp_path):
    from datasets import Dataset, DatasetDict

    adapter = tiny("sdar")
    rows = [{"prompt": "What is 3+4?", "response": "7"}, {"prompt": "Name a colour.", "response": "Blue"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    from_file = build_samples(read_rows(str(tmp_path / "d.jsonl")), adapter, "d")
    from_folder = build_samples(read_rows(str(tmp_path / "folder")), adapter, "folder")
    assert [(s.prompt_ids, s.response_ids) for s in from_folder] == [(s.prompt_ids, s.response_ids)
                                                                     for s in from_file]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(
        str(tmp_path / "splits"))  # load_dataset(...).save_to_disk(...): its train split
    from_splits = build_samples(read_rows(str(tmp_path / "splits")), adapter, "splits")
    assert [s.response_ids for s in from_splits] == [s.response_ids for s in from_file]
    DatasetDict({"a": Dataset.from_list(rows), "b": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataFormatError, match=r"splits \['a', 'b'\] has no 'train' split"):
        read_rows(str(tmp_path / "ab"))


@pytest.mark.parametrize("row,expect", [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
     "message 1's content must be a string or a list of {type: text, text} parts, got NoneType"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "Hello"}]},
     "message 0's content must be"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
     "the assistant's message is empty"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
      "step_map": ["1", "2"]}, "field 'step_map': expected a list of non-negative integers"),
    ({"prompt": "Hi", "response": "Hello", "step_map": [1.5, 2.0]}, "field 'step_map'"),
    ({"messages": [{"role": "assistant", "content": "Hello"}]}, "needs a message before it to answer"),
    ({"messages": [{"role": 1, "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, "string roles"),
    ({"messages": [{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     "unknown role 'robot' (roles: system, developer, user, assistant, tool, ipython, function)"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n"}]},
     "the assistant's message is empty"),
    ({"prompt": "Hi", "response": "  \n\t"}, "field 'response': expected a non-empty string"),
])
def test_malformed_rows_are_one_line_errors_naming_the_row(tmp_path, row, expect):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "ok", "response": "ok"}) + "\n" + json.dumps(row))
    with pytest.raises(DataFormatError, match="row 1: field") as err:
        read_rows(str(tmp_path / "d.jsonl"))
    assert expect in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_response_that_is_only_the_turn_end_is_refused(tiny):
    adapter = tiny("sdar")
    closing = adapter.tokenizer.convert_ids_to_tokens(turn_end_id(adapter))
    with pytest.raises(DataFormatError, match=f"d.jsonl: row 1: the response is only the turn end '{closing}'"):
        build_samples([{"prompt": "Hi", "response": "Hello"}, {"prompt": "Hi", "response": f" {closing}\n"}],
                      adapter, "d.jsonl")


def test_chat_contents_as_text_parts_and_step_maps_with_or_without_the_turn_end(tiny, tmp_path):
    adapter = tiny("sdar")
    end, n = turn_end_id(adapter), len(adapter.encode_text("Hello there"))
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]}]},
            {"prompt": "Hi", "response": "Hello there", "step_map": [2] * n + [3]},  # the turn end recorded
            {"prompt": "Hi", "response": "Hello there", "step_map": [2] * n}]  # the turn end left out
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    parts, with_end, without_end = build_samples(read_rows(str(tmp_path / "d.jsonl")), adapter, "d")
    assert parts.prompt_ids == adapter.encode_chat([{"role": "user", "content": "Hi"}])
    assert parts.response_ids == adapter.encode_text("Hello there") + [end]
    assert with_end.step_map == without_end.step_map == [2] * n + [3]
    assert with_end.response_ids == without_end.response_ids == parts.response_ids


def test_a_prompt_that_mentions_a_special_token_is_still_templated(tiny):
    adapter = tiny("sdar")
    tok = adapter.tokenizer
    mention = f"What does {tok.eos_token} mean?"
    rendered = tok.decode(adapter.encode_chat("Q"))  # starts with the template's own special token
    asked, templated = build_samples([{"prompt": mention, "response": "An end."},
                                      {"prompt": rendered, "response": "A"}], adapter, "d")
    assert asked.prompt_ids == adapter.encode_chat([{"role": "user", "content": mention}])
    assert tok.eos_token_id not in asked.prompt_ids  # the mention stays text
    assert templated.prompt_ids == tok.encode(rendered, add_special_tokens=False)


def test_long_cot_rows_keep_their_think_tokens_and_train_every_block(tiny, tmp_path):
    adapter = tiny("sdar")
    tok = adapter.tokenizer
    thought = " ".join(f"step {i}: carry the {i % 10}." for i in range(40))
    row = {"prompt": "Add the numbers.", "response": f"<think>\n{thought}\n</think>\nThe answer is \\boxed{{7}}."}
    (tmp_path / "cot.jsonl").write_text(json.dumps(row))
    (sample,) = build_samples(read_rows(str(tmp_path / "cot.jsonl")), adapter, "cot")
    think, unthink = tok.convert_tokens_to_ids(["<think>", "</think>"])
    resp = sample.response_ids
    assert len(resp) > 300 and resp[0] == think and resp.count(unthink) == 1 and resp[-1] == turn_end_id(adapter)
    assert tok.decode(resp[:-1]) == row["response"]  # nothing of the long response is lost or re-tokenised
    # every response token is trained once by the trace view (one round per block position, 4-token blocks)
    batch = _weights_of(adapter, [sample], method="trace")
    assert sorted(batch.token_index.tolist()) == list(range(len(resp)))
    # max_gen_length keeps the first tokens only; the rest is never trained
    batch = _weights_of(adapter, [sample], method="trace", max_gen_length=64)
    assert sorted(batch.token_index.tolist()) == list(range(64))


def test_hub_datasets_are_read_through_the_datasets_cache(monkeypatch):
    """Read through ``datasets.load_dataset``; a hub that a quick probe cannot reach leaves the local cache only
    (huggingface_hub's and datasets' offline flags, set for the call and restored), where datasets would otherwise
    retry the network for about half a minute before reading its cache."""
    import datasets
    import datasets.config
    from huggingface_hub import constants

    import data.hub

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    calls, reachable = [], [True]

    def probe(timeout_s=data.hub.CONNECT_TIMEOUT_S):
        if not reachable[0]:
            raise data.hub.DownloadError("cannot reach huggingface.co:443: refused (no network?)")

    def fake_load(repo, split):
        calls.append((repo, split, constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        if repo == "org/missing":
            raise ConnectionError("offline and not in the cache\nmore")
        return datasets.Dataset.from_list([{"prompt": "Q", "response": "A"}])

    monkeypatch.setattr(data.hub, "check_reachable", probe)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert read_rows("hub:org/sft-data") == [{"prompt": "Q", "response": "A"}]
    assert read_rows("hub:org/sft-data:validation") and calls[-1] == ("org/sft-data", "validation", False, False)
    with pytest.raises(Exception, match=r"hub:org/missing: could not load .*\(ConnectionError: offline and not in"):
        read_rows("hub:org/missing")
    reachable[0] = False
    assert read_rows("hub:org/sft-data") == [{"prompt": "Q", "response": "A"}]
    assert calls[-1] == ("org/sft-data", "train", True, True)  # from the cache only
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)  # restored
    with pytest.raises(Exception, match=r"hub:org/missing: could not load the hub dataset \(cannot reach "
                                        r"huggingface.co:443: refused \(no network\?\); from the datasets cache "
                                        r"only: ConnectionError: offline and not in the cache\); "
                                        r"download it once"):
        read_rows("hub:org/missing")
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)  # restored after a failure
    with pytest.raises(Exception, match="expected hub:<org>/<name>"):
        read_rows("hub:no-org")


def test_attention_annealing_trains_causal_plus_a_growing_share_of_later_keys(tiny):
    """``training.attention_annealing_steps=4``: SFT step s (1-based) of a full-attention model trains under the
    causal layout plus each later key with probability s / 4, one seeded draw per step; from step 4 on, the view's
    own full attention. The loss is the one computed under that layout."""
    from models.common import AttentionLayout

    dream = tiny("dream", seed=1)
    samples = [sft_sample([5, 6, 7], [20, 21, 22, 23, 24, 25], "a"), sft_sample([8, 9], [30, 31, 32], "b")]
    cfg = SFTTrainingConfig(method="random_masking", samples_per_step=None, attention_annealing_steps=4, seed=2)
    trainer = SFTTrainer(dream, cfg, OptimizerParams(), accelerator=build_accelerator())
    advantages = {"a": 1.0, "b": 1.0}
    shares = []
    for step in (1, 2, 3, 4, 5):
        trainer.rl_step = step
        (batch,) = trainer.build_views(samples, advantages)
        if step >= 4:
            assert batch.layout.extra is None and not batch.layout.block.any()  # full attention
            continue
        want = AttentionLayout.annealed(batch.layout.valid, step / 4, trainer._generator(ANNEAL_SALT))
        assert torch.equal(batch.layout.extra, want.extra)
        assert torch.equal(batch.layout.block, torch.arange(batch.input_ids.shape[1]).expand_as(batch.layout.block))
        n = batch.layout.extra.shape[0]
        shares.append(float(batch.layout.extra.triu(1).sum()) / (n * (n - 1) / 2))
        with torch.no_grad():
            got = trainer.loss(batch, trainer.forward_logprobs(trainer.model, batch)).loss
            logp = dream.forward(batch.input_ids, batch.position_ids, batch.layout).float().log_softmax(-1)
            want_loss = -(batch.weights * logp[batch.rows, batch.cols, batch.labels]).sum()
        torch.testing.assert_close(got, want_loss, atol=1e-5, rtol=1e-5)
    assert shares[0] < shares[2]  # ~1/4 of the later keys, then ~3/4
    trainer.rl_step = 2
    (first,) = trainer.build_views(samples, advantages)
    with patch.object(type(trainer.accelerator), "process_index", 1):  # the second process draws its own keys
        (second,) = trainer.build_views(samples, advantages)
    want = AttentionLayout.annealed(second.layout.valid, 2 / 4, trainer._generator(ANNEAL_SALT + ANNEAL_PROCESS_STRIDE))
    assert torch.equal(second.layout.extra, want.extra) and not torch.equal(second.layout.extra, first.layout.extra)


@pytest.mark.parametrize("model_base, method", [("sdar", "random_masking"), ("dream", "ar")])
def test_attention_annealing_needs_full_attention_to_reach(tiny, model_base, method):
    cfg = SFTTrainingConfig(method=method, attention_annealing_steps=10)
    with pytest.raises(Exception, match="attention_annealing_steps.*no full attention to reach"):
        SFTTrainer(tiny(model_base), cfg, OptimizerParams(), accelerator=build_accelerator())


def test_annealed_steps_reach_the_forward_through_the_micro_batches(tiny, monkeypatch):
    """One real SFT step with annealing (rows dealt one per micro-batch, each cut to its own width): every attention
    call of the step sees the step's draw, cut to the micro-batch's width, and the step trains."""
    from models import common

    seen = []
    real = common.additive_mask

    def spy(layout, cache, dtype, groups=1):
        seen.append((layout.extra, layout.block.shape[1]))
        return real(layout, cache, dtype, groups)

    monkeypatch.setattr(common, "additive_mask", spy)
    dream = tiny("dream", seed=1)
    samples = [sft_sample([5, 6, 7], [20, 21, 22, 23, 24, 25], "a"), sft_sample([8], [30, 31], "b")]
    cfg = SFTTrainingConfig(method="random_masking", samples_per_step=None, batch_size_lm=1, shuffle=False,
                            attention_annealing_steps=3, lower_p=1.0, upper_p=1.0)
    trainer = SFTTrainer(dream, cfg, OptimizerParams(), accelerator=build_accelerator())
    (metrics,) = trainer.train_samples(samples)
    assert trainer.rl_step == 1 and metrics["tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    widths = sorted({width for _, width in seen})
    assert widths == [3, 9]  # the two rows, each cut to its own length
    draws = {width: extra for extra, width in seen}
    assert all(extra is not None and extra.shape == (width, width) for extra, width in seen)
    torch.testing.assert_close(draws[3], draws[9][:3, :3])  # one draw for the step, cut per micro-batch


def test_gradient_accumulation_steps_without_deepspeed_is_noted(capsys):
    from train.trainer import accelerator_for

    accelerator_for(SFTTrainingConfig(gradient_accumulation_steps=4))
    assert "note: training.gradient_accumulation_steps 4 has no effect without DeepSpeed" in capsys.readouterr().out
    assert accelerator_for(SFTTrainingConfig()).gradient_accumulation_steps == 1  # and the next one is plain again
    assert "gradient_accumulation_steps" not in capsys.readouterr().out
