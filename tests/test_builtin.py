"""The built-in dataset table (data/builtin.py) and the two-digit word problems of the real-weights recipe."""

import re

import pytest

from data.builtin import BUILTIN, builtin_kind, builtin_sft_rows, builtin_tasks, sft_names
from data.tasks import word_problem_task
from reward.math import score_math

_TAKE = re.compile(r"gave|took|sold")  # the stories whose operation is a subtraction


def test_word_problems_are_two_digit_and_their_answers_follow_the_story():
    rows = word_problem_task(300, seed=0)
    assert len({r["question"] for r in rows}) == 300
    for r in rows:
        a, b = (int(x) for x in re.findall(r"\d+", r["question"]))
        assert 10 <= a <= 99 and 10 <= b <= 99
        expected = a - b if _TAKE.search(r["question"]) else a + b  # computed from the text, not the generator
        assert expected >= 0 and r["ground_truth_answer"] == str(expected)
        assert r["question"].endswith("Give the final answer in \\boxed{}.")
        assert score_math(r["solution"], r["ground_truth_answer"]) == 1.0
        assert r["solution"].startswith(f"{a} {'-' if _TAKE.search(r['question']) else '+'} {b} = {expected}.")
    assert word_problem_task(5, seed=0) == rows[:5]  # deterministic by seed
    assert word_problem_task(5, seed=1) != rows[:5]


def test_word_problem_splits_never_share_a_problem():
    train = {r["question"] for r in word_problem_task(2000, seed=0)}
    held_out = {r["question"] for r in word_problem_task(400, seed=2, split="test")}
    assert len(held_out) == 400 and not train & held_out


def test_every_builtin_draws_rows_of_its_kind():
    for name, (kind, _) in BUILTIN.items():
        rows = builtin_tasks(name, 3, seed=0)
        assert len(rows) == 3 and builtin_kind(name) == kind
        assert all(("test_method" in r) == (kind == "code") for r in rows), name
    assert builtin_kind("builtin:nope") is None and builtin_kind("data/x.json") is None


def test_sft_rows_use_the_worked_solution_and_only_training_splits():
    rows = builtin_sft_rows("builtin:word_problems", 4, seed=0)
    tasks = word_problem_task(4, seed=0)
    assert [r["response"] for r in rows] == [t["solution"] for t in tasks]
    arithmetic = builtin_sft_rows("builtin:arithmetic", 2, seed=0, difficulty=2)
    answer = builtin_tasks("builtin:arithmetic", 2, 0, 2)[0]["ground_truth_answer"]
    assert arithmetic[0]["response"] == f"The answer is \\boxed{{{answer}}}."
    assert "builtin:word_problems" in sft_names()
    assert not any(n.endswith("_test") or n == "builtin:code" for n in sft_names())
    from data.formats import DataFormatError
    from jobs.sft import builtin_rows

    with pytest.raises(DataFormatError, match="unknown built-in SFT dataset 'builtin:word_problems_test'"):
        builtin_rows("builtin:word_problems_test", 2, seed=0, difficulty=1)


def test_configs_take_the_builtin_size():
    from jobs.config import load_config

    cfg = load_config(["config=configs/real/eval_smollm2.yaml", "dataset.builtin_size=7"], "eval")
    assert cfg.dataset.builtin_size == 7 and cfg.dataset.eval_dataset == "builtin:word_problems_test"
    rl = load_config(["config=configs/real/rl_smollm2.yaml"], "rl")
    assert rl.dataset.builtin_size == 1000 and rl.evaluation.builtin_size == 128
    from jobs.config import ConfigError

    with pytest.raises(ConfigError, match="dataset.builtin_size.*built-in datasets only, not to 'MATH500'"):
        load_config(["config=configs/real/eval_smollm2.yaml", "dataset.eval_dataset=MATH500",
                     "dataset.builtin_size=5"], "eval")
    with pytest.raises(ConfigError, match="evaluation.builtin_size.*built-in datasets only"):
        load_config(["config=configs/real/rl_smollm2.yaml", "evaluation.eval_dataset=MATH500"], "rl")
    from jobs.rollout import load_tasks

    assert len(load_tasks("builtin:word_problems", "math", seed=1, n_builtin=9)) == 9
    with pytest.raises(ValueError, match="is a math task but data_type is 'code'"):
        load_tasks("builtin:word_problems", "code")


def test_a_dataset_name_like_nothing_lists_every_choice_and_how_to_download(tmp_path):
    from jobs.rollout import load_tasks

    with pytest.raises(FileNotFoundError) as missing:
        load_tasks("zzzqqq", "math", data_dir=tmp_path)
    message = str(missing.value)
    assert "builtin:word_problems_test" in message and "MATH500" in message
    assert "downloadable (python -m tools.download_data --dataset NAME): " in message
