"""The built-in datasets, by the name a config gives them (``builtin:...``): the kind of rows each holds, how they
are drawn, and the SFT rows made from them. One table: the config check, the RL / eval loaders and the SFT job
all read it.

Every maker takes ``(n, seed)``. SFT rows are the question as the prompt and, as the response, the row's worked
``solution`` when it has one (word problems), else its reference answer boxed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from data.puzzles import SplitTooSmall, countdown_task, sudoku_task
from data.tasks import arithmetic_task, code_task, word_problem_task

__all__ = ["BUILTIN", "BUILTIN_SIZE", "SFT_ANSWER", "builtin_kind", "builtin_tasks", "builtin_sft_rows", "sft_names"]

BUILTIN_SIZE = 64  # tasks in a built-in dataset when the config does not say
SFT_ANSWER = "The answer is \\boxed{{{answer}}}."

# name -> (data type, maker(n, seed)); the ``_test`` names draw the held-out split of the same task.
BUILTIN: dict[str, tuple[str, Callable[..., list[dict]]]] = {
    "builtin:arithmetic": ("math", arithmetic_task),
    "builtin:code": ("code", code_task),
    "builtin:countdown": ("math", countdown_task),
    "builtin:countdown_test": ("math", functools.partial(countdown_task, split="test")),
    "builtin:countdown2": ("math", functools.partial(countdown_task, count=2)),
    "builtin:countdown2_test": ("math", functools.partial(countdown_task, split="test", count=2)),
    "builtin:sudoku": ("math", sudoku_task),
    "builtin:sudoku_test": ("math", functools.partial(sudoku_task, split="test")),
    "builtin:word_problems": ("math", word_problem_task),
    "builtin:word_problems_test": ("math", functools.partial(word_problem_task, split="test")),
}


def builtin_kind(name: str) -> str | None:
    """The data type of a built-in dataset (``math`` / ``code``), None for any other name."""
    entry = BUILTIN.get(name)
    return entry[0] if entry else None


def builtin_tasks(name: str, n: int | None = None, seed: int = 0, difficulty: int | None = None) -> list[dict]:
    """``n`` rows of a built-in dataset (``difficulty`` applies to arithmetic only)."""
    make = BUILTIN[name][1]
    if difficulty is not None and name == "builtin:arithmetic":
        make = functools.partial(make, difficulty=difficulty)
    try:
        return make(n or BUILTIN_SIZE, seed=seed)
    except SplitTooSmall as err:
        raise SplitTooSmall(f"{name}: {err}") from None


def sft_names() -> list[str]:
    """The built-in datasets SFT can train on: the math ones, training splits only."""
    return [name for name, (kind, _) in BUILTIN.items() if kind == "math" and not name.endswith("_test")]


def builtin_sft_rows(name: str, n: int, seed: int, difficulty: int = 1) -> list[dict]:
    """SFT rows (question, response) of a built-in math dataset: the worked solution when the task has one, else
    the reference answer boxed."""
    return [{"question": r["question"],
             "response": r.get("solution") or SFT_ANSWER.format(answer=r["ground_truth_answer"])}
            for r in builtin_tasks(name, n, seed, difficulty)]
