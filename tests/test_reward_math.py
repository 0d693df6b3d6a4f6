"""Math answer extraction, equivalence, truncation penalty and the timeout-guarded batch scorer."""

from __future__ import annotations

import threading
import time

import pytest

from reward.math import (
    extract_answer,
    extract_boxed,
    extract_choice,
    is_equivalent,
    is_truncated,
    normalize_answer,
    score_math,
    score_math_batch,
)
from reward.procpool import TimeoutPool


def _sleep_if_asked(x: str) -> str:
    """Pool test helper (module level so spawned workers can import it)."""
    if x == "hang":
        time.sleep(3600)
    if x == "crash":
        import os

        os._exit(3)
    return x.upper()


def _warmed() -> None:
    """Pool warm-up helper: what it sets is visible to every item the worker runs."""
    import os

    os.environ["POOL_WARMED"] = "yes"


def _was_warmed(x: str) -> str:
    import os

    return os.environ.get("POOL_WARMED", "no")


# ----------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{x^{2} + \{1, 2\}}", r"x^{2} + \{1, 2\}"),
        (r"first \boxed{1} then \boxed{2} finally \boxed{3}", "3"),
        (r"\boxed{\boxed{7}}", "7"),
        (r"\boxed{a_{b_{c}}} tail", "a_{b_{c}}"),
        (r"\fbox{42}", "42"),
        (r"the answer: \boxed 5$.", "5"),
        (r"\boxed {12}", "12"),
        (r"last box is cut \boxed{4} and \boxed{5", "4"),
        (r"unicode \boxed{π ≈ 3.14 → ∞}", "π ≈ 3.14 → ∞"),
        ("no box here", None),
        ("", None),
        (r"\boxedx", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_answer_is_fallback_is_configurable():
    text = "We add them up. The answer is $\\frac{3}{4}$."
    assert extract_answer(text) == r"\frac{3}{4}"
    assert extract_answer(text, fallback=None) is None
    assert extract_answer(r"The answer is 3. Actually \boxed{4}") == "4"  # boxed wins
    with pytest.raises(ValueError, match="unknown fallback 'bogus'"):
        extract_answer("x", fallback="bogus")


@pytest.mark.parametrize(
    ("text", "letter"),
    [(r"\boxed{B}", "B"), (r"\boxed{\text{(C)}}", "C"), (r"\boxed{(d)}", "D"), ("The answer is (A).", "A"),
     ("so the answer is: B", "B"), ("I think it is E", None), (r"\boxed{42}", None),
     ("The answer is a bit tricky to see.", None), ("the answer is (b)", "B"), ("so the answer is c.", "C"),
     ("The answer is b) 12", "B"), (r"\boxed{a = 5}", None), (r"\boxed{b. 42}", "B"), (r"\boxed{A is 4}", "A")],
)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


# --------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", "0.75"),
        ("(1,2]", "(1, 2]"),
        (r"\left( 0, 1 \right)", "(0,1)"),
        (r"\{1,2\}", r"\{2,1\}"),
        ("1,000", "1000"),
        (r"5\text{ cm}", "5"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        ("$7$", "7"),
        ("x = 3", "3"),
        ("12.", "12"),
        (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"),
        ("(x+1)^2", "x^2+2x+1"),
        (".5", "1/2"),
    ],
)
def test_equivalent_forms(pred, gt):
    assert is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt"),
    [("1,2", "12"), ("12", "1,2"), ("[0,1)", "(0,1]"), ("3", "4"), ("0.51", r"\frac12"), ("x+1", "x-1"),
     (r"\frac{1}{3}", "0.3"), ("", "0"), (r"2 \text{ hours and } 30 \text{ minutes}", "2"),
     (r"6 \text{ ft } 2 \text{ in}", "6")],  # not the first number of a compound quantity
)
def test_wrong_answers_stay_wrong(pred, gt):
    assert not is_equivalent(pred, gt)


def test_none_prediction_is_wrong():
    assert not is_equivalent(None, "1")


def test_normaliser_keeps_list_commas():
    assert normalize_answer("1,2") == "1,2"
    assert normalize_answer("1,234,567") == "1234567"
    assert normalize_answer(r"\$1{,}000") == "1000"


def test_equivalence_works_outside_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(is_equivalent("(x+1)^2", "x^2+2x+1")))
    t.start()
    t.join(30)
    assert out == [True]


