"""Training algorithms by name: ``training.method`` selects one (its module in this folder, named after it).

Each module defines ``ALGORITHM``, a :class:`train.algorithms.base.Algorithm`: how a trajectory becomes rows (the
view's units), the loss, what the algorithm needs (old log-probs, a reference model, inner iterations, Monte-Carlo
draws), and the families it refuses. This registry is torch-free, so configs are checked before heavy imports: it
holds each name, its aliases and whether it can serve the value model; the module is imported on first use.

Adding an algorithm = one new file here + one line in ``REGISTRY`` (docs/architecture.md, "Adding an algorithm").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    """What config loading needs to know of an algorithm, without importing it."""

    module: str  # the module (in train/algorithms/) that defines ALGORITHM
    aliases: tuple[str, ...] = ()  # other accepted spellings of ``training.method`` (case-insensitive)
    value_model: bool = False  # can train with the value model (model.value_base_model)
    display: str = ""  # the name error messages show (default: the registry name)
    advantages: tuple[str, ...] = ()  # the reward.advantage choices its paper's estimator allows (empty: any)
    rl: bool = True  # an RL method (False: SFT only)


REGISTRY: dict[str, Entry] = {
    "tracerl": Entry("train.algorithms.tracerl", aliases=("trace_rl",), value_model=True, display="TraceRL"),
    "random_masking": Entry("train.algorithms.random_masking"),
    "coupled": Entry("train.algorithms.coupled"),
    "semi_ar": Entry("train.algorithms.semi_ar", rl=False),
    "ar": Entry("train.algorithms.ar", rl=False),
}

METHODS = tuple(REGISTRY)
RL_METHODS = tuple(name for name, entry in REGISTRY.items() if entry.rl)
_BY_SPELLING = {spelling: name for name, entry in REGISTRY.items() for spelling in (name, *entry.aliases)}


def canonical_method(method: object) -> str | None:
    """The registry name of a ``training.method`` value (any case, any alias), or None when unknown."""
    return _BY_SPELLING.get(str(method).lower())


def method_choices() -> str:
    """The accepted names, as error messages list them."""
    return ", ".join(entry.display or name for name, entry in REGISTRY.items())


def value_model_refusal(method: str) -> str:
    """One line saying why ``method`` cannot train with the value model ("" when it can)."""
    if REGISTRY[method].value_model:
        return ""
    return (f"training.method {method!r} cannot train with the value model (model.value_base_model): a token's value "
            "is read at the state before its decoding step, which only TraceRL's rows reproduce")


def rl_refusal(method: str) -> str:
    """One line saying why ``method`` cannot be an RL job's training method ("" when it can)."""
    if REGISTRY[method].rl:
        return ""
    return (f"training.method {method!r} is an SFT method; RL methods: "
            f"{', '.join(REGISTRY[name].display or name for name in RL_METHODS)}")


def default_advantage(method: str) -> str:
    """The reward.advantage an algorithm uses when the config leaves it unset: its paper's, else GRPO's z-score."""
    allowed = REGISTRY[method].advantages
    return allowed[0] if allowed else "grpo"


def advantage_refusal(method: str, advantage: str) -> str:
    """One line saying why ``method`` refuses the group baseline ``advantage`` ("" when it accepts it)."""
    allowed = REGISTRY[method].advantages
    if not allowed or advantage in allowed:
        return ""
    return (f"reward.advantage {advantage!r} contradicts training.method {method!r}, whose estimator uses "
            f"{' or '.join(allowed)}")


def algorithm(method: str) -> Any:
    """The algorithm registered as ``method`` (a registry name or alias): a train.algorithms.base.Algorithm, not
    imported here, so this registry stays below the algorithms it names."""
    name = canonical_method(method)
    if name is None:
        raise ValueError(f"unknown training method {method!r}; expected one of {method_choices()}")
    return importlib.import_module(REGISTRY[name].module).ALGORITHM
