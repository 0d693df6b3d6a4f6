"""VRPO, variance-reduced preference optimisation (LLaDA 1.5, arXiv 2505.19223; DARE verl llada_dp_actor_vrpo.py;
the official code is not public): DPO on ELBO estimates.

Pairs: within a prompt group, every response with a positive advantage (chosen, y_w) against every response with a
negative one (rejected, y_l); in an RL job that is correct vs wrong completions of the same task (online), and an
offline preference set is a group of two with advantages +1 / -1. Per response, ``training.mask_times_per_sample``
(VRPO's n, DARE: 4) masks with stratified mask counts; B = the mean over them of sum over masked tokens of log p / t,
divided by the response length (DARE's choice). The policy and the frozen reference score the very same rows, so their
estimates share timesteps and masks (VRPO's antithetic sampling). Loss per pair: -log sigmoid(beta [(B(y_w) -
B_ref(y_w)) - (B(y_l) - B_ref(y_l))]) with beta = ``training.preference_beta`` (DARE: 0.2), averaged over a group's
pairs, then over the batch's groups. The reference model is always loaded (a copy of the starting policy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from train.algorithms.base import Needs, ResponseMasking, stratified_masks
from train.algorithms.sequence_elbo import first_per_sample, per_sample_elbo
from train.batch import TrainBatch
from train.loss import LossOutput
from train.settings import LossConfig, ViewConfig


def pair_losses(margin: Tensor, group: Tensor, chosen: Tensor, rejected: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per group (sorted distinct labels): the mean over its (chosen, rejected) pairs of -log sigmoid(beta (m_w -
    m_l)), ``margin`` = B - B_ref per response; and the number of pairs per group."""
    groups = torch.unique(group)
    losses, pairs = [], []
    for g in groups.tolist():
        mine = group == g
        wins, loses = margin[mine & chosen], margin[mine & rejected]
        n = len(wins) * len(loses)
        pairs.append(n)
        # a group without a pair adds 0, still tied to the graph: a micro-batch of such groups must backpropagate
        # (zeros) like any other, or DDP's gradient all-reduce would wait for it
        losses.append(-F.logsigmoid(beta * (wins[:, None] - loses[None, :])).mean() if n else margin[mine].sum() * 0.0)
    return torch.stack(losses), torch.tensor(pairs)


class VRPO(ResponseMasking):
    name = "vrpo"
    paper = "2505.19223"
    code = "DARE (yjyddq/DARE) verl llada_dp_actor_vrpo.py"
    needs = Needs(old_logprobs="none", reference_model="required", whole_groups=True,
                  monte_carlo_draws="training.mask_times_per_sample")

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return stratified_masks(length, cfg.mask_times_per_sample, gen)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        if logp_ref is None:
            raise ValueError("vrpo scores every response against a frozen reference model; none was given")
        device, dtype = logp_new.device, logp_new.dtype
        index, unit, level = (t.to(device) for t in (mb.sample_index, mb.unit, mb.extra["level"]))
        length = first_per_sample(mb.extra["resp_len"].to(device, dtype), index)
        _, elbo = per_sample_elbo(logp_new, index, unit, level)
        _, elbo_ref = per_sample_elbo(logp_ref.to(device, dtype), index, unit, level)
        margin = (elbo - elbo_ref) / length
        advantages = first_per_sample(mb.advantages.to(device, dtype), index)
        group = first_per_sample(mb.extra["group"].to(device), index)
        per_group, pairs = pair_losses(margin, group, advantages > 0, advantages < 0, cfg.preference_beta)
        batch_groups = float(mb.extra["batch_groups"][0]) if mb.num_tokens else 1.0
        loss = per_group.sum() / batch_groups
        value = float(loss.detach())
        return LossOutput(loss, {"loss": value, "policy_loss": value, "tokens": float(len(logp_new)),
                                 "pairs": float(pairs.sum())})


ALGORITHM = VRPO()
