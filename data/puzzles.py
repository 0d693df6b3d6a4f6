"""Built-in puzzles where decoding order and search matter: Countdown and 4x4 Sudoku (the tasks of d1,
arXiv 2504.12216), seeded, with disjoint train / held-out splits.

* Countdown: reach ``target`` with each of ``numbers`` used exactly once and ``+ - * /`` (d1's rule). The target is
  the value of a random expression over the numbers (integer at every step), so every task has a solution; its
  ``ground_truth_answer`` is that expression (one of possibly many: the reward checks any answer, reward/puzzles.py).
* Sudoku 4x4: rows, columns and 2x2 boxes hold 1-4 once each; ``puzzle`` is 16 digits row by row, 0 = empty. Cells
  are emptied while the solution stays unique (checked by a solver), so the answer is the one solution.

Splits: an instance belongs to the held-out split when a hash of its content says so (one in five), so the train
and held-out sets of any seeds never share an instance. ``builtin:countdown`` / ``builtin:sudoku`` draw the train
split, ``builtin:countdown_test`` / ``builtin:sudoku_test`` the held-out one (use those for evaluation).
``builtin:countdown2`` / ``builtin:countdown2_test``: Countdown with two numbers (654 distinct instances, 141 of them
held out), a size at which the tiny CPU demo models learn the task (none of them solves three-number Countdown).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from fractions import Fraction

from data.formats import DataFormatError, validate_rows

HELD_OUT_EVERY = 5  # one instance in five is held out


def in_held_out(key: str) -> bool:
    """Whether an instance (its canonical text) belongs to the held-out split."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


class SplitTooSmall(DataFormatError):
    """More instances asked of a split than it holds."""


EXHAUSTED_AFTER = 20_000  # draws in a row without a new instance: the split holds no more (a small task's)


