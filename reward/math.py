"""Math answer extraction and equivalence checking (Gen-Verse/dLLM-RL reward/math_utils.py semantics, without its comma
stripping and runaway threads).

Pipeline per response: extract the last ``\\boxed{...}`` (optionally "The answer is X"), compare it with the
ground truth by a conservative string normaliser first, then by ``math_verify``. ``math_verify`` uses
``signal.alarm`` and sympy can hang on pathological input, so batch scoring runs the symbolic step in a small
process pool with a hard per-item timeout (``score_math_batch``).
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Sequence
from fractions import Fraction

from reward.procpool import TimeoutPool

__all__ = [
    "extract_boxed",
    "extract_answer",
    "extract_choice",
    "normalize_answer",
    "is_equivalent",
    "score_math",
    "score_math_batch",
    "is_truncated",
]

MAX_ANSWER_CHARS = 2000  # longer "answers" are degenerate generations: never equivalent, never parsed
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*(.+?)\s*(?:\n|$)", re.IGNORECASE)
# a letter after "answer is": a capital, a lowercase one in parentheses, or one that ends the clause ("the answer is
# a bit ..." is no choice)
_CHOICE_RE = re.compile(r"(?i:answer\s+is)\s*:?\s*\**\s*(?:\(\s*([A-Da-d])\s*\)|\(?\s*([A-D])\b\s*\)?|"
                        r"([a-d])(?=\s*(?:[.,;:!*)]|$)))")


# ----------------------------------------------------------------------------------------------- extraction
def _brace_pairs(text: str) -> dict[int, int]:
    """Map from each ``{`` to its matching ``}`` in one pass (backslash-escaped braces skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _box_content(text: str, start: int, pairs: dict[int, int]) -> str | None:
    """Content of the box whose command ends at ``start`` (brace form or ``\\boxed 5`` short form)."""
    j = start
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        end = pairs.get(j)
        return None if end is None else text[j + 1 : end]
    if j == start:  # e.g. "\boxedx": not a box
        return None
    m = re.match(r"[^\s$]+", text[j:])
    return m.group(0) if m else None


def extract_boxed(text: str | None) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces matched), else None."""
    if not text:
        return None
    pairs: dict[int, int] | None = None
    for m in reversed(list(_BOX_RE.finditer(text))):
        pairs = _brace_pairs(text) if pairs is None else pairs
        content = _box_content(text, m.end(), pairs)
        if content is not None:
            return content.strip()
    return None


def _answer_is(text: str) -> str | None:
    """Last "the answer is X" statement, with surrounding ``$``, ``**`` and a final period removed."""
    matches = _ANSWER_IS_RE.findall(text)
    if not matches:
        return None
    ans = matches[-1].strip().strip("*").strip()
    ans = ans.rstrip(".").strip()
    if ans.startswith("$") and ans.endswith("$"):
        ans = ans.strip("$").strip()
    return ans or None


def extract_answer(text: str | None, fallback: str | None = "answer_is") -> str | None:
    """Boxed answer, else (``fallback="answer_is"``) the last "The answer is X", else None."""
    boxed = extract_boxed(text)
    if boxed is not None or not text or fallback is None:
        return boxed
    if fallback != "answer_is":
        raise ValueError(f"unknown fallback {fallback!r}; use 'answer_is' or None")
    return _answer_is(text)


def _choice_letter(s: str) -> str | None:
    """A-D from strings like ``B``, ``(B)``, ``\\text{(B)}``, ``B. 42``."""
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s).strip().strip("$* ")
    m = re.match(r"^\(?\s*([A-D])\s*\)?(?:$|[.:)\s])", s) or re.match(r"^\(?\s*([a-d])\s*\)?(?:$|[.:)])", s)
    return m.group(1).upper() if m else None  # a lowercase letter before a space is a variable: "a = 5"


def extract_choice(text: str | None) -> str | None:
    """Multiple-choice letter (A-D) from a boxed letter or "answer is (B)", else None."""
    if not text:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        letter = _choice_letter(boxed)
        if letter is not None:
            return letter
    matches = _CHOICE_RE.findall(text)
    return "".join(matches[-1]).upper() if matches else None


# ---------------------------------------------------------------------------------------------- normaliser
_UNIT_TEXT_RE = re.compile(r"^(.+?)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s.^0-9/]*\}\s*$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC_SHORT_RE = re.compile(r"\\frac(\d)(\d)")
_FRAC_HALF_RE = re.compile(r"\\frac\{([^{}]+)\}(\d)")
_SQRT_SHORT_RE = re.compile(r"\\sqrt(\w)")


def _strip_wrappers(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\displaystyle", "")
    s = s.replace("\\left", "").replace("\\right", "")
    for deg in ("^{\\circ}", "^\\circ", "\\degree", "°"):
        s = s.replace(deg, "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("{,}", "").replace("\\,", "").replace("\\;", "").replace("\\:", "").replace("~", " ")
    return s.strip()


def normalize_answer(answer: str) -> str:
    """Conservative canonical form of a final answer (commas kept unless they are thousands separators)."""
    s = _strip_wrappers(answer)
    m = _UNIT_TEXT_RE.match(s)
    if m:  # trailing unit: "5 \text{ cm}" -> "5"
        s = m.group(1)
    s = s.rstrip(".").strip()
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    m = re.match(r"^[A-Za-z]\w?\s*=\s*(.+)$", s)  # short "x = 3" prefix
    if m:
        s = m.group(1)
    s = s.replace(" ", "")
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_RE.sub(r"\\frac{\1}{\2}", s)
    if s.startswith("."):
        s = "0" + s
    s = s.replace("-.", "-0.")
    return s


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a plain number, ``a/b`` or ``\\frac{a}{b}`` (integers or decimals), else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if not re.fullmatch(r"-?[\d.]+(?:/-?[\d.]+)?", s):
        return None
    try:
        num, _, den = s.partition("/")
        value = Fraction(num)
        return value / Fraction(den) if den else value
    except (ValueError, ZeroDivisionError):
        return None


def _plain_equal(pred: str, gt: str) -> bool:
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    a, b = normalize_answer(pred), normalize_answer(gt)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fb is not None and fa == fb


# ------------------------------------------------------------------------------------------- math-verify
_NUMBERS_BETWEEN_WORDS = re.compile(r"\d\s*\\(?:text|mbox|mathrm)\{[^{}]*[A-Za-z][^{}]*\}\s*-?\d")


def _symbolic_equal(pred: str, gt: str, timeout_s: int | None) -> bool:
    """math_verify equivalence; ``timeout_s`` uses signal.alarm, so only pass it in a main thread."""
    import logging

    from math_verify import parse, verify

    if _NUMBERS_BETWEEN_WORDS.search(pred) and not _NUMBERS_BETWEEN_WORDS.search(gt):
        return False  # "2 \text{ hours and } 30 \text{ minutes}": math_verify would read its first number only
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        gold = parse(f"${gt}$", parsing_timeout=timeout_s)
        target = parse(f"${pred}$", parsing_timeout=timeout_s)
        if not gold or not target:
            return False
        return bool(verify(gold, target, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - any parser/sympy failure means "not shown equal"
        return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")


def is_equivalent(pred: str | None, gt: str, timeout_s: int = 5) -> bool:
    """True if ``pred`` and ``gt`` denote the same answer (normaliser, then math_verify).

    In-process: the timeout is enforced with signal.alarm in the main thread only; from other threads the
    symbolic check runs without a timeout. Use ``score_math_batch`` for untrusted bulk input.
    """
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    if _plain_equal(pred, gt):
        return True
    return _symbolic_equal(pred, gt, timeout_s if _in_main_thread() else None)


def _import_math_verify() -> None:
    """A pool worker's warm-up: math_verify (and sympy) imported before the first item's timeout starts."""
    import math_verify  # noqa: F401


def _pool_equivalent(pred: str, gt: str, timeout_s: int) -> bool:
    """Worker-side check (runs in the main thread of a pool process, so the alarm timeout works)."""
    return _symbolic_equal(pred, gt, timeout_s)


# --------------------------------------------------------------------------------------------- scoring
def is_truncated(response_length: int | None, max_tokens: int | None, margin: int | None = 5) -> bool:
    """Reference truncation rule: length >= max_tokens - margin (``margin=None`` disables it)."""
    if margin is None or response_length is None or max_tokens is None:
        return False
    return response_length >= max_tokens - margin


def _option_correct(response_text: str, gt: str) -> bool:
    pred = extract_choice(response_text)
    gold = _choice_letter(gt) or gt.strip().upper()
    return pred is not None and pred == gold


def score_math(
    response_text: str,
    gt: str,
    data_type: str = "math",
    response_length: int | None = None,
    max_tokens: int | None = None,
    truncation_margin: int | None = 5,
    fallback: str | None = "answer_is",
) -> float:
    """1.0 if the response's final answer matches ``gt`` and the response is not truncated, else 0.0."""
    if is_truncated(response_length, max_tokens, truncation_margin):
        return 0.0
    if data_type == "option":
        return float(_option_correct(response_text, gt))
    if data_type != "math":
        raise ValueError(f"data_type must be 'math' or 'option', got {data_type!r}")
    return float(is_equivalent(extract_answer(response_text, fallback), gt))


