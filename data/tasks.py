"""Built-in synthetic tasks that need no download, deterministic by seed, in the dataset formats of README.md.
Written as dataset files by ``python -m tools.write_tasks`` (e.g. ``--task arithmetic --n 100 --out data/arith.json``).

Arithmetic rows are math rows (answer expected in ``\\boxed{}``); code rows are function tasks (asserts on
``f``, with ``prefix = "def f(x):\\n"``) and stdio tasks. Every code row also carries a reference
``solution`` that passes its tests.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

from data.formats import validate_rows
from data.puzzles import draw_split

__all__ = ["arithmetic_task", "word_problem_task", "code_task", "evaluate_expression"]

_OPS: dict[type, Callable[[int, int], int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


# ---------------------------------------------------------------------------------------------- arithmetic
def evaluate_expression(expr: str) -> int:
    """Value of an integer expression with + - * and parentheses (no eval of arbitrary code)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")

    return walk(ast.parse(expr, mode="eval"))


def _expression(rng: random.Random, operands: int, digits: int, ops: str) -> str:
    """Random expression such as ``12 + 7 * 3`` or ``(4 - 9) * 5``."""
    hi = 10**digits - 1
    terms = [str(rng.randint(1, hi))]
    for _ in range(operands - 1):
        op = rng.choice(ops)
        term = str(rng.randint(1, hi))
        if len(terms) > 1 and rng.random() < 0.25:  # occasionally parenthesise what came before
            terms = [f"({' '.join(terms)})"]
        terms += [op, term]
    return " ".join(terms)


def arithmetic_task(
    n: int, seed: int = 0, difficulty: int = 1, operands: int | None = None, digits: int | None = None
) -> list[dict]:
    """``n`` arithmetic questions; ``difficulty`` d sets d+1 operands of up to 1+(d-1)//2 digits, with
    multiplication from d >= 2 (``operands``/``digits`` override)."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    operands = operands or difficulty + 1
    digits = digits or 1 + (difficulty - 1) // 2
    ops = "+-*" if difficulty >= 2 else "+-"
    rng = random.Random(f"arithmetic-{seed}-{difficulty}-{operands}-{digits}")
    rows = []
    for _ in range(n):
        expr = _expression(rng, operands, digits, ops)
        rows.append({
            "question": f"Compute {expr}. Give the final answer in \\boxed{{}}.",
            "ground_truth_answer": str(evaluate_expression(expr)),
            "expression": expr,
        })
    return validate_rows(rows, "math", "arithmetic_task")


# --------------------------------------------------------------------------------------- word problems
# One sentence of story each, with the operation the story implies: (text, op). Names and items vary; the
# numbers are two-digit, and a subtraction never goes below zero.
_STORIES = [
    ("{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?", "+"),
    ("{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?", "-"),
    ("There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?", "+"),
    ("There were {a} {item} on the table. {name} took {b} of them. How many {item} are on the table now?", "-"),
    ("{name} collected {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} collect in "
     "total?", "+"),
    ("A shop had {a} {item}. It sold {b} of them. How many {item} does the shop have left?", "-"),
]
_NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Emma", "Max", "Zoe"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cards", "shells", "coins"]
WORD_PROBLEM_SUFFIX = " Give the final answer in \\boxed{}."


def _word_problem(rng: random.Random) -> tuple[str, dict]:
    story, op = rng.choice(_STORIES)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and a < b:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    question = story.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
    return question, {"question": question + WORD_PROBLEM_SUFFIX, "ground_truth_answer": str(answer),
                      "solution": f"{a} {op} {b} = {answer}. The answer is \\boxed{{{answer}}}."}


def word_problem_task(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` distinct two-digit addition / subtraction word problems of ``split`` (a content hash holds one in five
    out, as for the puzzles). Each row carries a worked ``solution`` (the equation, then the boxed answer): the SFT
    target of the built-in recipe."""
    return draw_split(n, seed, split, "word_problems", _word_problem)


# ---------------------------------------------------------------------------------------------------- code
@dataclass(frozen=True)
class _FunctionTemplate:
    """A family of function tasks: statement, reference implementation, solution source, argument maker."""

    statement: Callable[[int], str]
    reference: Callable[[int, object], object]
    body: Callable[[int], str]
    argument: Callable[[random.Random, int], object]


def _int_arg(rng: random.Random, _a: int = 0) -> int:
    return rng.randint(0, 999)


def _multiple_arg(rng: random.Random, a: int) -> int:
    """Half of the arguments are multiples of ``a``, so constant answers fail."""
    return a * rng.randint(0, 99) + (0 if rng.random() < 0.5 else rng.randint(1, a - 1))


def _list_arg(rng: random.Random, _a: int = 0) -> list[int]:
    return [rng.randint(-20, 40) for _ in range(rng.randint(1, 6))]


def _word_arg(rng: random.Random, _a: int = 0) -> str:
    return " ".join(rng.choice(["red", "blue", "cat", "sun", "tree", "sky"]) for _ in range(rng.randint(1, 4)))


