"""Rewards of the built-in puzzles (data/puzzles.py): any correct answer scores 1, not only the reference one.

* Countdown: the answer (``\\boxed{}``, or after "the answer is") is an expression of integers, ``+ - * /`` and
  brackets (``= target`` on either side allowed; LaTeX's ``\\times``, ``\\cdot``, ``\\div``, ``\\left(`` and ``$``
  read as plain arithmetic) that uses exactly the task's numbers, each once, and equals the target
  in exact rational arithmetic (d1's check, arXiv 2504.12216).
* Sudoku 4x4: the answer's digits form a complete valid grid that keeps every given of the puzzle.
Parsing never evaluates code: the expression is walked as a Python AST restricted to those nodes. The checks are
written apart from the generators, so that tests can verify one with the other.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from reward.math import extract_answer

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}
MAX_EXPRESSION_CHARS = 200


def _value_and_numbers(node: ast.AST) -> tuple[Fraction, list[int]]:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return Fraction(node.value), [node.value]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        (a, na), (b, nb) = _value_and_numbers(node.left), _value_and_numbers(node.right)
        return _BINOPS[type(node.op)](a, b), na + nb
    raise ValueError("not a countdown expression")


def countdown_correct(text: str, numbers: list[int], target: int) -> bool:
    answer = extract_answer(text)
    if answer is None or len(answer) > MAX_EXPRESSION_CHARS:
        return False
    # "= target" on either side: the side that is not just the target is the expression
    sides = [side.strip() for side in _plain_expression(answer).split("=")]
    if len(sides) > 1 and sides[0] == str(target):
        sides = sides[1:]
    try:
        value, used = _value_and_numbers(ast.parse(sides[0], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return False
    return sorted(used) == sorted(numbers) and value == target


def _plain_expression(answer: str) -> str:
    """The answer's LaTeX written as plain arithmetic: \\times, \\cdot, × -> *; \\div, ÷ -> /; \\left( -> (; no
    $ or spacing commands; LaTeX groups {} as brackets."""
    expr = answer
    for latex, plain in (("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("\\div", "/"), ("÷", "/"),
                         ("\\left", ""), ("\\right", ""), ("\\,", " "), ("\\;", " "), ("\\!", ""), ("$", ""),
                         ("{", "("), ("}", ")")):
        expr = expr.replace(latex, plain)
    return expr


def _grid_valid(grid: list[int]) -> bool:
    """Rows, columns and 2x2 boxes of a 4x4 grid each hold 1, 2, 3, 4."""
    rows = [grid[4 * r:4 * r + 4] for r in range(4)]
    cols = [grid[c::4] for c in range(4)]
    boxes = [[grid[4 * (r0 + r) + c0 + c] for r in (0, 1) for c in (0, 1)] for r0 in (0, 2) for c0 in (0, 2)]
    return all(sorted(unit) == [1, 2, 3, 4] for unit in rows + cols + boxes)


def sudoku_correct(text: str, puzzle: str) -> bool:
    answer = extract_answer(text)
    digits = re.sub(r"\D", "", answer or "")
    if len(digits) != 16:
        return False
    grid = [int(c) for c in digits]
    return _grid_valid(grid) and all(p == "0" or int(p) == g for p, g in zip(puzzle, grid, strict=True))


def score_puzzle(text: str, row: dict) -> float:
    """1.0 when ``text`` answers the puzzle ``row`` correctly (its ``verifier`` names the kind), else 0.0."""
    if row["verifier"] == "countdown":
        return float(countdown_correct(text, row["numbers"], row["target"]))
    if row["verifier"] == "sudoku":
        return float(sudoku_correct(text, row["puzzle"]))
    raise ValueError(f"unknown verifier {row['verifier']!r}")
