"""wd1 (arXiv 2507.08838; xiaohangt/wd1 wd1/trainers/rev_grpo_trainer.py): ratio-free weighted log-likelihood.

Rows as diffu-GRPO's (d1's one-step estimator: the completion fully masked, the prompt noised with
``training.prompt_mask_p`` 0.15, fresh masks every inner iteration). With A = r - mean over a prompt's group,
w+ = softmax(A) and w- = softmax(-A) over the group, the loss is sum_i (w-_i - w+_i) S(o_i), S(o) the sum of the
completion's token log-probabilities (no length normalisation); we average it over the batch's completions
(``loss_norm: unit_sum``: a sample's tokens summed, samples averaged). No old policy, ratio, clip or reference model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from sample.trajectory import Trajectory
from train.algorithms.base import Needs
from train.algorithms.diffu_grpo import DiffuGRPO
from train.batch import TrainBatch
from train.loss import LossOutput
from train.settings import LossConfig


def group_weights(advantages: Sequence[float]) -> list[float]:
    """wd1's per-completion coefficient softmax(A)_i - softmax(-A)_i over one group (sums to 0)."""
    a = torch.tensor(advantages, dtype=torch.float64)
    return (torch.softmax(a, 0) - torch.softmax(-a, 0)).tolist()


class WD1(DiffuGRPO):
    name = "wd1"
    paper = "2507.08838"
    code = "xiaohangt/wd1 wd1/trainers/rev_grpo_trainer.py"
    needs = Needs(old_logprobs="none", reference_model="none", fresh_masks=True)
    loss_norm = "unit_sum"

    def sample_advantages(self, trajectories: Sequence[Trajectory],
                          advantages: Mapping[str, float | Sequence[float]]) -> dict[str, float]:
        groups: dict[str, list[str]] = defaultdict(list)
        for traj in trajectories:
            if not isinstance(advantages[traj.sample_id], int | float):
                raise ValueError(f"wd1 weighs whole completions; sample {traj.sample_id!r} has per-token advantages")
            groups[traj.group_id or traj.sample_id].append(traj.sample_id)
        out = {}
        for members in groups.values():
            out.update(zip(members, group_weights([float(advantages[m]) for m in members])))
        return out

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        coef, weights = (t.to(logp_new.device, logp_new.dtype) for t in (mb.advantages, mb.weights))
        loss = -(weights * coef * logp_new).sum()
        metrics = {"loss": float(loss.detach()), "policy_loss": float(loss.detach()), "tokens": float(len(logp_new))}
        return LossOutput(loss, metrics)


ALGORITHM = WD1()
