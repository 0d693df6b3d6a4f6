"""The eval entry point end to end on the CPU demo config, and per-sample scoring."""

from __future__ import annotations

import json
import re

import pytest

import eval as eval_entry
from data.tasks import arithmetic_task, code_task
from jobs.rollout import score_rollout
from models.tiny import save_tiny_checkpoint
from sample.generate import Rollout, RolloutStats
from sample.trajectory import Trajectory, read_jsonl


def test_eval_demo_runs_end_to_end(tmp_path, capsys, demo_tokenizer, monkeypatch):
    """The demo eval end to end; one response (task 0's second) is given its task's answer: the score lands on that
    sample only, and the metrics count it once (a random model answers nothing else)."""
    from tests.test_rl import answer_one_right

    answered = answer_one_right(monkeypatch, lambda row: f"\\boxed{{{row['ground_truth_answer']}}}", rollout_size=128)
    out = tmp_path / "runs"
    save_tiny_checkpoint(tmp_path / "tiny", "sdar", demo_tokenizer, size="demo")
    rc = eval_entry.main(["config=configs/demo/eval_demo.yaml", f"experiment.output_dir={out}",
                          f"model.pretrained_model={tmp_path / 'tiny'}", "rollout.max_token=8",
                          "rollout.num_response_per_task=2", "rollout.pass_k=[1,2]", "experiment.seed=1"])
    assert rc == 0
    run = out / "eval_demo"
    metrics = json.loads((run / "results.jsonl").read_text().splitlines()[-1])
    assert (run / "config.yaml").is_file() and not (out / "eval_demo.partial").exists()
    trajs = list(read_jsonl(run / "trajectories-builtin_arithmetic.jsonl"))
    assert metrics["tasks"] == 64 and metrics["responses"] == len(trajs) == 128
    assert [t.sample_id for t in trajs[:4]] == ["0-0", "0-1", "1-0", "1-1"]
    assert all(len(t.response_ids) <= 8 and t.block_size == 4 for t in trajs)
    for t in trajs:  # steps start at 1 and are global: every step of a block is after all steps of earlier blocks
        blocks: dict[int, list[int]] = {}
        for i, step in enumerate(t.step_map + t.tail_steps):
            blocks.setdefault((len(t.prompt_ids) + i) // 4, []).append(step)
        spans = [(min(v), max(v)) for _, v in sorted(blocks.items())]
        assert spans[0][0] >= 1 and all(prev[1] < nxt[0] for prev, nxt in zip(spans, spans[1:]))
    (lucky,) = answered
    assert lucky.sample_id == "0-1" and lucky.text.startswith("\\boxed{")
    assert [(t.sample_id, t.score) for t in trajs] == [(t.sample_id, float(t.sample_id == "0-1")) for t in trajs]
    assert metrics["acc"] == pytest.approx(1 / 128)
    assert (metrics["pass@1"], metrics["pass@2"]) == pytest.approx((0.5 / 64, 1 / 64))  # one of task 0's two
    per_row = [len(t.step_map) / len(set(t.step_map)) for t in trajs if t.step_map]  # tokens per denoising step
    assert metrics["tokens_per_step"] == pytest.approx(sum(per_row) / len(per_row))
    assert 1.0 <= metrics["tokens_per_step"] <= 4.0  # at most a block of 4 per step, whatever the batch
    assert "<html" in (run / "trace-builtin_arithmetic.html").read_text().lower()
    assert "acc" in capsys.readouterr().out


def _with_positions(folder, positions: int):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return folder


def test_an_rl_runs_evaluation_prompts_are_checked_at_its_start(tmp_path, demo_tokenizer):
    """An RL run whose evaluation settings leave its eval prompts no room stops at its start (a resumed run would
    otherwise stop at its first evaluation, steps in): here a full-attention model of 128 positions whose evaluation
    canvas (96 tokens) leaves 32 to prompts of 61 tokens, where the training rollouts' 8 leave room."""
    from jobs.config import load_config
    from jobs.rl import run_rl
    from sample.engine import PromptTooLongError
    from tests.test_rl import demo_args

    model = _with_positions(save_tiny_checkpoint(tmp_path / "dream", "dream", demo_tokenizer, size="test"), 128)
    over = {"experiment.eval_every": 1, "evaluation.eval_dataset": "builtin:arithmetic", "evaluation.block_size": 8}
    cfg = load_config(demo_args(tmp_path, model, base="dream", **over, **{"evaluation.max_token": 96}), "rl")
    with pytest.raises(PromptTooLongError, match=r"^\d+ of \d+ prompts of builtin:arithmetic \(up to \d+ tokens\) do "
                                                 r"not fit the model's positions \(128, less a response canvas of 96 "
                                                 r"\(evaluation.max_tokens in whole blocks\): prompts up to 32 "
                                                 r"tokens\): lower evaluation.max_tokens or drop those rows$"):
        run_rl(cfg, progress=False)
    assert not list((tmp_path / "run").glob("step_*"))
    cfg = load_config(demo_args(tmp_path, model, base="dream", **over, **{"evaluation.max_token": 124}), "rl")
    with pytest.raises(PromptTooLongError, match=r"^evaluation.max_tokens \(124\) leaves no room for a prompt below "
                                                 r"the model's 128 positions$"):  # 124 in blocks of 8: 128
        run_rl(cfg, progress=False)


def test_eval_missing_checkpoint_is_one_line(tmp_path, capsys):
    rc = eval_entry.main(["config=configs/trado_eval.yaml", f"model.pretrained_model={tmp_path / 'nope'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "is not a folder with a config.json" in err


def test_a_full_disk_while_writing_an_eval_is_one_line_with_its_scores(tmp_path, capsys, demo_tokenizer,
                                                                         monkeypatch):
    """The scores are computed before the files are written: a full disk then gives them in its one-line error,
    and leaves no half-written trajectories file taking the space."""
    import errno

    import sample.trajectory

    real_dumps, written = sample.trajectory.json.dumps, []

    def dumps_until_the_disk_is_full(obj, **kwargs):  # json.dumps is the json module's: count trajectory rows only
        if isinstance(obj, dict) and "response_ids" in obj:
            if len(written) == 5:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(obj)
        return real_dumps(obj, **kwargs)

    monkeypatch.setattr(sample.trajectory.json, "dumps", dumps_until_the_disk_is_full)
    save_tiny_checkpoint(tmp_path / "tiny", "sdar", demo_tokenizer, size="demo")
    capsys.readouterr()
    out = tmp_path / "runs"
    rc = eval_entry.main(["config=configs/demo/eval_demo.yaml", f"experiment.output_dir={out}",
                          f"model.pretrained_model={tmp_path / 'tiny'}", "rollout.max_token=8",
                          "dataset.builtin_size=8", "experiment.seed=1"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert rc == 2 and len(err) == 1
    assert re.fullmatch(rf"error: no space left on the device while writing {re.escape(str(out))}/eval_demo\.partial; "
                        r"not saved: acc \d\.\d{3} \(low_confidence_dynamic, top_k 0, block 4\) on "
                        r"builtin:arithmetic", err[0])
    assert len(written) == 5  # the disk filled while the trajectories were written
    assert sorted(p.name for p in (out / "eval_demo.partial").iterdir()) == [".lock", "INTERRUPTED"]


def _rollout(texts: list[str]) -> Rollout:
    trajs = [Trajectory(prompt_ids=[1], response_ids=[5, 6], step_map=[1, 2], logprobs=[0.0, 0.0], text=t,
                        sample_id=f"{i // 2}-{i % 2}", task_index=i // 2) for i, t in enumerate(texts)]
    return Rollout(trajs, RolloutStats(0, 0, 0, 1.0))


def test_math_scores_stay_attached_to_their_samples():
    tasks = arithmetic_task(2, seed=3)
    a0, a1 = tasks[0]["ground_truth_answer"], tasks[1]["ground_truth_answer"]
    texts = [f"\\boxed{{{a0}}}", "no answer", "\\boxed{-123456789}", f"so \\boxed{{{a1}}}"]
    assert score_rollout(_rollout(texts), tasks, "math") == [1.0, 0.0, 0.0, 1.0]


def test_code_scores_are_pass_fractions_per_sample():
    tasks = [t for t in code_task(6, seed=0) if t["test_method"] == "function"][:1]
    fence = "`" * 3
    good = f"{fence}python\n{tasks[0]['solution']}\n{fence}"
    texts = [good, f"{fence}python\nimport sys\nsys.exit(0)\n{fence}"]
    scores = score_rollout(_rollout(texts), tasks, "code")
    assert scores == [1.0, 0.0]


@pytest.mark.parametrize("reason", ["eos", "stop", "length"])
def test_a_response_is_scored_without_the_token_that_stopped_it(demo_tokenizer, reason):
    from types import SimpleNamespace

    from sample.engine import Finished, trajectory

    tok = demo_tokenizer
    end = tok.eos_token_id
    math = tok.encode("So the answer is \\frac{1}{2}", add_special_tokens=False) + [end]
    task = next(t for t in code_task(6, seed=0) if t["test_method"] == "function")
    body = task["solution"].split("\n", 1)[1]  # the model continues the prompt's `def ...:` line, no fence
    code = tok.encode(body, add_special_tokens=False) + [end]
    trajs = [trajectory(Finished(SimpleNamespace(prompt=[1], index=i), ids, list(range(1, len(ids) + 1)),
                                 [0.0] * len(ids), [], reason, 4), tok) for i, ids in enumerate((math, code))]
    stopped = reason != "length"  # a row cut at max_tokens keeps its last token: it stopped nothing
    assert trajs[0].text == "So the answer is \\frac{1}{2}" + ("" if stopped else tok.eos_token)
    assert trajs[0].response_ids == math  # the ids keep it: training sees the stop token
    for t in trajs:
        t.task_index = 0
    assert score_rollout([trajs[0]], [{"ground_truth_answer": "\\frac{1}{2}"}], "math") == [float(stopped)]
    assert score_rollout([trajs[1]], [{**task, "prefix": task["solution"].split("\n", 1)[0] + "\n"}],
                         "code") == [float(stopped)]


def test_puzzle_rows_keep_their_verifier_beside_plain_math_rows():
    # a hand-mixed file: a countdown row answered by another right equation, and a plain arithmetic row
    from data.puzzles import countdown_task

    puzzle, plain = countdown_task(1, seed=0)[0], arithmetic_task(1, seed=3)[0]
    assert puzzle["ground_truth_answer"] == "1 * 20 + 4"
    # "20 + 4" equals the target but leaves out the 1: a string or math check would accept it, the verifier does not
    texts = ["\\boxed{20 + 4 * 1}", "\\boxed{20 + 4}", f"\\boxed{{{plain['ground_truth_answer']}}}", "\\boxed{0}"]
    assert score_rollout(_rollout(texts), [puzzle, plain], "math") == [1.0, 0.0, 1.0, 0.0]


def test_code_responses_within_the_truncation_margin_score_zero_and_are_not_run(monkeypatch):
    import jobs.rollout

    tasks = [t for t in code_task(6, seed=0) if t["test_method"] == "function"][:1]
    good = f"{'`' * 3}python\n{tasks[0]['solution']}\n{'`' * 3}"
    rollout = _rollout([good, good])
    rollout[1].response_ids = [5] * 96  # 96 >= 100 - 5: cut off by the length limit, however good its code
    ran = []
    real = jobs.rollout.run_many
    monkeypatch.setattr(jobs.rollout, "run_many", lambda jobs, **kw: ran.append(len(jobs)) or real(jobs, **kw))
    assert score_rollout(rollout, tasks, "code", max_tokens=100, truncation_margin=5) == [1.0, 0.0]
    assert ran == [1] and [t.meta.get("truncated") for t in rollout] == [None, True]
    assert score_rollout(_rollout([good, good]), tasks, "code") == [1.0, 1.0]  # eval: no margin


def test_a_broken_sandbox_marks_its_samples_and_stops_the_job_past_half(monkeypatch):
    from jobs.rollout import check_sandbox_failures, unscored_count
    from reward import sandbox

    tasks = [t for t in code_task(6, seed=0) if t["test_method"] == "function"][:1]
    good = f"{'`' * 3}python\n{tasks[0]['solution']}\n{'`' * 3}"
    original = sandbox._spec  # the supervisor cannot read its spec: a setup failure, not the program's
    monkeypatch.setattr(sandbox, "_spec", lambda *args: {**original(*args), "time_limit": "not-a-number"})
    broken = _rollout([good, good])
    assert score_rollout(broken, tasks, "code") == [0.0, 0.0]
    assert unscored_count(broken) == 2 and all(t.meta["sandbox_error"] for t in broken)
    monkeypatch.setattr(sandbox, "_spec", original)
    fine = _rollout([good, good, good])
    assert score_rollout(fine, tasks * 2, "code") == [1.0, 1.0, 1.0] and unscored_count(fine) == 0
    check_sandbox_failures([*fine, broken[0]])  # one of four: its sample is left to the caller
    with pytest.raises(sandbox.SandboxFailure, match=r"failed to run 2 of 3 programs") as err:
        check_sandbox_failures([*broken, fine[0]])
    assert "\n" not in str(err.value)
    for t in fine[1:]:  # two of four, yet both programs it was given: truncated responses are never run
        t.meta["truncated"] = True
    with pytest.raises(sandbox.SandboxFailure, match=r"failed to run 2 of 2 programs"):
        check_sandbox_failures([*broken, *fine[1:]])


def test_the_summary_table_says_how_many_programs_the_sandbox_failed_to_run():
    from jobs.evaluate import summary_table

    result = {"setting": {"remasking_strategy": "low_confidence_static", "top_k": 0, "block_size": 4}, "acc": 0.25,
              "avg_length": 9.0, "tokens_per_step": 1.5, "sampling": {"tokens_per_second": 10.0}, "responses": 8}
    assert "note" not in summary_table([{**result, "sandbox_errors": 0}])
    lines = summary_table([{**result, "sandbox_errors": 3}]).splitlines()
    assert len(lines) == 3 and "0.250" in lines[1] and "failed to run 3 of 8 programs" in lines[2]