def draw_split(n: int, seed: int, split: str, name: str, make) -> list[dict]:
    """``n`` distinct instances of ``split`` from ``make(rng)`` -> (key, row)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{name}-{seed}-{split}")
    rows, seen, misses = [], set(), 0
    while len(rows) < n and misses < EXHAUSTED_AFTER:
        key, row = make(rng)
        if key in seen or in_held_out(key) != (split == "test"):
            misses += 1
            continue
        seen.add(key)
        rows.append(row)
        misses = 0
    if len(rows) < n:
        raise SplitTooSmall(f"the {split} split holds {len(rows)} distinct instances, fewer than the {n} asked for: "
                            "lower builtin_size")
    return validate_rows(rows, "math", f"builtin:{name}")


# ------------------------------------------------------------------------------------------ countdown

COUNTDOWN_PROMPT = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
                    "arithmetic operations (+, -, *, /) and each number must be used exactly once. Give the "
                    "equation in \\boxed{{}}.")


def _countdown_instance(rng: random.Random, count: int, high: int) -> tuple[str, dict]:
    while True:
        numbers = [rng.randint(1, high) for _ in range(count)]
        order = numbers[:]
        rng.shuffle(order)
        expr, value = str(order[0]), Fraction(order[0])
        for x in order[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (x == 0 or (value / x).denominator != 1):
                op = "+"
            value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
            expr = f"({expr}) {op} {x}" if op in "*/" and not expr.isdigit() else f"{expr} {op} {x}"
        if value > 0 and value.denominator == 1:
            break
    target = int(value)
    key = f"{sorted(numbers)}={target}"
    return key, {"question": COUNTDOWN_PROMPT.format(numbers=numbers, target=target), "ground_truth_answer": expr,
                 "verifier": "countdown", "numbers": numbers, "target": target}


def countdown_task(n: int, seed: int = 0, split: str = "train", count: int = 3, high: int = 20) -> list[dict]:
    """``n`` Countdown tasks of ``count`` numbers in 1..``high``."""
    return draw_split(n, seed, split, "countdown", lambda rng: _countdown_instance(rng, count, high))


# ------------------------------------------------------------------------------------------ sudoku 4x4

SUDOKU_PROMPT = ("Solve this 4x4 Sudoku: every row, column and 2x2 box must contain 1, 2, 3 and 4 exactly once. "
                 "The grid, row by row (0 = empty):\n{grid}\nGive the 16 digits of the solved grid, row by row, in "
                 "\\boxed{{}}.")
_UNITS = ([[4 * r + c for c in range(4)] for r in range(4)] + [[4 * r + c for r in range(4)] for c in range(4)]
          + [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)])


def sudoku_valid(grid: list[int]) -> bool:
    """A complete 4x4 grid whose rows, columns and boxes hold 1-4 once each."""
    return len(grid) == 16 and all(sorted(grid[i] for i in unit) == [1, 2, 3, 4] for unit in _UNITS)


def sudoku_solutions(puzzle: list[int], limit: int = 2) -> list[list[int]]:
    """Up to ``limit`` completions of ``puzzle`` (0 = empty), by backtracking."""
    grid, out = list(puzzle), []

    def fits(i: int, v: int) -> bool:
        return all(grid[j] != v for unit in _UNITS if i in unit for j in unit)

    def solve() -> None:
        if len(out) >= limit:
            return
        if 0 not in grid:
            out.append(list(grid))
            return
        i = grid.index(0)
        for v in range(1, 5):
            if fits(i, v):
                grid[i] = v
                solve()
                grid[i] = 0

    solve()
    return out


def _sudoku_instance(rng: random.Random, empty: int) -> tuple[str, dict]:
    digits = [1, 2, 3, 4]
    rng.shuffle(digits)
    base = [0, 1, 2, 3, 2, 3, 0, 1, 1, 0, 3, 2, 3, 2, 1, 0]  # a valid pattern, relabelled and permuted below
    rows = [0, 1] if rng.random() < 0.5 else [1, 0]
    rows += [2, 3] if rng.random() < 0.5 else [3, 2]
    if rng.random() < 0.5:
        rows = rows[2:] + rows[:2]
    cols = [0, 1] if rng.random() < 0.5 else [1, 0]
    cols += [2, 3] if rng.random() < 0.5 else [3, 2]
    if rng.random() < 0.5:
        cols = cols[2:] + cols[:2]
    solution = [digits[base[4 * r + c]] for r in rows for c in cols]
    puzzle = list(solution)
    for i in rng.sample(range(16), 16):
        if sum(v == 0 for v in puzzle) >= empty:
            break
        kept, puzzle[i] = puzzle[i], 0
        if len(sudoku_solutions(puzzle)) != 1:
            puzzle[i] = kept
    text = "".join(map(str, puzzle))
    grid = "\n".join(text[4 * r:4 * r + 4] for r in range(4))
    return text, {"question": SUDOKU_PROMPT.format(grid=grid), "ground_truth_answer": "".join(map(str, solution)),
                  "verifier": "sudoku", "puzzle": text}


def sudoku_task(n: int, seed: int = 0, split: str = "train", empty: int = 8) -> list[dict]:
    """``n`` 4x4 Sudoku tasks with up to ``empty`` empty cells (a unique solution each)."""
    return draw_split(n, seed, split, "sudoku", lambda rng: _sudoku_instance(rng, empty))


def countdown_solvable(numbers: list[int], target: int) -> bool:
    """Whether some expression over ``numbers`` (each once, + - * /, any bracketing) reaches ``target``."""
    def values(nums: tuple[Fraction, ...]) -> set[Fraction]:
        if len(nums) == 1:
            return {nums[0]}
        out = set()
        for k in range(1, len(nums)):
            for left in itertools.combinations(range(len(nums)), k):
                a = tuple(nums[i] for i in left)
                b = tuple(nums[i] for i in range(len(nums)) if i not in left)
                for x in values(a):
                    for y in values(b):
                        out |= {x + y, x - y, x * y}
                        if y:
                            out.add(x / y)
        return out

    return Fraction(target) in values(tuple(Fraction(x) for x in numbers))
