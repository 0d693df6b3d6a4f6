"""SamplingParams: every knob of the samplers, validated once, with the reference defaults (REFERENCE 3.3.7, 14)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("low_confidence_static", "low_confidence_dynamic", "sequential", "entropy_bounded")
CACHE_MODES = ("none", "prefix", "dual")
TARGETS = ("confidence", "margin_confidence", "neg_entropy")


@dataclass
class SamplingParams:
    """How to sample a batch of prompts.

    Shared: ``max_tokens`` (response budget), ``temperature`` (0 = greedy), ``top_k`` (0 = off; 1 = greedy),
    ``top_p``, ``remasking_strategy`` with ``dynamic_threshold`` / ``eb_threshold``, stops, ``seed`` (None =
    nondeterministic), ``max_active`` (rows in flight; continuous batching), ``target`` (the score ranking
    candidates), ``alg_temp`` (> 0 samples which positions to commit), ``pad_target_penalty`` (divides the
    score of candidates equal to the pad id).

    Stops: EOS ids always stop (unless ``ignore_eos``); ``stop_token_ids=None`` adds the adapter's default
    stop ids (EOS + the chat turn end), a list replaces them; ``stop`` strings must each encode to one token.

    Block models (attention "block"): ``block_size`` (None = the model's), ``denoising_steps`` per block.
    Full-attention models: ``block_length``, ``steps`` over the whole answer (None = one token per step),
    ``further_horizon`` (extra window positions after the block in prefix-cache mode).

    ``cache``: "none" recomputes the whole sequence every step (exact; the slow reference path for block
    models), "prefix" is the exact committed-block cache for block models and the Fast-dLLM prefix cache for
    full-attention models, "dual" (full attention only) also caches the suffix. ``use_cache=False`` is the
    reference config's spelling of ``cache="none"``.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    remasking_strategy: str = "low_confidence_static"
    dynamic_threshold: float = 0.9
    eb_threshold: float = 0.35
    stop_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    max_active: int = 256
    target: str = "confidence"
    alg_temp: float = 0.0
    pad_target_penalty: float = 1.0
    cache: str = "prefix"
    use_cache: bool = True
    # block models
    block_size: int | None = None
    denoising_steps: int = 4
    # full-attention models
    block_length: int = 32
    steps: int | None = None
    further_horizon: int = 32

    def __post_init__(self) -> None:
        if not self.use_cache:
            self.cache = "none"
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(i) for i in self.stop_token_ids]
        _check_choice("remasking_strategy", self.remasking_strategy, STRATEGIES)
        _check_choice("cache", self.cache, CACHE_MODES)
        _check_choice("target", self.target, TARGETS)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("top_k", self.top_k, 0)
        _check_int("max_active", self.max_active, 1)
        _check_int("denoising_steps", self.denoising_steps, 1)
        _check_int("block_length", self.block_length, 1)
        _check_int("further_horizon", self.further_horizon, 0)
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1)
        if self.steps is not None:
            _check_int("steps", self.steps, 1)
        _check_range("temperature", self.temperature, 0.0, None)
        _check_range("alg_temp", self.alg_temp, 0.0, None)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_range("dynamic_threshold", self.dynamic_threshold, 0.0, 1.0)
        _check_range("eb_threshold", self.eb_threshold, 0.0, None)
        if not self.pad_target_penalty > 0:
            raise ValueError(f"SamplingParams.pad_target_penalty must be > 0, got {self.pad_target_penalty}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...], default_stop_ids: tuple[int, ...]) -> set[int]:
        """The set of token ids that end a response (EOS, stop ids, single-token stop strings)."""
        ids = set() if self.ignore_eos else set(eos_ids)
        ids |= set(default_stop_ids if self.stop_token_ids is None else self.stop_token_ids)
        if self.ignore_eos:
            ids -= set(eos_ids)
        for text in self.stop:
            ids.add(_single_token_id(tokenizer, text))
        return ids


def _single_token_id(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        raise ValueError(f"stop string {text!r} needs a tokenizer on the adapter")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"stop string {text!r} is not a single token (encodes to {list(ids)}); "
                         "stops are checked per token, use stop_token_ids or a single-token string")
    return int(ids[0])


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"SamplingParams.{name} must be one of {list(choices)}, got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SamplingParams.{name} must be an integer >= {low}, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float | None) -> None:
    if not isinstance(value, int | float) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {value!r}")
