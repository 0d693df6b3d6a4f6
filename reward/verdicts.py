"""Test verdicts decided outside the program's process: what the sandboxed child is asked to run, and the check the
caller applies to what comes back.

A program under RL is optimised against its reward, so a verdict the program can influence becomes its behaviour.
A child process that computes ``add(1, 2) == 3`` itself can be fooled by an ``add`` that returns an object whose
``__eq__`` is always true, or by code that walks interpreter frames to the verdict. So for the usual test shapes the
expected value never enters the sandbox (neither the child nor its supervisor):

* ``assert <expr> == <literal>`` (either side; also ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``is None/True/False``,
  ``assert <expr>``, ``assert not <expr>``, ``math.isclose(<expr>, <literal>, ...)``, ``abs(<expr> - <literal>) <
  <literal>`` either way round), with optional setup statements before the assert: the child evaluates only
  ``<expr>`` and returns its value through a strict encoder (builtin types; a subclass of one, such as a namedtuple,
  as the builtin value it holds, read without running its methods; numpy's scalars as their ``item()``; other
  objects are refused) and the caller compares the decoded value itself.
* stdin/stdout tests: the child gets the input; its whitespace-normalised output, cut to the expected length + 1,
  comes back and the caller compares.
* Any other shape runs in the child with every comparison (chains too; ``is`` keeps its identity) rewritten
  (``ast``) into one decided on builtin copies of its operands, so no ``__eq__`` or ``__lt__`` of the program runs.

What remains possible: a program that computes the right value passes (that is solving the task); tests of the
last kind run inside the program's process, so a program that rewrites the interpreter's internals (frames, the
encoder's globals) before the test runs can still forge those.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any

__all__ = ["Check", "plan_tests", "judge", "decode_value", "normalize_output"]


@dataclass(frozen=True)
class Check:
    """How the caller decides a test from the child's outcome.

    kind: ``value`` (compare a returned value), ``stdout`` (compare output) or ``ran`` (the rewritten statement ran
    without failing: its strict comparisons were decided in the child)."""

    kind: str
    op: str = "eq"  # value: eq | ne | lt | le | gt | ge | is | truthy | falsy | isclose | absdiff
    expected: Any = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    strict_lt: bool = True  # absdiff: < (True) or <=


def normalize_output(text: str) -> str:
    return " ".join(text.split())


def plan_tests(tests: list[dict]) -> list[tuple[dict, Check]]:
    """(what the child runs, how the caller checks it) for each test of ``CodeJob.tests()``."""
    out = []
    for test in tests:
        if "input" in test:
            expected = normalize_output(test["output"])
            out.append(({"kind": "stdio", "input": test["input"], "keep": len(expected) + 1},
                        Check("stdout", expected=expected)))
        else:
            out.append(_plan_statement(test["statement"]))
    return out


def _plan_statement(source: str) -> tuple[dict, Check]:
    try:
        body = ast.parse(source).body
    except SyntaxError:  # run as written: the child reports the syntax error as a failed test
        return {"kind": "stmt", "statement": source}, Check("ran")
    if body and isinstance(body[-1], ast.Assert) and not any(_has_assert(s) for s in body[:-1]):
        shape = _value_shape(body[-1].test)
        if shape is not None:  # comparisons left inside what the child runs are made strict too
            expr, check = shape
            setup = ast.unparse(_StrictRewrite().visit(ast.Module(body[:-1], []))) if body[:-1] else ""
            return {"kind": "value", "setup": setup, "expr": ast.unparse(_StrictRewrite().visit(expr))}, check
    return {"kind": "stmt", "statement": ast.unparse(_StrictRewrite().visit(ast.Module(body, [])))}, Check("ran")


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _value_shape(test: ast.expr) -> tuple[ast.expr, Check] | None:
    """(expression the child evaluates, check) for a recognised assert condition, else None."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        lit_right, value_right = _literal(right)
        lit_left, value_left = _literal(left)
        if lit_right == lit_left:  # both or neither literal: not a value test
            return None
        expr, expected = (left, value_right) if lit_right else (right, value_left)
        if isinstance(op, (ast.Eq, ast.NotEq)):
            return expr, Check("value", "eq" if isinstance(op, ast.Eq) else "ne", expected)
        if isinstance(op, ast.Is) and lit_right and type(expected) in (type(None), bool):
            return expr, Check("value", "is", expected)
        if isinstance(op, (ast.Lt, ast.LtE)) and lit_right and _is_abs_diff(left):
            return _absdiff_shape(left.args[0], expected, strict_lt=isinstance(op, ast.Lt))
        if type(op) in _ORDERINGS:  # the literal's side decides the direction: 3 < f(x) is f(x) > 3
            name = _ORDERINGS[type(op)] if lit_right else _MIRRORED[_ORDERINGS[type(op)]]
            return expr, Check("value", name, expected)
        return None
    if isinstance(test, ast.Call) and _is_isclose(test):
        return _isclose_shape(test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and not _literal(test.operand)[0]:
        return test.operand, Check("value", "falsy")
    if isinstance(test, (ast.Call, ast.Subscript, ast.Attribute, ast.Name)):
        return test, Check("value", "truthy")
    return None


_ORDERINGS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge"}
_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _absdiff_shape(diff: ast.BinOp, tol: Any, strict_lt: bool) -> tuple[ast.expr, Check] | None:
    """abs(<expr> - <literal>) or abs(<literal> - <expr>) below a literal tolerance."""
    (lit_a, a), (lit_b, b) = _literal(diff.left), _literal(diff.right)
    if lit_a == lit_b or not _is_number(tol):
        return None
    expr, centre = (diff.left, b) if lit_b else (diff.right, a)
    if not _is_number(centre):
        return None
    return expr, Check("value", "absdiff", centre, abs_tol=float(tol), strict_lt=strict_lt)


def _is_abs_diff(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "abs"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.BinOp)
            and isinstance(node.args[0].op, ast.Sub))


