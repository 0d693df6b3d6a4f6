"""SamplingParams: every knob of the samplers, declared once; it is also the ``rollout`` section of job configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from core.schema import SettingError, Settings, bounded

if TYPE_CHECKING:
    from models.registry import Adapter

Strategy = Literal["low_confidence_static", "low_confidence_dynamic", "sequential", "entropy_bounded"]
CacheMode = Literal["none", "prefix", "dual"]
Target = Literal["confidence", "margin_confidence", "neg_entropy"]
STRATEGIES: tuple[str, ...] = Strategy.__args__
CACHE_MODES: tuple[str, ...] = CacheMode.__args__
TARGETS: tuple[str, ...] = Target.__args__
FULL_ATTENTION_BLOCK = 32  # semi-AR block of full-attention models when block_size is not set (reference default)


@dataclass
class SamplingParams(Settings):
    """How to sample a batch of prompts.

    Shared: ``max_tokens`` (response budget), ``temperature`` (0 = greedy), ``top_k`` (0 = off; 1 = greedy),
    ``top_p``, ``remasking_strategy`` with ``dynamic_threshold`` / ``eb_threshold``, stops, ``seed`` (None =
    nondeterministic), ``max_active`` (rows in flight; continuous batching), ``target`` (the score ranking
    candidates), ``alg_temp`` (> 0 samples which positions to commit), ``pad_target_penalty`` (divides the
    score of candidates equal to the pad id).

    Stops: EOS ids always stop (unless ``ignore_eos``); ``stop_token_ids=None`` adds the adapter's default
    stop ids (EOS + the chat turn end), a list replaces them (its ids stop even under ``ignore_eos``); ``stop``
    strings must each encode to one token.

    ``block_size``: block models decode blocks of this size at absolute positions (None = the model's own);
    full-attention models decode semi-autoregressive blocks of this size (None = 32). ``denoising_steps`` per
    block (block models); ``steps`` over the whole answer (full attention; None = one token per step);
    ``further_horizon`` (extra window positions after the block in prefix-cache mode).

    ``editing_threshold`` / ``max_post_steps``: token editing (LLaDA2.1, arXiv 2602.08676), block models only;
    a rewritten token's ``Trajectory.step_map`` entry is the step of its last write (``Trajectory.rewrites``).

    ``cache``: "none" recomputes the whole sequence every step (exact; the slow reference path for block
    models), "prefix" is the exact committed-block cache for block models and the Fast-dLLM prefix cache for
    full-attention models, "dual" (full attention only) also caches the suffix.

    Rules that need the model (stop strings, dual cache on a block model, steps vs blocks) are checked by
    :meth:`check_for` before sampling starts; it also refuses a setting the chosen sampler would ignore
    (``steps`` on a block model, ``max_post_steps`` without editing, ``alg_temp`` / ``target`` /
    ``pad_target_penalty`` under the sequential or entropy-bounded strategies).
    """

    # block models stop a response at the model's position limit (finish_reason "length"); full-attention models
    # denoise a fixed canvas of max_tokens (rounded up to a block) and refuse a prompt it would push past the limit
    max_tokens: int = bounded(64, 1)
    temperature: float = bounded(1.0, 0.0)
    top_k: int = bounded(0, 0)
    top_p: float = bounded(1.0, 0.0, 1.0, lo_open=True)
    remasking_strategy: Strategy = "low_confidence_static"
    dynamic_threshold: float = bounded(0.9, 0.0, 1.0)
    eb_threshold: float = bounded(0.35, 0.0)  # entropy_bounded only
    stop_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = bounded(None, -2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts
    max_active: int = bounded(256, 1)
    target: Target = "confidence"
    alg_temp: float = bounded(0.0, 0.0)
    pad_target_penalty: float = bounded(1.0, 0.0, lo_open=True)
    cache: CacheMode = "prefix"
    block_size: int | None = bounded(None, 1)
    denoising_steps: int = bounded(4, 1)  # block models: steps per block
    steps: int | None = bounded(None, 1)  # full attention: steps over the whole answer
    further_horizon: int = bounded(32, 0)
    # LLaDA2.1's token editing (block models): a decoded token of the active block is replaced when the model now
    # draws another token there with confidence > editing_threshold (None: off); after the block's last mask, up
    # to max_post_steps more forwards edit it, ending at the first that changes nothing.
    editing_threshold: float | None = bounded(None, 0.0, 1.0)
    max_post_steps: int = bounded(16, 0)
    # block models, cache "prefix": decode forwards on a fixed-capacity cache with the rows padded to a bucket, so
    # on CUDA each forward shape is captured once as a CUDA graph and replayed (on CPU the same path runs eagerly).
    # None (default): on where it applies (a block model with the prefix cache on CUDA, no host-syncing expert
    # layer; on an H100, SDAR-1.7B/4B shapes in bf16: 2.8-3.2x eager tokens/s at batch 1, 1.7-2.5x at 32,
    # 0.94-1.2x at 128, bench/gpu.py); True: on (refused where it is not built, eager where a capture cannot work);
    # False: off.
    cuda_graphs: bool | None = None
    # The sampler's compute dtype. None: the weights' own. "bfloat16": sample under bf16 autocast, the weights left
    # as loaded (an RL run's fp32 master weights, trained under training.mixed_precision bf16); on CPU the packed
    # products are bf16 copies, about half the time of fp32 ones where the CPU multiplies bf16 natively
    # (AVX512-BF16 / AMX; bench.sampler --compare-dtypes); a CPU without them (AVX-512 or AVX2 only) samples in
    # float32 instead, with a warning. Tokens and log-probs then carry bf16 rounding.
    compute_dtype: Literal["bfloat16"] | None = None

    def validate(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        super().validate()

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def block_for(self, attention: str, model_block: int | None) -> int:
        """The block size used for an adapter of ``attention`` kind whose model declares ``model_block``."""
        if self.block_size is not None:
            return self.block_size
        if attention == "block":
            if model_block is None:
                raise SettingError("block_size", "block_size must be set: the model declares no block size")
            return model_block
        return FULL_ATTENTION_BLOCK

    def check_for(self, adapter: Adapter) -> None:
        """Rules that need the model: raise SettingError (naming the field) before any sampling starts."""
        block = self.block_for(adapter.attention, adapter.block_size)
        if adapter.attention == "block":
            if self.cache == "dual":
                raise SettingError("cache", "cache 'dual' is for full-attention models; block models use "
                                            "'prefix' or 'none'")
            if self.denoising_steps > block:
                raise SettingError("denoising_steps", f"denoising_steps ({self.denoising_steps}) exceeds the block "
                                                      f"size ({block}): a step must unmask at least one token")
            if self.steps is not None:
                raise SettingError("steps", "steps counts the whole answer's steps of full-attention models; block "
                                            "models take denoising_steps per block")
            if self.cuda_graphs and self.cache == "none":
                raise SettingError("cuda_graphs", "cuda_graphs replays cached decode forwards: it needs cache "
                                                  "'prefix', not 'none'")
        else:
            if self.cuda_graphs:
                raise SettingError("cuda_graphs", "cuda_graphs is built for block models (TraDo / SDAR / LLaDA2 "
                                                  "families); full-attention samplers run without it")
            if self.editing_threshold is not None:
                raise SettingError("editing_threshold", "token editing (editing_threshold) is for block models "
                                                        "(LLaDA2.1); full-attention samplers do not edit")
            if self.changed("denoising_steps"):
                raise SettingError("denoising_steps", "denoising_steps counts the steps of each block of a block "
                                                      "model; full-attention models take steps (over the whole "
                                                      "answer; unset: one token per step)")
            n_blocks = -(-self.max_tokens // block)
            if self.steps is not None and self.steps < n_blocks:
                raise SettingError("steps", f"steps ({self.steps}) is fewer than the {n_blocks} blocks of "
                                            f"{block} tokens in max_tokens {self.max_tokens}: every block needs a step")
        self._check_no_ignored_setting()
        limit = adapter.position_limit
        if limit is not None and block > limit:
            raise SettingError("block_size", f"block_size ({block}) exceeds the model's {limit} positions")
        for text in self.stop:
            _single_token_id(adapter.tokenizer, text)

    def _check_no_ignored_setting(self) -> None:
        """Refuse a setting the chosen sampler would ignore (each named set only where it differs from its
        default: the defaults are what the sampler does anyway)."""
        if self.editing_threshold is None and self.changed("max_post_steps"):
            raise SettingError("max_post_steps", "max_post_steps bounds token editing's extra forwards: it needs "
                                                 "editing_threshold")
        if self.remasking_strategy in ("sequential", "entropy_bounded"):
            for name in ("alg_temp", "target", "pad_target_penalty"):
                if self.changed(name):
                    raise SettingError(name, f"{name} shapes the confidence-ranked choice of positions; "
                                             f"remasking_strategy {self.remasking_strategy!r} does not rank by it")

    def stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...], default_stop_ids: tuple[int, ...]) -> set[int]:
        """The set of token ids that end a response (EOS, stop ids, single-token stop strings)."""
        if self.stop_token_ids is not None:  # asked for by name: they stop even under ignore_eos (as in vLLM)
            ids = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        else:  # ignore_eos ignores the model's own ends, a turn end among its default stops too
            ids = set(default_stop_ids) - set(eos_ids) if self.ignore_eos else set(eos_ids) | set(default_stop_ids)
        for text in self.stop:
            ids.add(_single_token_id(tokenizer, text))
        return ids


def _single_token_id(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        raise SettingError("stop", f"stop string {text!r} needs a tokenizer on the adapter")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise SettingError("stop", f"stop string {text!r} is not a single token (encodes to {list(ids)}); "
                                   "stops are checked per token, use stop_token_ids or a single-token string")
    return int(ids[0])
