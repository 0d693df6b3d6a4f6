"""Test planning (what the sandboxed child runs vs what the caller checks) and the strict value encoding."""

from __future__ import annotations

import collections
import math

import pytest

from reward import _sandbox_runner as runner
from reward.verdicts import Check, decode_value, judge, plan_tests


def plan(statement: str):
    ((probe, check),) = plan_tests([{"statement": statement}])
    return probe, check


@pytest.mark.parametrize(("statement", "expr", "check"), [
    ("assert add(1, 2) == 3", "add(1, 2)", Check("value", "eq", 3)),
    ("assert [3, 4] == f(x)", "f(x)", Check("value", "eq", [3, 4])),
    ("assert f() != 'a'", "f()", Check("value", "ne", "a")),
    ("assert f() is None", "f()", Check("value", "is", None)),
    ("assert is_prime(7)", "is_prime(7)", Check("value", "truthy")),
    ("assert not is_prime(8)", "is_prime(8)", Check("value", "falsy")),
    ("assert math.isclose(g(2), 1.5, abs_tol=0.01)", "g(2)", Check("value", "isclose", 1.5, abs_tol=0.01)),
    ("assert abs(g(2) - 1.5) <= 1e-6", "g(2)", Check("value", "absdiff", 1.5, abs_tol=1e-6, strict_lt=False)),
    ("assert f(-1) == -2, 'message'", "f(-1)", Check("value", "eq", -2)),
])
def test_usual_shapes_send_only_the_expression(statement, expr, check):
    probe, got = plan(statement)
    assert probe == {"kind": "value", "setup": "", "expr": expr}
    assert got == check


def test_setup_statements_travel_and_the_expected_value_does_not():
    probe, check = plan("s = Solution()\nassert s.run([1, 2]) == 918273")
    assert probe == {"kind": "value", "setup": "s = Solution()", "expr": "s.run([1, 2])"}
    assert check.expected == 918273 and "918273" not in repr(probe)


def test_other_shapes_are_rewritten_with_strict_comparisons():
    probe, check = plan("for k in range(3):\n    assert f(k) == k + 1 and k not in g()")
    assert check == Check("ran") and probe["kind"] == "stmt"
    assert "__strict_eq__(f(k), k + 1)" in probe["statement"] and "not __strict_in__(k, g())" in probe["statement"]
    probe, _ = plan("assert not f(1) != 3")  # a comparison inside what the child evaluates is strict too
    assert probe["expr"] == "not __strict_eq__(f(1), 3)"


def test_stdio_tests_send_the_input_and_how_much_output_to_keep():
    ((probe, check),) = plan_tests([{"input": "1 2\n", "output": "  3 \n\n"}])
    assert probe == {"kind": "stdio", "input": "1 2\n", "keep": 2} and check == Check("stdout", expected="3")


VALUES = [0, -7, 2 ** 300, 1.5, -0.0, math.inf, 1 + 2j, "héllo", b"\x00\xff", None, True, False,
          [1, [2, (3,)]], (1, "a"), {1, 2}, frozenset({"x"}), {"k": [1, {"n": None}], 2: (3,)}]


@pytest.mark.parametrize("value", VALUES, ids=[type(v).__name__ + str(i) for i, v in enumerate(VALUES)])
def test_encoding_round_trips_exact_builtin_values(value):
    back = decode_value(runner.encode_value(value))
    assert back == value and type(back) is type(value)


def test_stdlib_dicts_encode_as_dicts_and_nan_survives():
    d = collections.defaultdict(int, {"a": 2})
    assert decode_value(runner.encode_value(d)) == {"a": 2}
    assert decode_value(runner.encode_value(collections.Counter("aab"))) == {"a": 2, "b": 1}
    assert math.isnan(decode_value(runner.encode_value(float("nan"))))


@pytest.mark.parametrize("value", [type("Int", (int,), {})(3), [type("S", (str,), {})("x")], object(),
                                   collections.deque([1]), {"k": type("L", (list,), {})()}])
def test_subclasses_and_other_objects_are_refused(value):
    with pytest.raises(runner.UnsupportedValue):
        runner.encode_value(value)
    assert runner.strict_eq(value, value) is False


def test_huge_or_deep_values_are_refused():
    with pytest.raises(runner.UnsupportedValue):
        runner.encode_value("x" * (runner.VALUE_BUDGET + 1))
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(runner.UnsupportedValue):
        runner.encode_value(deep)


@pytest.mark.parametrize(("check", "value", "passed"), [
    (Check("value", "eq", 3), 3, True), (Check("value", "eq", 3), 3.0, True), (Check("value", "eq", 3), "3", False),
    (Check("value", "ne", 3), 4, True), (Check("value", "is", True), 1, False),
    (Check("value", "is", True), True, True),
    (Check("value", "truthy"), [0], True), (Check("value", "falsy"), "", True),
    (Check("value", "isclose", 1.0, rel_tol=1e-3), 1.0005, True), (Check("value", "isclose", 1.0), 1.1, False),
    (Check("value", "isclose", 1.0), "1.0", False), (Check("value", "absdiff", 2.0, abs_tol=0.1), 2.05, True),
    (Check("value", "absdiff", 2.0, abs_tol=0.1), 2.1, False),
])
def test_the_caller_judges_decoded_values(check, value, passed):
    assert judge(check, {"value": runner.encode_value(value)})[0] is passed


def test_malformed_or_missing_values_fail():
    assert judge(Check("value", "eq", 1), {})[:2] == (False, "wrong_answer")
    assert judge(Check("value", "eq", 1), {"value": ["i", "1", "extra"]})[:2] == (False, "wrong_answer")
    assert judge(Check("value", "eq", 1), {"value": ["zz"]})[:2] == (False, "wrong_answer")
