"""Step-level returns and advantages of a diffusion value model (generalised advantage estimation over decoding
steps), as a pure, vectorised function.

The tokens of a sample that were decoded at the same denoising step form one "time step" k (steps ordered by id,
per sample). With token rewards r_i and old values V_i (read at the state just before token i's step):

    r*_k = mean(r_i : step k),  V*_k = mean(V_i : step k)
    R*_k = r*_k + gamma R*_{k+1}
    A*_k = (r*_k - V*_k + gamma V*_{k+1}) + gamma lam A*_{k+1}            (terminal terms 0)
    R_i  = r_i + gamma R*_{k+1}
    A_i  = (r_i - V_i) + gamma V*_{k+1} + gamma lam A*_{k+1}

so the current step uses the token's own reward and value. This is the reference's rule
(Gen-Verse/dLLM-RL train/train_trado_value.py compute_returns_and_advantages_from_fragments), computed here for a
whole batch at once: the only Python loop runs over step positions, never over tokens or samples. No whitening.

An outcome reward sits on the tokens of the sample's last step (:func:`outcome_token_rewards`); process rewards
(per token, or per chunk spread onto tokens) go through the same function.
"""

from __future__ import annotations

import torch
from torch import Tensor


def outcome_token_rewards(sample: Tensor, steps: Tensor, reward: Tensor) -> Tensor:
    """Token rewards [T]: each sample's scalar ``reward[sample]`` on the tokens of its largest step, 0 elsewhere."""
    n = int(sample.max()) + 1 if sample.numel() else 0
    last = torch.full((n,), torch.iinfo(torch.long).min, dtype=torch.long).scatter_reduce(
        0, sample, steps, reduce="amax")
    return torch.where(steps == last[sample], reward.to(torch.float32)[sample], torch.zeros((), dtype=torch.float32))


def step_gae(sample: Tensor, steps: Tensor, rewards: Tensor, values: Tensor, gamma: float = 1.0,
             lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token (advantages, returns) [T] for tokens given by ``sample`` (sample index) and ``steps`` (step id)."""
    rewards, values = rewards.to(torch.float32), values.to(torch.float32)
    if sample.numel() == 0:
        return rewards.clone(), rewards.clone()
    # one row per (sample, step) pair, sorted by sample then step
    span = int(steps.max()) - int(steps.min()) + 1
    key = sample.long() * span + (steps.long() - int(steps.min()))
    pairs, pair_of_token = torch.unique(key, sorted=True, return_inverse=True)
    count = torch.zeros(len(pairs)).index_add_(0, pair_of_token, torch.ones_like(rewards))
    r_star = torch.zeros(len(pairs)).index_add_(0, pair_of_token, rewards) / count
    v_star = torch.zeros(len(pairs)).index_add_(0, pair_of_token, values) / count
    pair_sample = torch.zeros(len(pairs), dtype=torch.long).scatter_(0, pair_of_token, sample.long())
    # the position of each pair within its sample: rows of a [samples, steps] grid
    n_samples = int(pair_sample.max()) + 1
    first = torch.full((n_samples,), len(pairs), dtype=torch.long).scatter_reduce(
        0, pair_sample, torch.arange(len(pairs)), reduce="amin")
    col = torch.arange(len(pairs)) - first[pair_sample]
    width = int(col.max()) + 1
    grid = lambda v: torch.zeros(n_samples, width + 1).index_put_((pair_sample, col), v)  # noqa: E731
    r_g, v_g = grid(r_star), grid(v_star)  # one extra zero column: the terminal step
    ret, adv = torch.zeros_like(r_g), torch.zeros_like(r_g)
    for k in range(width - 1, -1, -1):  # over step positions; every sample at once
        ret[:, k] = r_g[:, k] + gamma * ret[:, k + 1]
        adv[:, k] = r_g[:, k] - v_g[:, k] + gamma * v_g[:, k + 1] + gamma * lam * adv[:, k + 1]
    ps, pc = pair_sample[pair_of_token], col[pair_of_token]
    token_ret = rewards + gamma * ret[ps, pc + 1]
    token_adv = (rewards - values) + gamma * v_g[ps, pc + 1] + gamma * lam * adv[ps, pc + 1]
    return token_adv, token_ret