_FUNCTIONS = [
    _FunctionTemplate(lambda a: f"returns x * {a} + {a + 1}, where x is an integer",
                      lambda a, x: x * a + a + 1, lambda a: f"return x * {a} + {a + 1}", _int_arg),
    _FunctionTemplate(lambda a: f"returns the sum of the decimal digits of the non-negative integer x, plus {a}",
                      lambda a, x: sum(map(int, str(x))) + a, lambda a: f"return sum(int(d) for d in str(x)) + {a}",
                      _int_arg),
    _FunctionTemplate(lambda a: f"returns how many integers in the list x are divisible by {a}",
                      lambda a, x: sum(v % a == 0 for v in x), lambda a: f"return sum(v % {a} == 0 for v in x)",
                      _list_arg),
    _FunctionTemplate(lambda a: f"returns the largest integer of the non-empty list x minus the smallest, plus {a}",
                      lambda a, x: max(x) - min(x) + a, lambda a: f"return max(x) - min(x) + {a}", _list_arg),
    _FunctionTemplate(lambda a: f"returns the words of the string x in reverse order joined by '{'-' * a}'",
                      lambda a, x: ("-" * a).join(reversed(x.split())),
                      lambda a: f"return {'-' * a!r}.join(reversed(x.split()))", _word_arg),
    _FunctionTemplate(lambda a: f"returns True if the integer x is divisible by {a}, else False",
                      lambda a, x: x % a == 0, lambda a: f"return x % {a} == 0", _multiple_arg),
]


@dataclass(frozen=True)
class _StdioTemplate:
    """A family of stdio tasks: statement, input maker, reference output, solution source."""

    statement: Callable[[int], str]
    make_input: Callable[[random.Random], str]
    reference: Callable[[int, str], str]
    solution: Callable[[int], str]


_STDIO = [
    _StdioTemplate(lambda a: f"Read an integer n from standard input and print n * {a} - 1.",
                   lambda rng: f"{rng.randint(-50, 50)}\n", lambda a, s: str(int(s) * a - 1),
                   lambda a: f"n = int(input())\nprint(n * {a} - 1)\n"),
    _StdioTemplate(lambda a: f"Read two integers separated by a space and print their sum multiplied by {a}.",
                   lambda rng: f"{rng.randint(0, 99)} {rng.randint(0, 99)}\n",
                   lambda a, s: str(sum(map(int, s.split())) * a),
                   lambda a: f"a, b = map(int, input().split())\nprint((a + b) * {a})\n"),
    _StdioTemplate(lambda a: f"Read a line of text and print it reversed, {a} time(s), one per line.",
                   lambda rng: _word_arg(rng) + "\n", lambda a, s: "\n".join([s.strip()[::-1]] * a),
                   lambda a: f"s = input().strip()\nfor _ in range({a}):\n    print(s[::-1])\n"),
    _StdioTemplate(lambda a: f"Read an integer n, then n integers on the next line; print their maximum plus {a}.",
                   lambda rng: _numbers_input(rng), lambda a, s: str(max(map(int, s.split()[1:])) + a),
                   lambda a: f"n = int(input())\nvals = list(map(int, input().split()))\nprint(max(vals) + {a})\n"),
]


def _numbers_input(rng: random.Random) -> str:
    vals = [rng.randint(-100, 100) for _ in range(rng.randint(1, 6))]
    return f"{len(vals)}\n{' '.join(map(str, vals))}\n"


def _function_row(rng: random.Random) -> dict:
    tpl = rng.choice(_FUNCTIONS)
    a = rng.randint(2, 9)
    args = [tpl.argument(rng, a) for _ in range(4)]
    return {
        "question": f"Write a Python function f(x) that {tpl.statement(a)}.",
        "test_method": "function",
        "test_time_limit": 1,
        "prefix": "def f(x):\n",
        "test_list": [f"assert f({x!r}) == {tpl.reference(a, x)!r}" for x in args],
        "solution": f"def f(x):\n    {tpl.body(a)}\n",
    }


def _stdio_row(rng: random.Random) -> dict:
    tpl = rng.choice(_STDIO)
    a = rng.randint(2, 4)
    inputs = [tpl.make_input(rng) for _ in range(3)]
    return {
        "question": tpl.statement(a),
        "test_method": "stdio",
        "test_time_limit": 1,
        "test_input": inputs,
        "test_output": [tpl.reference(a, s) + "\n" for s in inputs],
        "solution": tpl.solution(a),
    }


def code_task(n: int, seed: int = 0, stdio_fraction: float = 0.25) -> list[dict]:
    """``n`` small code tasks (function tasks with asserts, and a ``stdio_fraction`` of stdio tasks)."""
    rng = random.Random(f"code-{seed}")
    rows = [_stdio_row(rng) if rng.random() < stdio_fraction else _function_row(rng) for _ in range(n)]
    return validate_rows(rows, "code", "code_task")
