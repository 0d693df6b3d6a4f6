"""`generate`: the sampling entry point for every model family (dispatch on ``adapter.attention`` only)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from models.layers import cpu_bf16_emulated, packed_projections
from models.lora import merged_for_sampling
from sample.block_sampler import BlockSampler
from sample.engine import RolloutStats, run_engine
from sample.full_sampler import FullSampler, WindowCachedFullSampler
from sample.params import SamplingParams
from sample.trajectory import Trajectory

if TYPE_CHECKING:
    from models.registry import Adapter

__all__ = ["Rollout", "RolloutStats", "compute_precision", "encode_prompt", "generate", "make_sampler",
           "sampling_dtype", "seeded_generator"]

Prompt = Sequence[int] | str | Sequence[dict]


class Rollout(list[Trajectory]):
    """The trajectories of a ``generate`` call, in prompt order, plus ``stats``."""

    def __init__(self, trajectories: list[Trajectory], stats: RolloutStats):
        super().__init__(trajectories)
        self.stats = stats


def encode_prompt(adapter: Adapter, prompt: Prompt) -> list[int]:
    """Token ids of a prompt given as ids, as one user turn (str), or as chat messages (list of dicts)."""
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    ids = list(prompt) if hasattr(prompt, "__iter__") and not isinstance(prompt, (str, dict)) else None
    if isinstance(prompt, str) or (ids and isinstance(ids[0], dict)):
        if adapter.tokenizer is None:
            raise ValueError("chat prompts need a tokenizer on the adapter; pass token ids instead")
        return adapter.encode_chat(prompt)
    bad = [] if ids is None else [t for t in ids if not isinstance(t, Integral)]
    if ids is None or bad:
        raise TypeError(f"a prompt is a text, a list of token ids or a list of chat messages; got "
                        f"{type(prompt).__name__}{' holding ' + type(bad[0]).__name__ if bad else ''}")
    return [int(t) for t in ids]


def _one_prompt(prompts: Any) -> bool:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompts as a tensor: one prompt (1-D) or one per row (2-D), got {prompts.dim()}-D")
        return prompts.dim() == 1
    if isinstance(prompts, str):
        return True
    first = next(iter(prompts), None)
    return isinstance(first, (Integral, dict))


def generate(adapter: Adapter, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | None = None,
             progress: bool = True) -> Rollout:
    """Sample one response per prompt with any adapter (block or full attention); see sample/*_sampler.py."""
    params = sampling_params(params)
    params.check_for(adapter)  # settings this model cannot honour are refused, never silently ignored
    if isinstance(prompts, Iterator):  # looked at twice below
        prompts = list(prompts)
    if _one_prompt(prompts):  # a text, a 1-D tensor or list of ids, or one chat's messages: a batch of one
        prompts = [prompts]
    ids = [encode_prompt(adapter, p) for p in prompts]
    check_token_ids(adapter, ids)
    stop_ids = params.stop_ids(adapter.tokenizer, tuple(adapter.eos_ids), tuple(adapter.stop_ids))
    limit = adapter.position_limit
    bar = tqdm(total=len(ids), desc="sampling", unit="prompt", disable=not progress, leave=False)
    start = time.perf_counter()
    sampler = make_sampler(adapter, params, stop_ids, limit, seeded_generator(adapter, params.seed))

    def on_finish(_: Trajectory) -> None:
        bar.update(1)
        bar.set_postfix(tok_s=f"{sampler.stats.generated_tokens / (time.perf_counter() - start):.1f}")

    was_training = adapter.model.training
    adapter.model.eval()
    try:
        # packing first: on CPU it holds the base weights (the model's own parked) with the adapters beside them,
        # and merging copies only what it does not
        with compute_precision(adapter, params), packed_projections(adapter.model, park=True), \
                merged_for_sampling(adapter.model), torch.inference_mode():
            trajectories = run_engine(sampler, ids, params.max_active, adapter.tokenizer, on_finish)
    finally:
        adapter.model.train(was_training)
        bar.close()
    sampler.stats.wall_time = time.perf_counter() - start
    return Rollout(trajectories, sampler.stats)


def sampling_params(params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """``params`` as SamplingParams: None is the defaults, a mapping holds its fields (checked as the class does)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, Mapping):
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(SamplingParams)})
        if unknown:
            raise TypeError(f"unknown sampling setting {unknown[0]!r} (the fields of sample.params.SamplingParams)")
        return SamplingParams(**params)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params is a SamplingParams or a dict of its fields, got {type(params).__name__}")
    return params


def check_token_ids(adapter: Adapter, prompts: list[list[int]]) -> None:
    """A clear error for a prompt holding an id the model has no embedding for (torch says only 'index out of
    range')."""
    rows = adapter.model.get_input_embeddings().num_embeddings
    for index, prompt in enumerate(prompts):
        bad = next((t for t in prompt if not 0 <= t < rows), None)
        if bad is not None:
            raise ValueError(f"prompt {index} holds token id {bad}, outside the model's vocabulary (ids 0 to "
                             f"{rows - 1})")


def compute_precision(adapter: Adapter, params: SamplingParams) -> contextlib.AbstractContextManager:
    """Autocast to ``params.compute_dtype`` on the model's device (entered before the packing, which follows it);
    nothing when it is None, or bf16 on a CPU without native bf16 products (with a warning)."""
    dtype = sampling_dtype(adapter, params)
    weights = next(adapter.model.parameters())
    return contextlib.nullcontext() if dtype is None else torch.autocast(weights.device.type, dtype=dtype)


def sampling_dtype(adapter: Adapter, params: SamplingParams) -> torch.dtype | None:
    """The dtype sampling autocasts to, None for the weights' own (see :func:`compute_precision`)."""
    if params.compute_dtype is None:
        return None
    if next(adapter.model.parameters()).device.type == "cpu" and \
            cpu_bf16_emulated(f"rollout.compute_dtype={params.compute_dtype}"):
        return None
    return getattr(torch, params.compute_dtype)


def make_sampler(adapter: Adapter, params: SamplingParams, stop_ids: set[int], limit: int | None,
                 generator: torch.Generator) -> BlockSampler | FullSampler:
    """The sampler of the adapter's attention kind (``generate`` and the server's settings groups)."""
    if adapter.attention == "block":
        return BlockSampler(adapter, params, stop_ids, limit, generator)
    if adapter.attention == "full":
        sampler = FullSampler if params.cache == "none" else WindowCachedFullSampler
        return sampler(adapter, params, stop_ids, limit, generator)
    raise ValueError(f"adapter.attention must be 'block' or 'full', got {adapter.attention!r}")


def longest_prompt(adapter: Adapter, params: SamplingParams) -> int | None:
    """The longest prompt (in tokens) ``generate`` samples with these settings; None: the model sets no limit."""
    limit = adapter.position_limit
    if limit is None:
        return None
    if adapter.attention == "block":
        return BlockSampler.longest_prompt(params.block_size or adapter.block_size, limit)
    return limit - FullSampler.canvas(params)


def seeded_generator(adapter: Adapter, seed: int | None) -> torch.Generator:
    """A generator on the model's device, seeded with ``seed`` (None: a nondeterministic seed)."""
    device = next(adapter.model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
