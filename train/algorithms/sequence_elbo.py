"""Shared by the algorithms whose ratio is one per sample or draw, of a Monte-Carlo ELBO (ESPO, EBPO, BGPO, VRPO): the
per-sample ELBO estimate from a micro-batch's trained-token entries, the sequence-level clipped surrogate and its
metrics."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from train.batch import TrainBatch
from train.loss import LOG_RATIO_CLAMP, LossOutput
from train.settings import LossConfig


def per_sample_elbo(logp: Tensor, sample_index: Tensor, unit: Tensor, level: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct samples (sorted) and each one's ELBO estimate: the mean over its units of
    sum_k log p(o_k | unit) / t_k over the unit's trained tokens (t_k: the probability k was masked with)."""
    samples, sample_of = torch.unique(sample_index, return_inverse=True)
    n = len(samples)
    sums = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add(0, sample_of, logp / level.to(logp.dtype))
    units_per_sample = torch.zeros(n, dtype=logp.dtype, device=logp.device)
    units, first = torch.unique(unit, return_inverse=True)
    owner = torch.zeros(len(units), dtype=torch.long, device=logp.device).scatter_(0, first, sample_of)
    units_per_sample.index_add_(0, owner, torch.ones(len(units), dtype=logp.dtype, device=logp.device))
    return samples, sums / units_per_sample


def first_per_sample(values: Tensor, sample_index: Tensor) -> Tensor:
    """The value of each distinct sample's (sorted) first entry (a per-sample quantity stored on every token); any
    integer labels serve as ``sample_index`` (units, a sample's tokens)."""
    _, sample_of = torch.unique(sample_index, return_inverse=True)
    n = int(sample_of.max()) + 1 if sample_of.numel() else 0
    index = torch.zeros(n, dtype=torch.long, device=values.device).scatter_reduce(
        0, sample_of, torch.arange(len(sample_of), device=values.device), "amin", include_self=False)
    return values[index]


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, eps: float, eps_high: float | None) -> tuple[Tensor,
                                                                                                           Tensor]:
    """min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) per sample and the ratios rho = exp(clamped log-ratio)."""
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    high = eps if eps_high is None else eps_high
    return torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - eps, 1 + high) * advantages), ratio


def sequence_metrics(loss: Tensor, pg: Tensor, ratio: Tensor, cfg: LossConfig) -> dict[str, float]:
    """Loss parts and ratio statistics of a sequence-level loss (``tokens`` counts samples here)."""
    high = cfg.eps if cfg.eps_high is None else cfg.eps_high
    values = torch.stack([loss.detach(), pg.detach(), ratio.detach().sum(),
                          ((ratio < 1 - cfg.eps) | (ratio > 1 + high)).sum().to(ratio.dtype)]).tolist()
    return {"loss": values[0], "policy_loss": values[1], "ratio_sum": values[2], "clip_count": values[3],
            "tokens": float(len(ratio))}


def elbo_ratio_loss(logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None,
                    per_token: bool, reference_penalty: Callable[[Tensor, Tensor, Tensor], Tensor]) -> LossOutput:
    """-(1/B) sum_i min(rho A, clip(rho) A) + ref_beta (1/B) sum_i penalty(E, E_ref, L) over the micro-batch's samples
    (B: the batch's samples), with rho = exp(E - E_old) of the per-sample ELBO E, divided by the response length L
    first when ``per_token``."""
    device, dtype = logp_new.device, logp_new.dtype
    index, unit, level = (t.to(device) for t in (mb.sample_index, mb.unit, mb.extra["level"]))
    _, elbo = per_sample_elbo(logp_new, index, unit, level)
    with torch.no_grad():
        _, elbo_old = per_sample_elbo(mb.old_logprobs.to(device, dtype), index, unit, level)
    length = first_per_sample(mb.extra["resp_len"].to(device, dtype), index)
    advantages = first_per_sample(mb.advantages.to(device, dtype), index)
    log_ratio = (elbo - elbo_old) / length if per_token else elbo - elbo_old
    surrogate, ratio = clipped_surrogate(log_ratio, advantages, cfg.eps, cfg.eps_high)
    # the step's samples (over every process, / world: data parallelism averages the processes' gradients)
    per_sample = 1.0 / float(mb.extra["batch_samples"][0]) if mb.num_tokens else 1.0
    pg = -(surrogate * per_sample).sum()
    loss = pg
    if cfg.ref_beta and logp_ref is not None:
        _, elbo_ref = per_sample_elbo(logp_ref.to(device, dtype), index, unit, level)
        loss = loss + cfg.ref_beta * per_sample * reference_penalty(elbo, elbo_ref, length).sum()
    return LossOutput(loss, sequence_metrics(loss, pg, ratio, cfg))
