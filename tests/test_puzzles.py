"""Countdown and 4x4 Sudoku (data/puzzles.py, reward/puzzles.py): every generated task checked by an independent
solver, any correct answer rewarded, wrong or hostile answers not, held-out splits disjoint, and an RL step on each."""

from __future__ import annotations

import json

import pytest

from data.puzzles import countdown_solvable, countdown_task, in_held_out, sudoku_solutions, sudoku_task
from reward.puzzles import countdown_correct, score_puzzle, sudoku_correct


def boxed(answer: str) -> str:
    return f"Let me think. The answer is \\boxed{{{answer}}}."


def test_countdown_tasks_are_solvable_and_their_reference_answers_score():
    rows = countdown_task(50, seed=3)
    assert len({(tuple(sorted(r["numbers"])), r["target"]) for r in rows}) == 50  # distinct
    for r in rows:
        assert countdown_solvable(r["numbers"], r["target"])  # brute force over every bracketing and operator
        assert score_puzzle(boxed(r["ground_truth_answer"]), r) == 1.0
        assert r["target"] > 0 and len(r["numbers"]) == 3


def test_countdown_accepts_any_correct_equation_and_nothing_else():
    numbers, target = [3, 5, 2], 13
    assert countdown_correct(boxed("3 + 5 * 2"), numbers, target)
    assert countdown_correct(boxed("5 * 2 + 3 = 13"), numbers, target)  # an "= target" tail
    assert countdown_correct(boxed("(2 \\times 5) + 3"), numbers, target)
    assert countdown_correct("the answer is 2 * 5 + 3", numbers, target)
    for latex in ("3 + 5 \\cdot 2", "\\left(2 \\times 5\\right) + 3", "$3 + 5 * 2$", "13 = 3 + {5 * 2}",
                  "3 + 5 × 2"):  # LaTeX forms, and the target on the left
        assert countdown_correct(boxed(latex), numbers, target), latex
    assert not countdown_correct(boxed("13 = 13"), numbers, target)
    assert not countdown_correct(boxed("3 + 5 + 2"), numbers, target)  # 10
    assert not countdown_correct(boxed("5 * 2 + 3 + 0"), numbers, target)  # a number that is not given
    assert not countdown_correct(boxed("5 * 3 - 2"), [3, 5, 2, 2], target)  # a number left out
    assert not countdown_correct(boxed("13"), numbers, target)
    assert not countdown_correct(boxed("3 / (5 - 5) + 2"), [3, 5, 5, 2], target)  # division by zero
    assert not countdown_correct(boxed("__import__('os').getpid()"), numbers, target)  # never evaluated
    assert not countdown_correct("no answer", numbers, target)
    assert countdown_correct(boxed("(5 + 3) / 2"), [5, 3, 2], 4) and not countdown_correct(boxed("5 / 2 + 3"),
                                                                                          [5, 2, 3], 5)


def test_sudoku_tasks_have_one_solution_and_the_checker_is_independent():
    rows = sudoku_task(40, seed=1)
    assert len({r["puzzle"] for r in rows}) == 40
    for r in rows:
        puzzle = [int(c) for c in r["puzzle"]]
        solutions = sudoku_solutions(puzzle, limit=3)
        assert len(solutions) == 1 and "".join(map(str, solutions[0])) == r["ground_truth_answer"]
        assert puzzle.count(0) >= 4
        assert sudoku_correct(boxed(r["ground_truth_answer"]), r["puzzle"])
    r = rows[0]
    gt = r["ground_truth_answer"]
    assert sudoku_correct(boxed(" ".join(gt[i:i + 4] for i in range(0, 16, 4))), r["puzzle"])  # rows spaced
    swapped = gt[1] + gt[0] + gt[2:]
    assert not sudoku_correct(boxed(swapped), r["puzzle"])  # breaks a column
    relabelled = gt.translate(str.maketrans("1234", "2143"))  # a valid grid that changes the givens
    assert not sudoku_correct(boxed(relabelled), r["puzzle"]) and not sudoku_correct(boxed(gt[:15]), r["puzzle"])


def test_held_out_splits_are_disjoint_and_seeded():
    train = countdown_task(100, seed=0) + countdown_task(100, seed=1)
    test = countdown_task(40, seed=0, split="test") + countdown_task(40, seed=7, split="test")
    key = lambda r: f"{sorted(r['numbers'])}={r['target']}"  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert all(in_held_out(key(r)) for r in test) and not any(in_held_out(key(r)) for r in train)
    sud_train, sud_test = sudoku_task(50, seed=0), sudoku_task(20, seed=0, split="test")
    assert not {r["puzzle"] for r in sud_train} & {r["puzzle"] for r in sud_test}
    assert countdown_task(5, seed=4) == countdown_task(5, seed=4) and countdown_task(5, seed=4) != countdown_task(
        5, seed=5)


def test_asking_a_split_for_more_than_it_holds_is_a_one_line_error():
    from data.builtin import builtin_tasks
    from data.formats import DataFormatError

    assert len(builtin_tasks("builtin:countdown2", 513)) == 513  # every two-number training instance
    with pytest.raises(DataFormatError, match=r"^builtin:countdown2_test: the test split holds 141 distinct instances, "
                                              r"fewer than the 142 asked for: lower builtin_size$"):
        builtin_tasks("builtin:countdown2_test", 142)


@pytest.mark.parametrize("task", ["countdown", "sudoku"])
def test_an_rl_step_on_a_puzzle_scores_with_its_verifier(tmp_path, demo_tokenizer, task, monkeypatch):
    """One training response is given its task's answer: the verifier passes it and the score lands on that sample
    only; a random model solves nothing else (nor any held-out puzzle)."""
    from jobs.config import load_config
    from jobs.rl import run_rl
    from models.tiny import save_tiny_checkpoint
    from tests.test_rl import answer_one_right, assert_only_that_sample_scores, demo_args

    answered = answer_one_right(monkeypatch, lambda row: f"\\boxed{{{row['ground_truth_answer']}}}", rollout_size=4)

    model = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    cfg = load_config(demo_args(tmp_path, model, **{
        "experiment.total_step": 1, "dataset.train_dataset": f"builtin:{task}",
        "evaluation.eval_dataset": f"builtin:{task}_test", "experiment.eval_every": 1,
        "reward.filter_all_equal": "false", "rollout.num_task_per_step": 2, "rollout.num_response_per_task": 2,
        "training.max_prompt_len": 512, "evaluation.max_token": 16, "rollout.max_token": 16}), "rl")
    history = run_rl(cfg, progress=False)
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "step_1" / "rollouts.jsonl").read_text().splitlines()]
    assert_only_that_sample_scores(rollouts, answered)
    assert history[-1]["eval_acc"] == 0.0


def test_sft_rows_of_the_puzzles_box_the_reference_answer():
    from jobs.sft import builtin_rows

    rows = builtin_rows("builtin:countdown", 3, seed=0, difficulty=1)
    tasks = countdown_task(3, seed=0)
    assert [r["question"] for r in rows] == [t["question"] for t in tasks]
    assert all(score_puzzle(r["response"], t) == 1.0 for r, t in zip(rows, tasks, strict=True))
