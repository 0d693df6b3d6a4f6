"""The base of every config section: a dataclass that validates its own fields, declared once next to its consumer.

A section class is at the same time the YAML schema (field names, types, defaults, allowed sets, ranges) and the
runtime settings object that the consuming code reads (the sampler reads ``SamplingParams``, the trainer its
``TrainingConfig`` ...). There is no mapping between the two and no second set of defaults.

* ``bounded(default, lo, hi)`` declares a numeric range; ``Literal[...]`` an allowed set; both are checked by
  :func:`check_fields` when the object is built, from a YAML file or from code alike.
* A violation raises :class:`SettingError` naming the field, which the loader turns into a one-line error naming
  the dotted key and the file.
* Fields whose name starts with ``_`` are internal (not config keys).
* Reads can be recorded (:func:`record_reads`): the coverage test uses it to prove that every key a job accepts
  is consumed by that job.

This module imports nothing heavy, so configs are validated before torch is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

__all__ = ["Settings", "SettingError", "bounded", "check_fields", "config_fields", "record_reads", "replace",
           "to_dict"]


class SettingError(ValueError):
    """An invalid setting; ``field`` is the offending field (dotted inside nested sections)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def bounded(default: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Any:
    """A dataclass field whose (non-null) numeric value, or each element of a list value, lies in [lo, hi]
    (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default),
                                 metadata={"lo": lo, "hi": hi, "lo_open": lo_open})
    return dataclasses.field(default=default, metadata={"lo": lo, "hi": hi, "lo_open": lo_open})


@functools.cache
def config_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """Config keys of a section class: field name -> (resolved type, metadata); internal ``_`` fields excluded."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(cls)
            if not f.name.startswith("_") and f.init}


def describe_type(tp: Any) -> str:
    """Human name of a field type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if origin is Literal:
        return "one of {" + ", ".join(map(str, args)) + "}"
    if origin is list:
        return "a list of " + describe_type(args[0]).removeprefix("an ").removeprefix("a ")
    if origin is dict:
        return f"a mapping of {describe_type(args[1])}"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


_TYPE_NAMES = {int: "an int", float: "a number", str: "a string", bool: "a bool", type(None): "null"}


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return value in args and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_fits(v, args[0]) for v in value)
    if origin is tuple:
        return isinstance(value, tuple)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    return isinstance(value, tp) if isinstance(tp, type) else True


def check_fields(obj: Any) -> None:
    """Check every config field of ``obj`` against its type and declared range; raise SettingError."""
    for name, (tp, meta) in config_fields(type(obj)).items():
        value = object.__getattribute__(obj, name)
        if not _fits(value, tp):
            raise SettingError(name, f"{name} expects {describe_type(tp)}, got {value!r}")
        lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open", False)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if not math.isfinite(v):  # NaN passes every range check and Inf overflows training
                raise SettingError(name, f"{name} must be a finite number, got {v!r}")
            below = lo is not None and (v <= lo if lo_open else v < lo)
            if below or (hi is not None and v > hi):
                left = "(" if lo_open else "["
                bound = (f">= {lo}" if not lo_open else f"> {lo}") if hi is None else (
                    f"<= {hi}" if lo is None else f"in {left}{lo}, {hi}]")
                raise SettingError(name, f"{name} must be {bound}, got {v!r}")


# ------------------------------------------------------------------------------------------ read tracking

_READS: set[tuple[type, str]] | None = None


@contextlib.contextmanager
def record_reads() -> Iterator[set[tuple[type, str]]]:
    """Record every (section class, field) read while the context is open (for the key-coverage test)."""
    global _READS
    previous, _READS = _READS, set()
    try:
        yield _READS
    finally:
        _READS = previous


class Settings:
    """Mixin for config sections: validates fields after ``__init__`` and records reads when asked to.

    Subclasses that need cross-field checks override ``validate`` (and call ``super().validate()``).
    """

    # fields holding a file system path: a leading ~ is the user's home, as a shell would have it (YAML files and
    # quoted overrides reach us unexpanded)
    PATH_FIELDS: typing.ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in self.PATH_FIELDS:
            value = object.__getattribute__(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))
        check_fields(self)

    def changed(self, name: str) -> bool:
        """Whether field ``name`` differs from its default; not recorded as a read (a check that a setting was left
        alone is not the job consuming it)."""
        field = self.__dataclass_fields__[name]
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        return object.__getattribute__(self, name) != default

    def __getattribute__(self, name: str) -> Any:
        if _READS is not None and not name.startswith("_"):
            cls = type(self)
            if name in config_fields(cls):
                _READS.add((cls, name))
        return object.__getattribute__(self, name)


def replace(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that does not count as reading every field (see :func:`record_reads`)."""
    kwargs = {f.name: object.__getattribute__(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return type(obj)(**(kwargs | changes))


def to_dict(obj: Any) -> Any:
    """Plain nested data of a section tree (config keys only), without recording reads."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_dict(object.__getattribute__(obj, name)) for name in config_fields(type(obj))}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
