"""Dataset row formats (data/README.md) and a loader that validates every row.

A malformed row is an error naming the file, the row index and the field, never a silent drop or a
KeyError deep inside the rollout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from core.errors import UserError
from core.files import write_atomic

__all__ = ["KINDS", "DataFormatError", "validate_row", "validate_rows", "row_kind", "load_dataset_file",
           "save_dataset_file"]

KINDS = ("math", "option", "code", "sft")
TEST_METHODS = ("function", "stdio")
DEFAULT_TEST_TIME_LIMIT = 1.0


class DataFormatError(UserError, ValueError):
    """A dataset file or row does not match its format."""


def _fail(where: str, index: int, field: str, problem: str) -> DataFormatError:
    return DataFormatError(f"{where}: row {index}: field '{field}': {problem}")


def _type_name(value: Any) -> str:
    return type(value).__name__


def _require_str(row: Mapping, field: str, where: str, index: int, allow_empty: bool = False) -> None:
    if field not in row:
        raise _fail(where, index, field, "missing")
    value = row[field]
    if not isinstance(value, str):
        raise _fail(where, index, field, f"expected a string, got {_type_name(value)}")
    if not allow_empty and not value.strip():
        raise _fail(where, index, field, "empty string")


def _require_str_list(row: Mapping, field: str, where: str, index: int) -> None:
    if field not in row:
        raise _fail(where, index, field, "missing")
    value = row[field]
    if not isinstance(value, list):
        raise _fail(where, index, field, f"expected a list of strings, got {_type_name(value)}")
    if not value:
        raise _fail(where, index, field, "empty list")
    for k, item in enumerate(value):
        if not isinstance(item, str):
            raise _fail(where, index, field, f"item {k}: expected a string, got {_type_name(item)}")


def _check_math(row: dict, where: str, index: int) -> None:
    _require_str(row, "question", where, index)
    _require_str(row, "ground_truth_answer", where, index)


def _check_option(row: dict, where: str, index: int) -> None:
    _check_math(row, where, index)
    if row["ground_truth_answer"].strip().strip("()").upper() not in ("A", "B", "C", "D"):
        raise _fail(where, index, "ground_truth_answer", f"expected one of A-D, got {row['ground_truth_answer']!r}")


def _check_code(row: dict, where: str, index: int) -> None:
    _require_str(row, "question", where, index)
    method = row.get("test_method")
    if method not in TEST_METHODS:
        raise _fail(where, index, "test_method", f"expected one of {TEST_METHODS}, got {method!r}")
    limit = row.setdefault("test_time_limit", DEFAULT_TEST_TIME_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0:
        raise _fail(where, index, "test_time_limit", f"expected a positive number of seconds, got {limit!r}")
    if method == "function":
        _require_str_list(row, "test_list", where, index)
        row.setdefault("prefix", "")
        _require_str(row, "prefix", where, index, allow_empty=True)
        return
    _require_str_list(row, "test_input", where, index)
    _require_str_list(row, "test_output", where, index)
    if len(row["test_input"]) != len(row["test_output"]):
        raise _fail(where, index, "test_output",
                    f"{len(row['test_output'])} outputs for {len(row['test_input'])} inputs (must be equal)")


def _check_sft(row: dict, where: str, index: int) -> None:
    _require_str(row, "prompt", where, index)
    _require_str(row, "response", where, index)


_CHECKS: dict[str, Callable[[dict, str, int], None]] = {
    "math": _check_math, "option": _check_option, "code": _check_code, "sft": _check_sft,
}


def validate_row(row: Any, kind: str, index: int = 0, where: str = "<rows>") -> dict:
    """A validated copy of ``row`` (defaults filled in: ``test_time_limit``, ``prefix``); raises
    DataFormatError naming ``where``, the row index and the field."""
    if kind not in _CHECKS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {KINDS}")
    if not isinstance(row, Mapping):
        raise DataFormatError(f"{where}: row {index}: expected an object, got {_type_name(row)}")
    out = dict(row)
    _CHECKS[kind](out, where, index)
    return out


def validate_rows(rows: Sequence[Any], kind: str, where: str = "<rows>") -> list[dict]:
    """Validate every row (see ``validate_row``)."""
    return [validate_row(row, kind, i, where) for i, row in enumerate(rows)]


def row_kind(row: Mapping) -> str:
    """Best guess of a row's kind from its fields (``code`` / ``sft`` / ``math``)."""
    if "test_method" in row:
        return "code"
    if "prompt" in row and "response" in row:
        return "sft"
    return "math"


def read_raw_rows(path: str | Path) -> list[Any]:
    """The rows of a .json (list) or .jsonl file, not validated (errors name the file and line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise DataFormatError(f"{path}: line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                              f"offset {exc.start})") from None
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.split("\n")):  # not splitlines: U+2028 and kin are text inside a row
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataFormatError(f"{path}: line {n + 1}: invalid JSON: {exc.msg}") from None
        return rows
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (one JSON object per line is JSON Lines: name the file .jsonl)" if exc.msg == "Extra data" else ""
        raise DataFormatError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}{hint}") from None
    if not isinstance(rows, list):
        raise DataFormatError(f"{path}: expected a JSON list of rows, got {_type_name(rows)}")
    return rows


def load_dataset_file(path: str | Path, kind: str) -> list[dict]:
    """Rows of a ``.json`` (list) or ``.jsonl`` dataset file, every row validated as ``kind``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path} (see data/README.md to download or build it)")
    rows = read_raw_rows(path)
    if not rows:
        raise DataFormatError(f"{path}: the dataset has no rows")
    return validate_rows(rows, kind, str(path))


def save_dataset_file(rows: Sequence[Mapping], path: str | Path, kind: str) -> Path:
    """Validate and write rows (atomically: temp file + rename): one JSON object per line for a ``.jsonl`` path,
    else a JSON list."""
    path = Path(path)
    valid = validate_rows(rows, kind, str(path))
    if path.suffix == ".jsonl":
        write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in valid))
    else:
        write_atomic(path, json.dumps(valid, ensure_ascii=False, indent=1))
    return path
