"""Process reward: excerpts, parsing, grades, per-token placement by decoding order, judges (in-process and an
OpenAI-compatible endpoint on loopback, failing and recovering), and RL runs that train with it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from core.files import RunDirError
from jobs.config import load_config
from reward.process import (
    ProcessRewardConfig,
    chunk_ends,
    chunk_grade,
    excerpt_span,
    judge_messages,
    normalise_per_chunk,
    parse_grade,
    place_token_rewards,
    process_rewards,
)
from tests.test_rl import demo_args


def test_chunks_and_excerpts_of_a_hand_response():
    assert chunk_ends(5, 2) == [2, 4, 5] and chunk_ends(4, 2) == [2, 4] and chunk_ends(0, 2) == [0]
    assert [excerpt_span(k, 5, 2, "chunk") for k in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [excerpt_span(k, 5, 2, "prefix") for k in range(3)] == [(0, 2), (0, 4), (0, 5)]  # the reference
    chat = judge_messages("What is 2+2?", "4", "2+2 = 4. \\boxed{4}", False, "2+2 = 4.")
    text = chat[-1]["content"]
    assert chat[-1]["role"] == "user" and "Question:\nWhat is 2+2?" in text and "answer:\n4" in text
    assert "Complete solution (incorrect):\n2+2 = 4. \\boxed{4}" in text and "Excerpt to grade:\n2+2 = 4." in text
    assert text.endswith("Put your grade (1 or -1) in \\boxed{}.")


@pytest.mark.parametrize(("text", "grade"), [
    ("so it holds. \\boxed{1}", 1.0), ("\\boxed{-1}", -1.0), ("\\boxed{ -1 }", -1.0),
    ("first \\boxed{-1}, on reflection \\boxed{1}", 1.0),  # the last box counts
    ("\\boxed{0}", None), ("no grade", None), ("\\boxed{1", None), ("\\boxed{\\text{1}}", None), ("", None)])
def test_grades_are_parsed_from_the_last_box(text, grade):
    assert parse_grade(text) == grade


def test_chunk_grades_and_their_normalisation():
    assert chunk_grade([1.0, 1.0, 1.0], False) == 1.0 and chunk_grade([0.0, 0.0], True) == 0.0
    assert chunk_grade([1.0, -1.0, 1.0], False) == -1.0 and chunk_grade([0.0, 1.0], True) == 1.0
    grades = {"a": [1.0, -1.0, 1.0], "b": [-1.0, 1.0], "c": [1.0], "d": [5.0]}
    out = normalise_per_chunk(grades, {"g": ["a", "b", "c"], "h": ["d"]})
    # chunk 0 over a, b, c: values 1, -1, 1 (mean 1/3, std sqrt(8)/3); chunk 1 over a, b: -1, 1; chunk 2: a alone
    z = 2 / 8 ** 0.5
    assert out["a"] == pytest.approx([z, -1.0, 1.0]) and out["b"] == pytest.approx([-2 * z, 1.0])
    assert out["c"] == pytest.approx([z]) and out["d"] == [5.0]  # a group of one keeps its value


def test_token_rewards_follow_the_decoding_order():
    # a block model (block 2): chunk 0 ends at 4 -> window [2, 4) steps (2, 3): token 3; chunk 1 ends at 8 ->
    # window [6, 8) steps (5, 6): token 7; the final chunk -> every token of the largest step (7): tokens 8, 9
    steps = [1, 2, 2, 3, 4, 4, 5, 6, 7, 7]
    assert place_token_rewards(steps, [0.5, -1.0, 2.0], 4, 2) == [0, 0, 0, 0.5, 0, 0, 0, -1.0, 2.0, 2.0]
    # full attention (block 32 > chunk): window = the chunk's whole prefix; ties all get the grade; the final
    # chunk's tokens of the global last step overwrite an earlier chunk's pick
    steps = [5, 1, 3, 3, 2, 4]
    assert place_token_rewards(steps, [0.25, -0.5], 3, 32) == [-0.5, 0, 0, 0, 0, 0]
    steps = [1, 3, 3, 2, 4, 5]
    assert place_token_rewards(steps, [0.25, -0.5], 3, 32) == [0, 0.25, 0.25, 0, 0, -0.5]


def _sample(sid, group, ids, steps, correct):
    return SimpleNamespace(sample_id=sid, group_id=group, task_index=int(group), response_ids=ids, step_map=steps,
                           correct=correct)


def test_the_pipeline_on_hand_samples():
    tasks = [{"question": "Q0", "ground_truth_answer": "7"}]
    samples = [_sample("0-0", "0", [10, 11, 12], [1, 1, 2], True), _sample("0-1", "0", [20, 21], [2, 1], False)]
    seen = []

    def judge(chats):  # grades by the excerpt: an excerpt containing "10" or "20" is wrong
        seen.extend(chats)
        return ["\\boxed{-1}" if any(w in c[-1]["content"].split("Excerpt to grade:\n")[1] for w in ("10", "20"))
                else "I think \\boxed{1}" for c in chats]

    cfg = ProcessRewardConfig(chunk_length=2, k_sample=2)
    out = process_rewards(samples, tasks, lambda ids: " ".join(map(str, ids)), judge, cfg, block_size=2)
    assert len(seen) == (2 + 1) * 2 and out.judgments == 6 and out.unparseable == 0
    assert "Complete solution (correct):\n10 11 12" in seen[0][-1]["content"]
    # raw grades: 0-0 [-1 ("10 11"), 1 ("12")], 0-1 [-1 ("20 21")]; chunk 0 z-scored over both -> 0, 0
    assert out.chunk_grades == {"0-0": [0.0, 1.0], "0-1": [0.0]}
    assert out.token_rewards == {"0-0": [0.0, 0.0, 1.0], "0-1": [0.0, 0.0]}


# ------------------------------------------------------------------------------------------ an endpoint on loopback


def test_the_endpoint_judge_retries_then_recovers_and_stops_when_it_keeps_failing(judge_endpoint):
    from reward.judges import EndpointJudge, JudgeError

    url, handler = judge_endpoint(fail_first=2)
    waits: list[float] = []
    cfg = ProcessRewardConfig(retries=3, concurrency=1)
    judge = EndpointJudge(url, "judge-model", cfg, api_key="secret", sleep=waits.append)
    chat = [{"role": "user", "content": "Excerpt to grade:\nab"}]
    assert judge([chat]) == ["\\boxed{1}"] and waits == [1.0, 2.0] and judge.failures == 2
    path, auth, body = handler.requests[-1]
    assert path == "/v1/chat/completions" and auth == "Bearer secret" and body["model"] == "judge-model"
    assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["max_tokens"] == 10000

    url, _ = judge_endpoint(fail_first=-1)
    with pytest.raises(JudgeError, match=r"judge at http://127.0.0.1:\d+/v1/chat/completions failed 4 times in a "
                                         r"row \(last: HTTP 500\)"):
        EndpointJudge(url, "judge-model", cfg, sleep=lambda s: None)([chat])


# ------------------------------------------------------------------------------------------ RL runs


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo_tokenizer):
    from models.tiny import save_tiny_checkpoint

    base = tmp_path_factory.mktemp("process")
    return {"sdar": save_tiny_checkpoint(base / "sdar", "sdar", demo_tokenizer, size="test"),
            "judge": _tiny_ar_judge(base / "judge", demo_tokenizer)}


def _tiny_ar_judge(path: Path, tokenizer) -> Path:
    """A tiny random Llama-architecture causal LM with the demo tokenizer (and its chat template)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_local_judge_is_seeded_per_call_and_leaves_the_callers_random_state(models):
    import torch

    from reward.judges import LocalJudge
    from reward.process import ProcessRewardConfig

    judge = LocalJudge(str(models["judge"]), ProcessRewardConfig(temperature=1.0, max_new_tokens=6, concurrency=2),
                       seed=3)
    chats = [[{"role": "user", "content": f"Grade step {i}."}] for i in range(3)]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = judge(chats, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the training's random stream is untouched
    assert judge(chats, seed=7) == first and len(first) == 3  # a step's judgments are reproducible (resume)


def _process_args(tmp_path: Path, models: dict, **over) -> list[str]:
    args = demo_args(tmp_path, models["sdar"], **{"experiment.total_step": 2, "reward.acc_low": 0.0,
                                                  "reward.acc_high": 1.0, **over})
    args[0] = "config=configs/rl_trado_process_reward_with_value.yaml"
    return [*args, "experiment.deepspeed_file=null", "model.model_base=sdar", "model.dtype=float32",
            f"model.value_base_model={models['sdar']}", "training.mixed_precision=no",
            "training.gradient_checkpointing_enable=false", "training.gradient_accumulation_steps=1",
            "evaluation.eval_dataset=builtin:arithmetic", "dataset.train_dataset=builtin:arithmetic",
            "training.max_prompt_len=null", "process_reward.chunk_length=3", "process_reward.k_sample=2"]


def test_rl_with_an_endpoint_judge_trains_on_its_per_token_rewards(tmp_path, models, judge_endpoint, monkeypatch):
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    import jobs.rl
    from jobs.rl import run_rl
    from reward.process import process_rewards as reference_pipeline

    url, handler = judge_endpoint()
    captured = []
    gae = jobs.rl.RLJob._gae

    def spy(self, kept, rewards):
        expected = reference_pipeline(kept, self.tasks, lambda ids: self.adapter.tokenizer.decode(
            ids, skip_special_tokens=True), lambda chats: [_grade(c) for c in chats], self.cfg.process_reward, 4)
        captured.append((rewards, expected.token_rewards, len(kept)))
        return gae(self, kept, rewards)

    monkeypatch.setattr(jobs.rl.RLJob, "_gae", spy)
    cfg = load_config([*_process_args(tmp_path, models, **{"model.process_reward_model": "judge-model"}),
                       f"process_reward.base_url={url}"], "rl")
    history = run_rl(cfg, progress=False)
    assert [m["step"] for m in history[-2:]] == [1, 2]
    for (got, expected, n), m in zip(captured, history[-2:], strict=True):
        assert got == expected and len(got) == n == m["kept"]  # the rewards on the right samples
        assert any(v != 0 for r in got.values() for v in r)
        assert m["judgments"] == sum(2 * len(chunk_ends(len(r), 3)) for r in got.values())
        assert m["judge_unparseable"] == 0 and m["optimizer_steps"] >= 1
    assert len(handler.requests) == sum(m["judgments"] for m in history[-2:])


def _grade(chat: list[dict]) -> str:
    excerpt = chat[-1]["content"].split("Excerpt to grade:\n")[1]
    return "\\boxed{1}" if len(excerpt) % 2 == 0 else "\\boxed{-1}"


def test_rl_with_a_local_judge_runs_and_counts_what_it_could_not_parse(tmp_path, models, monkeypatch):
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    from jobs.rl import run_rl

    cfg = load_config([*_process_args(tmp_path, models, **{"model.process_reward_model": models["judge"]}),
                       "process_reward.max_new_tokens=4", "process_reward.max_model_len=4096",
                       "process_reward.concurrency=8"], "rl")
    history = run_rl(cfg, progress=False)
    for m in history[-2:]:  # a random judge never writes a box: every judgment counted, rewards all 0
        assert m["judgments"] > 0 and m["judge_unparseable"] == m["judgments"] and m["optimizer_steps"] >= 1
    # a local judge's batches are `concurrency` prompts, which changes its answers: not changeable on resume
    resume = [*_process_args(tmp_path, models, **{"model.process_reward_model": models["judge"]}),
              "process_reward.max_new_tokens=4", "process_reward.max_model_len=4096", "experiment.total_step=3",
              "experiment.start_from_scratch=false"]
    with pytest.raises(RunDirError, match="'process_reward.concurrency' was 8 and is now 4"):
        run_rl(load_config([*resume, "process_reward.concurrency=4"], "rl"), progress=False)


def test_a_judge_that_keeps_failing_stops_the_run_with_one_line(tmp_path, models, judge_endpoint, capsys,
                                                               monkeypatch):
    import rl
    from tests import rl_harness

    rl_harness.install(patch=monkeypatch.setattr)
    monkeypatch.setattr("reward.judges.time.sleep", lambda s: None)
    url, _ = judge_endpoint(fail_first=-1)
    code = rl.main([*_process_args(tmp_path, models, **{"model.process_reward_model": "judge-model"}),
                    f"process_reward.base_url={url}", "process_reward.retries=1"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1
    assert "judge at" in lines[0] and "failed 2 times in a row (last: HTTP 500)" in lines[0]
    assert not (tmp_path / "run" / "step_1").exists()  # no step trained on missing rewards


def test_process_reward_configs_load_and_refuse_what_cannot_work():
    from core.loader import ConfigError

    for fam in ("trado", "sdar"):
        cfg = load_config([f"config=configs/rl_{fam}_process_reward_with_value.yaml"], "rl")
        assert cfg.process_reward.chunk_length == 200 and cfg.process_reward.k_sample == 3
        assert cfg.training.gam == 0.99 and cfg.model.value_base_model
    # the reference's spelling of the section (rollout.reward_model) loads into ours
    cfg = load_config(["config=configs/demo/rl_demo.yaml", "rollout.reward_model.reward_chunk_length=64",
                       "rollout.reward_model.max_generation_token=99", "rollout.reward_model.k_sample=5"], "rl")
    assert (cfg.process_reward.chunk_length, cfg.process_reward.max_new_tokens, cfg.process_reward.k_sample) == \
        (64, 99, 5)
    with pytest.raises(ConfigError, match="model.process_reward_model.*needs the value model"):
        load_config(["config=configs/rl_trado_process_reward_with_value.yaml", "model.value_base_model=null"], "rl")
    with pytest.raises(ConfigError, match="grades math solutions"):
        load_config(["config=configs/rl_trado_process_reward_with_value.yaml", "dataset.data_type=code"], "rl")
