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
    ("assert abs(1.5 - g(2)) < 1e-6", "g(2)", Check("value", "absdiff", 1.5, abs_tol=1e-6)),
    ("assert f(-1) == -2, 'message'", "f(-1)", Check("value", "eq", -2)),
    ("assert f(1) > 100", "f(1)", Check("value", "gt", 100)),
    ("assert 7 <= f(1)", "f(1)", Check("value", "ge", 7)),  # the literal on the left: mirrored
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
    assert ("__strict_compare__([f(k), k + 1], ('eq',)) and __strict_compare__([k, g()], ('not in',))"
            in probe["statement"])
    probe, _ = plan("assert not f(1) != 3")  # a comparison inside what the child evaluates is strict too
    assert probe["expr"] == "__strict_compare__([f(1), 3], ('ne',))"  # checked falsy
    probe, _ = plan("assert 0 < f(1) < 10 and g() is not None")  # chains too; identity stays as written
    assert probe["statement"] == "assert __strict_compare__([0, f(1), 10], ('lt', 'lt')) and g() is not None"


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


class _AlwaysEqual(int):
    """A subclass whose own methods claim everything: only what it stores may count."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return True

    __hash__ = int.__hash__


def test_subclasses_of_builtins_count_as_the_value_they_hold_and_their_methods_never_run():
    point = collections.namedtuple("Point", "x y")(1, 2)
    assert decode_value(runner.encode_value(point)) == (1, 2)
    assert type(decode_value(runner.encode_value(point))) is tuple
    liar = _AlwaysEqual(3)
    assert decode_value(runner.encode_value([liar])) == [3]
    assert runner.strict_eq(liar, 4) is False and runner.strict_eq(liar, 3) is True
    shout = type("Shout", (str,), {"__str__": lambda self: "forged"})("x")
    assert decode_value(runner.encode_value(shout)) == "x"
    assert decode_value(runner.encode_value({"k": type("L", (list,), {})([1])})) == {"k": [1]}


def test_numpy_scalars_count_as_their_item():
    np = pytest.importorskip("numpy")
    for value, plain in [(np.int64(3), 3), (np.float64(1.5), 1.5), (np.bool_(True), True), (np.array(7), 7)]:
        back = decode_value(runner.encode_value(value))
        assert back == plain and type(back) is type(plain)
    with pytest.raises(runner.UnsupportedValue):
        runner.encode_value(np.array([1, 2]))  # no single value (Python's own == would not decide either)


@pytest.mark.parametrize("value", [object(), collections.deque([1]),
                                   [type("Box", (), {"__eq__": lambda s, o: True})()]])
def test_other_objects_are_refused(value):
    with pytest.raises(runner.UnsupportedValue):
        runner.encode_value(value)
    assert runner.strict_eq(value, value) is False


def test_strict_comparisons_order_builtin_copies_and_refuse_to_order_objects():
    class Liar:
        def __lt__(self, other):
            return True

        __gt__ = __le__ = __ge__ = __lt__

    assert runner.strict_compare([0, _AlwaysEqual(5), 10], ("lt", "lt")) is True
    assert runner.strict_compare([0, _AlwaysEqual(50), 10], ("lt", "lt")) is False
    assert runner.strict_compare([1, 1, 2], ("eq", "eq")) is False
    with pytest.raises(runner.UnsupportedValue):
        runner.strict_compare([Liar(), 100], ("gt",))
    with pytest.raises(TypeError):
        runner.strict_compare([1, "a"], ("lt",))


def test_ints_beyond_the_decimal_digit_limit_travel():
    big = -(10 ** 5000) + 7
    assert decode_value(runner.encode_value(big)) == big
    assert "bits" in judge(Check("value", "eq", 0), {"value": runner.encode_value(big)})[2]


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
    (Check("value", "gt", 100), 101, True), (Check("value", "gt", 100), 100, False),
    (Check("value", "le", 2.5), 2, True), (Check("value", "lt", 3), "a", False),
])
def test_the_caller_judges_decoded_values(check, value, passed):
    assert judge(check, {"value": runner.encode_value(value)})[0] is passed


def test_malformed_or_missing_values_fail():
    assert judge(Check("value", "eq", 1), {})[:2] == (False, "wrong_answer")
    assert judge(Check("value", "eq", 1), {"value": ["i", "1", "extra"]})[:2] == (False, "wrong_answer")
    assert judge(Check("value", "eq", 1), {"value": ["zz"]})[:2] == (False, "wrong_answer")