def _is_isclose(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "isclose" and isinstance(f.value, ast.Name)
            and f.value.id == "math") or (isinstance(f, ast.Name) and f.id == "isclose")


def _isclose_shape(call: ast.Call) -> tuple[ast.expr, Check] | None:
    if len(call.args) != 2:
        return None
    (lit_a, a), (lit_b, b) = _literal(call.args[0]), _literal(call.args[1])
    if lit_a == lit_b:
        return None
    expr, expected = (call.args[0], b) if lit_b else (call.args[1], a)
    tol = {"rel_tol": 1e-9, "abs_tol": 0.0}
    for kw in call.keywords:
        ok, value = _literal(kw.value)
        if kw.arg not in tol or not ok or not _is_number(value):
            return None
        tol[kw.arg] = float(value)
    if not _is_number(expected):
        return None
    return expr, Check("value", "isclose", expected, rel_tol=tol["rel_tol"], abs_tol=tol["abs_tol"])


def _is_number(x: Any) -> bool:
    return type(x) in (int, float)


_OP_NAMES = {ast.Eq: "eq", ast.NotEq: "ne", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
             **_ORDERINGS}


class _StrictRewrite(ast.NodeTransformer):
    """Every comparison ``a < b == c`` -> ``__strict_compare__([a, b, c], ("lt", "eq"))`` (the sandbox runner's
    ``strict_compare``; its operands are all evaluated, where Python's chain stops at the first false link). One
    made of ``is`` / ``is not`` only stays: identity is no method a program can override."""

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            return node
        operands = ast.List([node.left, *node.comparators], ast.Load())
        ops = ast.Tuple([ast.Constant(_OP_NAMES[type(op)]) for op in node.ops], ast.Load())
        return ast.copy_location(ast.Call(ast.Name("__strict_compare__", ast.Load()), [operands, ops], []), node)


# ------------------------------------------------------------------------------------------ values
_SEQUENCES = {"l": list, "t": tuple, "S": set, "F": frozenset}


def decode_value(enc: Any, depth: int = 0) -> Any:
    """Rebuild a value from the strict encoding written by the sandbox runner (``encode_value``)."""
    if depth > 200 or not isinstance(enc, list) or not enc or not isinstance(enc[0], str):
        raise ValueError("malformed value encoding")
    tag, rest = enc[0], enc[1:]
    if tag == "N":
        return None
    if tag == "b" and len(rest) == 1 and isinstance(rest[0], bool):
        return rest[0]
    if tag == "i" and len(rest) == 1 and isinstance(rest[0], str):
        return int(rest[0], 16)
    if tag == "f" and len(rest) == 1 and isinstance(rest[0], str):
        return float(rest[0])
    if tag == "c" and len(rest) == 2:
        return complex(float(rest[0]), float(rest[1]))
    if tag == "s" and len(rest) == 1 and isinstance(rest[0], str):
        return rest[0]
    if tag == "y" and len(rest) == 1 and isinstance(rest[0], str):
        return bytes.fromhex(rest[0])
    if tag in _SEQUENCES and len(rest) == 1 and isinstance(rest[0], list):
        return _SEQUENCES[tag](decode_value(v, depth + 1) for v in rest[0])
    if tag == "d" and len(rest) == 1 and isinstance(rest[0], list):
        return {decode_value(k, depth + 1): decode_value(v, depth + 1) for k, v in rest[0]}
    raise ValueError(f"malformed value encoding (tag {tag!r})")


def judge(check: Check, outcome: dict) -> tuple[bool, str, str]:
    """(passed, reason, detail) of a test that ran to completion, from the child's outcome."""
    if check.kind == "ran":
        return True, "ok", ""
    if check.kind == "stdout":
        got = str(outcome.get("stdout", ""))
        if got == check.expected:
            return True, "ok", ""
        return False, "wrong_answer", f"expected {check.expected[:200]!r}, got {got[:200]!r}"
    if "value" not in outcome:
        return False, "wrong_answer", "no value came back"
    try:
        value = decode_value(outcome["value"])
    except (ValueError, TypeError, OverflowError, RecursionError):
        return False, "wrong_answer", "malformed value"
    passed = _compare(check, value)
    return (True, "ok", "") if passed else (False, "wrong_answer", f"got {_short(value)}")


def _compare(check: Check, value: Any) -> bool:
    op, expected = check.op, check.expected
    if op == "eq":
        return bool(value == expected)
    if op == "ne":
        return bool(value != expected)
    if op == "is":
        return value is expected
    if op == "truthy":
        return bool(value)
    if op == "falsy":
        return not value
    if op in _MIRRORED:
        try:
            return bool(_ORDERING_FUNCS[op](value, expected))
        except TypeError:  # unorderable (3 < "a"): the test fails, as it does in Python
            return False
    if not _is_number(value):
        return False
    if op == "isclose":
        return math.isclose(value, expected, rel_tol=check.rel_tol, abs_tol=check.abs_tol)
    diff = abs(value - expected)  # absdiff
    return diff < check.abs_tol if check.strict_lt else diff <= check.abs_tol


_ORDERING_FUNCS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int over the 4,300 digits str() writes
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 200 else text[:197] + "..."
