"""Trajectories -> the samples a training view is built from: filtered, truncated, as tensors.

Filtering: a prompt longer than ``max_prompt_len`` drops its trajectory (reported in ``TrainBatch.dropped``);
advantages are looked up by ``sample_id``, so no other sample shifts (the reference indexes rewards by row after
dropping rows, Gen-Verse/dLLM-RL train/rl_trado.py). ``max_gen_length`` cuts responses with their step maps; for
block models the cut tokens of the last kept block stay as masked/visible context (still exact), for full attention
they are dropped (the view is then marked inexact).

``post_num``: responses are cut at their stop token, so the generated stop token is always trained (the reference drops
it, since its pad id is the EOS). ``post_num`` only limits the other pad-id tokens of a response: the first ``post_num``
of them (counted left to right over the whole response, not per row) are trained, later ones stay in the input as
context but are not trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sample.trajectory import Trajectory
from train.settings import ViewConfig

if TYPE_CHECKING:
    from train.traits import ModelTraits


@dataclass
class Sample:
    """One trajectory after filtering/truncation, as tensors."""

    sample_id: str
    prompt: Tensor
    resp: Tensor
    steps: Tensor
    tail: Tensor
    tail_steps: Tensor
    logp: Tensor
    adv: Tensor
    trainable: Tensor  # [L] bool, after post_num
    truncated: bool
    block: int | None = None  # block size the sample was decoded with (block models)
    group_id: str = ""  # its prompt's group (responses to one task share it)
    rewritten: bool = False  # token editing rewrote some token: the sampler's states are not rebuilt exactly
    cached_logp: bool = False  # its log-probs came from an approximating cache (Trajectory.cached_logprobs)


def prepare_samples(trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                    cfg: ViewConfig, traits: ModelTraits) -> tuple[list[Sample], list[tuple[str, str]]]:
    """Filter (over-long prompt, empty response), truncate and attach advantages BY sample_id (the reference indexes
    rewards by row after dropping rows, Gen-Verse/dLLM-RL train/rl_trado.py)."""
    seen: set[str] = set()
    samples, dropped = [], []
    for traj in trajectories:
        sample_id = traj.sample_id
        if sample_id in seen:
            raise ValueError(f"duplicate sample_id {sample_id!r} in the trajectory batch")
        seen.add(sample_id)
        if sample_id not in advantages:
            raise ValueError(f"no advantage for sample_id {sample_id!r}")
        reason = _drop_reason(traj, cfg, traits)
        if reason:
            dropped.append((sample_id, reason))
            continue
        samples.append(_prepare_one(traj, advantages[sample_id], cfg, traits))
    return samples, dropped


def _drop_reason(traj: Trajectory, cfg: ViewConfig, traits: ModelTraits) -> str:
    if cfg.max_prompt_len is not None and len(traj.prompt_ids) > cfg.max_prompt_len:
        return f"prompt has {len(traj.prompt_ids)} tokens > max_prompt_len {cfg.max_prompt_len}"
    if not traj.response_ids:
        return "empty response"
    if min(traj.step_map + traj.tail_steps) < 1:
        raise ValueError(f"trajectory {traj.sample_id!r}: step ids must be >= 1 (1-based)")
    return ""


def _prepare_one(traj: Trajectory, adv: float | Sequence[float], cfg: ViewConfig, traits: ModelTraits) -> Sample:
    fields = {name: torch.tensor(getattr(traj, name), dtype=torch.long)
              for name in ("prompt_ids", "response_ids", "step_map", "tail_ids", "tail_steps")}
    resp, steps, tail, tail_steps = fields["response_ids"], fields["step_map"], fields["tail_ids"], fields["tail_steps"]
    adv_vector = _advantage_vector(traj, adv)
    # not recorded (SFT data): NaN, the old log-probs a view cannot reproduce (only losses that need none train on it)
    logp = (torch.tensor(traj.logprobs, dtype=torch.float32) if traj.logprobs
            else torch.full((len(resp),), float("nan")))
    kept = len(resp) if cfg.max_gen_length is None else min(len(resp), cfg.max_gen_length)
    truncated = kept < len(resp)
    if truncated:  # cut tokens stay context (tail) for block models; full attention drops them (view inexact)
        keep_cut = traits.attention == "block"
        tail = torch.cat([resp[kept:], tail]) if keep_cut else tail[:0]
        tail_steps = torch.cat([steps[kept:], tail_steps]) if keep_cut else tail_steps[:0]
        resp, steps, adv_vector, logp = resp[:kept], steps[:kept], adv_vector[:kept], logp[:kept]
    prompt = fields["prompt_ids"]
    # Block models train on the blocks the sample was decoded with (the sampling block size may differ from the
    # model's own, e.g. when TraceRL adapts a block-4 model to block 8).
    block = traj.block_size or traits.block_size  # (full attention: the semi-AR block of SFT, else unused)
    if traits.attention == "block":  # the tail only matters inside the final response block
        end = ((len(prompt) + kept - 1) // block + 1) * block
        keep = max(end - len(prompt) - kept, 0)
        tail, tail_steps = tail[:keep], tail_steps[:keep]
    stop = traj.finish_reason in ("eos", "stop") and not truncated  # the sampler cut right after the stop token
    trainable = _trainable(resp, traits.pad_id, cfg.post_num, stop)
    return Sample(traj.sample_id, prompt, resp, steps, tail, tail_steps, logp, adv_vector, trainable, truncated,
                  block, traj.group_id or traj.sample_id, any(traj.rewrites), traj.cached_logprobs)


def _advantage_vector(traj: Trajectory, adv: float | Sequence[float]) -> Tensor:
    """The sample's scalar advantage on every response token, or its per-token advantages (value model)."""
    length = len(traj.response_ids)
    vec = torch.as_tensor(adv, dtype=torch.float32)
    if vec.dim() == 0:
        return vec.expand(length).clone()
    vec = vec.flatten()
    if vec.numel() != length:
        raise ValueError(f"sample {traj.sample_id!r}: per-token advantages have {vec.numel()} values for {length} "
                         "response tokens")
    return vec


def _trainable(resp: Tensor, pad_id: int, post_num: int, ends_with_stop: bool) -> Tensor:
    """Response tokens that may be trained: all but pad-id tokens beyond the first ``post_num`` (stop excluded)."""
    is_pad = resp == pad_id
    if ends_with_stop:
        is_pad[-1] = False
    return ~is_pad | (torch.cumsum(is_pad.long(), 0) <= post_num)