# ------------------------------------------------------------------------------------------------- scoring
def test_truncation_penalty():
    resp = r"... \boxed{6}"
    assert score_math(resp, "6", response_length=94, max_tokens=100) == 1.0
    assert score_math(resp, "6", response_length=95, max_tokens=100) == 0.0  # >= max_tokens - 5
    assert score_math(resp, "6", response_length=98, max_tokens=100, truncation_margin=2) == 0.0
    assert score_math(resp, "6", response_length=97, max_tokens=100, truncation_margin=2) == 1.0
    assert score_math(resp, "6", response_length=100, max_tokens=100, truncation_margin=None) == 1.0
    assert not is_truncated(None, 100)


def test_score_math_types():
    assert score_math(r"\boxed{\dfrac{1}{2}}", "0.5") == 1.0
    assert score_math("no answer", "0.5") == 0.0
    assert score_math(r"\boxed{(B)}", "B", data_type="option") == 1.0
    assert score_math("The answer is (C)", "B", data_type="option") == 0.0
    with pytest.raises(ValueError, match="data_type must be 'math' or 'option', got 'code'"):
        score_math("x", "1", data_type="code")


def test_score_math_batch_matches_single_scores():
    responses = [r"\boxed{0.5}", r"\boxed{(x+1)^2}", r"\boxed{1,2}", "nothing", r"\boxed{3}", r"x \boxed{2\pi}"]
    gts = [r"\frac12", "x^2+2x+1", "12", "1", "3", "6.283185307"]
    lengths = [10, 10, 10, 10, 99, 10]
    scores = score_math_batch(responses, gts, response_lengths=lengths, max_tokens=100, workers=2)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="1 responses but 2 ground truths"):
        score_math_batch(["a"], ["1", "2"])


def test_pool_kills_hung_and_crashed_items_and_keeps_working():
    # a timeout with room for a loaded machine (an item that starts late must not time out); the hung item sleeps
    # an hour, so finishing at all shows it was killed
    pool = TimeoutPool(_sleep_if_asked, workers=2, timeout_s=8.0)
    try:
        out = pool.map([("a",), ("hang",), ("b",), ("crash",), ("c",)], default="TIMEOUT")
        assert out == ["A", "TIMEOUT", "B", "TIMEOUT", "C"]
        assert pool.map([("d",), ("e",)], default=None) == ["D", "E"]
    finally:
        pool.close()


def test_a_worker_that_does_not_start_leaves_no_process_and_no_half_done_state(monkeypatch):
    from reward import procpool

    pool = TimeoutPool(_sleep_if_asked, workers=2, timeout_s=8.0)
    ready = procpool._Worker.wait_ready
    calls = []

    def fails_on_the_second(self):  # the second fresh worker "does not start"
        calls.append(self)
        if len(calls) == 2:
            self.kill()
            raise RuntimeError("a pool worker did not start")
        ready(self)

    try:
        monkeypatch.setattr(procpool._Worker, "wait_ready", fails_on_the_second)
        with pytest.raises(RuntimeError, match="did not start"):
            pool.map([("a",), ("b",)])
        assert pool.workers == [] and len(calls) == 2 and not any(w.proc.is_alive() for w in calls)
        monkeypatch.setattr(procpool._Worker, "wait_ready", ready)
        assert pool.map([("c",), ("d",)]) == ["C", "D"]  # the next map starts afresh
    finally:
        pool.close()


def test_workers_that_died_while_idle_are_replaced_and_their_warmup_runs_first():
    """Every idle worker gone before the map (its sends fail): fresh workers take the items; each one ran the
    warm-up before it counted as started."""
    pool = TimeoutPool(_was_warmed, workers=2, timeout_s=30.0, warmup=_warmed)
    try:
        assert pool.map([("a",), ("b",)]) == ["yes", "yes"]
        for w in pool.workers:  # alive to _ensure_workers, but their pipes are closed: every send fails
            w.conn.close()
        assert pool.map([("c",), ("d",), ("e",)]) == ["yes", "yes", "yes"]
    finally:
        pool.close()


def test_degenerate_long_outputs_are_handled():
    """Unclosed braces by the ten thousand, a 100,000-digit number: answers, not a hang (a backtracking parser would
    stall the suite here)."""
    assert extract_boxed("\\boxed{" * 50_000) is None
    assert extract_boxed("\\boxed{" * 50_000 + "\\boxed{1}") == "1"
    assert not is_equivalent("1" * 100_000, "1")
    assert extract_answer("the answer is " + "\\text{a " * 20_000) == ("\\text{a " * 20_000).rstrip()
    assert score_math_batch(["\\boxed{" + "9" * 5000 + "}"], ["9"]) == [0.0]
