"""`generate`: the sampling entry point for every model family (dispatch on ``adapter.attention`` only)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from sample.block_sampler import BlockSampler, SamplerStats
from sample.full_sampler import FullSampler
from sample.params import SamplingParams
from sample.trajectory import Trajectory

Prompt = Sequence[int] | str | Sequence[dict]


@dataclass
class RolloutStats:
    """Throughput of one ``generate`` call."""

    forwards: int  # model forward calls (prefill, denoise, commit, cache refresh)
    denoise_forwards: int
    generated_tokens: int  # response tokens (tails excluded)
    wall_time: float  # seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second,
                "tokens_per_forward": self.tokens_per_forward}


class Rollout(list[Trajectory]):
    """The trajectories of a ``generate`` call, in prompt order, plus ``stats``."""

    def __init__(self, trajectories: list[Trajectory], stats: RolloutStats):
        super().__init__(trajectories)
        self.stats = stats


def encode_prompt(adapter: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt given as ids, as one user turn (str), or as chat messages (list of dicts)."""
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], dict)):
        if adapter.tokenizer is None:
            raise ValueError("chat prompts need a tokenizer on the adapter; pass token ids instead")
        return adapter.encode_chat(prompt)
    return [int(t) for t in prompt]


def generate(adapter: Any, prompts: Sequence[Prompt] | str, params: SamplingParams | None = None,
             progress: bool = True) -> Rollout:
    """Sample one response per prompt with any adapter (block or full attention); see sample/*_sampler.py."""
    params = params or SamplingParams()
    if isinstance(prompts, str):
        prompts = [prompts]
    ids = [encode_prompt(adapter, p) for p in prompts]
    stop_ids = params.stop_ids(adapter.tokenizer, tuple(adapter.eos_ids), tuple(adapter.stop_ids))
    limit = getattr(adapter.model.config, "max_position_embeddings", None)
    bar = tqdm(total=len(ids), desc="sampling", unit="prompt", disable=not progress, leave=False)
    start = time.perf_counter()
    sampler = _make_sampler(adapter, params, stop_ids, limit, _generator(adapter, params.seed))

    def on_finish(_: Trajectory) -> None:
        bar.update(1)
        bar.set_postfix(tok_s=f"{sampler.stats.generated_tokens / (time.perf_counter() - start):.1f}")

    sampler.on_finish = on_finish
    was_training = adapter.model.training
    adapter.model.eval()
    try:
        with torch.inference_mode():
            trajectories = sampler.run(ids)
    finally:
        adapter.model.train(was_training)
        bar.close()
    return Rollout(trajectories, _rollout_stats(sampler.stats, time.perf_counter() - start))


def _make_sampler(adapter: Any, params: SamplingParams, stop_ids: set[int], limit: int | None,
                  generator: torch.Generator) -> BlockSampler | FullSampler:
    if adapter.attention == "block":
        return BlockSampler(adapter, params, stop_ids, limit, generator)
    if adapter.attention == "full":
        return FullSampler(adapter, params, stop_ids, limit, generator)
    raise ValueError(f"adapter.attention must be 'block' or 'full', got {adapter.attention!r}")


def _generator(adapter: Any, seed: int | None) -> torch.Generator:
    device = next(adapter.model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _rollout_stats(stats: SamplerStats, wall_time: float) -> RolloutStats:
    return RolloutStats(forwards=stats.forwards, denoise_forwards=stats.denoise_forwards,
                        generated_tokens=stats.generated_tokens, wall_time=wall_time)
