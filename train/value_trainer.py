"""ValueTrainer: the trainer core's views, micro-batching, accumulation and DeepSpeed handling, with values as the
outputs and the clipped value loss (only the hooks differ).

A token's value is read at its masked copy in the round where it was decoded: the state just before its decoding
step (the same row the policy's log-prob of that token comes from). The views' per-token target slot (``advantages``
for the policy) carries the returns R here, and the old values V (before any update) ride in
``extra["old_values"]``:

    loss = sum_t w_t * 0.5 * max((v - R)^2, (v_clip - R)^2),   v_clip = V + clamp(v - V, -eps, eps)

:meth:`ValueTrainer.token_values` reads the values of every trainable response token of a batch of trajectories
(for GAE); :func:`value_advantages` turns them and the samples' rewards into per-token advantages and returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from sample.trajectory import Trajectory
from train.accelerator import gather_objects
from train.batch import TrainBatch
from train.gae import outcome_token_rewards, step_gae
from train.loss import LossOutput
from train.trainer import Plan, Trainer


def value_loss(v: Tensor, v_old: Tensor, returns: Tensor, weights: Tensor, eps: float) -> LossOutput:
    """The clipped value loss over T trained tokens (weights carry the normalisation)."""
    v_old, returns, weights = (t.to(v.device, v.dtype) for t in (v_old, returns, weights))
    v_clip = v_old + torch.clamp(v - v_old, -eps, eps)
    per_token = 0.5 * torch.maximum((v - returns) ** 2, (v_clip - returns) ** 2)
    loss = (weights * per_token).sum()
    with torch.no_grad():
        stats = torch.stack([loss.detach(), torch.tensor(float(v.numel()), device=v.device),
                             (v - returns).abs().sum().detach()]).float().tolist()
    return LossOutput(loss, {"loss": stats[0], "tokens": stats[1], "value_abs_err_sum": stats[2]})


class ValueTrainer(Trainer):
    """Trains a value model (``adapter.model`` is a ``models.value.ValueModel``) on per-token returns."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.share_prompts = False  # its forward is the value model's own (train/shared_prefix.py is the policy's)

    def values(self, model: Any, mb: TrainBatch) -> Tensor:
        """fp32 values at the trained tokens' own (masked) columns."""
        mb = mb.to(self.accelerator.device)
        with self.accelerator.autocast():
            v = model(input_ids=mb.input_ids, position_ids=mb.position_ids, layout=mb.layout)
        return v[mb.rows, mb.token_cols].float()

    def compute_old_logprobs(self, plan: Plan) -> dict[str, float]:
        """The trainer's hook for old quantities: here the old values (before any update), ``extra["old_values"]``."""
        with torch.no_grad():
            self.model.eval()
            for micro in plan:
                for mb in micro:
                    # a new dict: a filler micro-batch shares its original's (trainer._equalize)
                    mb.extra = {**mb.extra, "old_values": self.values(self.model, mb).cpu()}
        return {}

    def model_outputs(self, mb: TrainBatch) -> Tensor:
        return self.values(self.model, mb)

    def loss(self, mb: TrainBatch, v: Tensor) -> LossOutput:
        returns = mb.advantages  # the views' per-token target: the returns, for a value model
        return value_loss(v, mb.extra["old_values"], returns, mb.weights, self.cfg.eps)

    def token_values(self, trajectories: Sequence[Trajectory]) -> dict[str, Tensor]:
        """Per sample id, the value of every response token at the state before its decoding step (NaN for tokens
        that are not trained, e.g. pads beyond ``post_num``); every process gets every sample's values."""
        zero = {t.sample_id: 0.0 for t in trajectories}
        batches = self.build_views(trajectories, zero)
        out: dict[str, Tensor] = {t.sample_id: torch.full((len(t.response_ids),), float("nan"))
                                  for t in trajectories}
        found = []
        # as many forwards on every process (ZeRO-3's are collective): fillers keep the count, their values unused
        plan = self._equalize([self.micro_batches(batch, 0, shuffle=False) for batch in batches])
        with torch.no_grad():
            self.model.eval()
            for micro in plan:
                for mb in micro:
                    v = self.values(self.model, mb).cpu()
                    if mb.filler:
                        continue
                    ids = [mb.sample_ids[int(i)] for i in mb.sample_index]
                    found += list(zip(ids, mb.token_index.tolist(), v.tolist(), strict=True))
        for sid, i, value in gather_objects(self.accelerator, found):
            out[sid][i] = value
        return out


def value_advantages(trajectories: Sequence[Trajectory], rewards: Mapping[str, float | Sequence[float]],
                     values: Mapping[str, Tensor], gamma: float, lam: float) -> tuple[dict, dict]:
    """Per sample id, per-token (advantages, returns) from the old values and each sample's reward: a scalar
    (outcome) is placed on the sample's last trained step, a per-token list (process reward) is used as it is,
    its entries on tokens without a value (not trained) added to the last trained step; those tokens get 0 and
    do not take part."""
    sample, steps, vals, where = [], [], [], []
    for si, t in enumerate(trajectories):
        v = values[t.sample_id]
        known = ~torch.isnan(v)
        idx = torch.nonzero(known).flatten()
        sample.append(torch.full((len(idx),), si, dtype=torch.long))
        steps.append(torch.tensor(t.step_map, dtype=torch.long)[idx])
        vals.append(v[idx])
        where.append(idx)
    s, k, v = torch.cat(sample), torch.cat(steps), torch.cat(vals)
    per_token = [isinstance(rewards[t.sample_id], Sequence) for t in trajectories]
    if all(per_token):
        full = [torch.tensor(rewards[t.sample_id], dtype=torch.float32) for t in trajectories]
        token_rewards = torch.cat([r[idx] for r, idx in zip(full, where, strict=True)])
        # rewards on tokens that are not trained (beyond training.max_gen_length, ...) are not lost: they count
        # as outcome, on the sample's last trained step
        untrained = torch.stack([r.sum() - r[idx].sum() for r, idx in zip(full, where, strict=True)])
        token_rewards = token_rewards + outcome_token_rewards(s, k, untrained)
    elif not any(per_token):
        reward = torch.tensor([float(rewards[t.sample_id]) for t in trajectories])
        token_rewards = outcome_token_rewards(s, k, reward)
    else:
        raise ValueError("rewards mix scalars and per-token lists")
    adv, ret = step_gae(s, k, token_rewards, v, gamma, lam)
    advantages, returns, offset = {}, {}, 0
    for t, idx in zip(trajectories, where, strict=True):
        a, r = torch.zeros(len(t.response_ids)), torch.zeros(len(t.response_ids))
        a[idx], r[idx] = adv[offset:offset + len(idx)], ret[offset:offset + len(idx)]
        advantages[t.sample_id], returns[t.sample_id] = a.tolist(), r.tolist()
        offset += len(idx)
    return advantages, returns
