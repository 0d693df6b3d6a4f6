"""The clipped policy-gradient loss on trained tokens (Gen-Verse/dLLM-RL train/rl_trado.py forward_process; one loss for
every view and family).

Per token: delta = clamp(logp_new - logp_old, -10, 10), ratio = exp(delta),
surr = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A); KL to the old policy with weight ``beta`` (k3:
exp(clamp(-d, -10, 10)) - 1 + d, or the plain log-ratio d), optionally KL to a frozen reference model with weight
``ref_beta``. loss = -sum(w * surr) + beta * sum(w * kl) + ref_beta * sum(w * kl_ref). The weights w already hold
the normalisation (see train/views.py), so summing micro-batch losses gives the step loss. The reference's
full-attention loss (train/rl_dream.py: no clamp, unnormalised KL) is not reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from train.settings import LossConfig

LOG_RATIO_CLAMP = 10.0


def kl_estimate(logp_new: Tensor, logp_anchor: Tensor, k3: bool = True) -> Tensor:
    """Per-token estimate of KL(new || anchor) from samples of new's own tokens (k3, or the plain log-ratio)."""
    d = logp_new - logp_anchor
    if not k3:
        return d
    return torch.exp(torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1 + d


@dataclass
class LossOutput:
    loss: Tensor
    metrics: dict[str, float]  # sums over tokens (divide by "tokens" for means) and the loss parts


def per_group_mean(values: Tensor, group: Tensor) -> Tensor:
    """Each element replaced by the mean of its group's elements (``group``: any integer labels)."""
    _, inverse = torch.unique(group.to(values.device), return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, inverse, values)
    counts = torch.bincount(inverse, minlength=n).to(values.dtype)
    return (sums / counts)[inverse]


def policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, weights: Tensor, cfg: LossConfig,
                logp_ref: Tensor | None = None, sequences: Tensor | None = None) -> LossOutput:
    """Weighted clipped surrogate + KL terms over T trained tokens (all inputs [T]).

    ``sequences`` (the sample of each token): GSPO's sequence ratio (arXiv 2507.18071), exp of the mean log-ratio
    over the sample's trained tokens, replaces every token's ratio (the micro-batch holds whole samples)."""
    logp_old, advantages, weights = (t.to(logp_new.device, logp_new.dtype) for t in (logp_old, advantages, weights))
    eps_high = cfg.eps if cfg.eps_high is None else cfg.eps_high
    log_ratio = torch.clamp(logp_new - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if sequences is not None:
        log_ratio = per_group_mean(log_ratio, sequences)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - cfg.eps, 1 + eps_high)
    surr = torch.minimum(ratio * advantages, clipped * advantages)
    pg = -(weights * surr).sum()
    kl = kl_estimate(logp_new, logp_old, cfg.use_kl_estimator_k3)
    loss = pg + cfg.beta * (weights * kl).sum() if cfg.beta else pg
    ref_kl = None
    if cfg.ref_beta and logp_ref is not None:
        ref_kl = kl_estimate(logp_new, logp_ref.to(logp_new.device, logp_new.dtype), cfg.use_kl_estimator_k3)
        loss = loss + cfg.ref_beta * (weights * ref_kl).sum()
    with torch.no_grad():
        names = ["loss", "policy_loss", "kl_loss", "tokens", "ratio_sum", "clip_count", "approx_kl_sum"]
        values = [loss, pg, cfg.beta * (weights * kl).sum(), torch.tensor(float(ratio.numel())), ratio.sum(),
                  ((ratio < 1 - cfg.eps) | (ratio > 1 + eps_high)).sum(), kl_estimate(logp_new, logp_old).sum()]
        if ref_kl is not None:
            names.append("ref_kl_sum")
            values.append(kl_estimate(logp_new, logp_ref.to(logp_new.device, logp_new.dtype)).sum())
        stacked = torch.stack([v.detach().float().to(logp_new.device) for v in values])
        metrics = dict(zip(names, stacked.tolist()))  # one host sync per micro-batch
    return LossOutput(loss, metrics)


LOSS_KEYS = ("loss", "policy_loss", "kl_loss")  # per-process objectives (averaged over processes, not summed)
MEAN_OF_SUM = (("ratio_sum", "ratio_mean"), ("clip_count", "clip_frac"), ("approx_kl_sum", "approx_kl"),
               ("ref_kl_sum", "ref_kl"))


def sum_metrics(metrics: list[dict[str, float]], keys: list[str] | None = None) -> dict[str, float]:
    """Add micro-batch metrics key by key (``keys`` fixes the key set, so every process reports the same keys)."""
    keys = keys if keys is not None else sorted({k for m in metrics for k in m})
    return {k: sum(m.get(k, 0.0) for m in metrics) for k in keys}


def finalize_metrics(total: dict[str, float]) -> dict[str, float]:
    """Turn summed token statistics into means over the trained tokens."""
    total = dict(total)
    n = max(total.get("tokens", 0.0), 1.0)
    for key, name in MEAN_OF_SUM:
        if key in total:
            total[name] = total.pop(key) / n
    return total