_POOLS: dict[tuple[int, float, str], TimeoutPool] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pool(workers: int, timeout_s: float, context: str) -> TimeoutPool:
    """Process pool reused across calls (worker start-up costs ~0.5 s); closed at interpreter exit."""
    key = (workers, timeout_s, context)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = TimeoutPool(_pool_equivalent, workers=workers, timeout_s=timeout_s, context=context,
                                      warmup=_import_math_verify)
        return _POOLS[key]


def score_math_batch(
    responses: Sequence[str],
    gts: Sequence[str],
    data_type: str = "math",
    response_lengths: Sequence[int | None] | None = None,
    max_tokens: int | None = None,
    truncation_margin: int | None = 5,
    fallback: str | None = "answer_is",
    timeout_s: float = 5.0,
    workers: int = 2,
    context: str = "spawn",
) -> list[float]:
    """Scores (1.0/0.0) for many responses; symbolic checks run in worker processes with a hard timeout.

    Cheap steps (extraction, truncation, normaliser) run here; only pairs they cannot decide go to the pool.
    A pair that exceeds ``timeout_s`` (or crashes its worker) scores 0 and the worker is replaced.
    """
    if len(responses) != len(gts):
        raise ValueError(f"{len(responses)} responses but {len(gts)} ground truths")
    lengths = list(response_lengths) if response_lengths is not None else [None] * len(responses)
    if len(lengths) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(lengths)} response lengths")
    scores = [0.0] * len(responses)
    pending: list[tuple[int, tuple[str, str, int]]] = []
    for i, (text, gt) in enumerate(zip(responses, gts)):
        if is_truncated(lengths[i], max_tokens, truncation_margin):
            continue
        if data_type == "option":
            scores[i] = float(_option_correct(text, gt))
            continue
        pred = extract_answer(text, fallback)
        if pred is None or len(pred) > MAX_ANSWER_CHARS:
            continue
        if _plain_equal(pred, gt):
            scores[i] = 1.0
        else:
            pending.append((i, (pred, gt, max(1, int(timeout_s)))))
    if pending:
        pool = _shared_pool(workers, timeout_s + 1.0, context)
        results = pool.map([args for _, args in pending], default=False)
        for (i, _), ok in zip(pending, results):
            scores[i] = float(bool(ok))
    return scores
