"""SPG, sandwiched policy gradient (arXiv 2510.09541; facebookresearch/SPG spg/spg_trainer.py): the ELBO for
completions with a positive advantage, an upper bound (EUBO) or a mixture for the others; no ratio, clip or KL.

Rows (block-random masking, ``training.mask_times_per_sample`` draws per sample, SPG: 2; fresh draws every inner
iteration, SPG's mu 4): pick one response block b holding trained tokens (block models: the model's blocks at absolute
positions; full attention: blocks of the sampling block size, else 32, from the response start); the response before
b stays clean, m ~ U{1..l_b} of block b's l_b tokens are masked, every later token is masked; the prompt is noised
with ``training.prompt_mask_p`` (SPG: 0.15). A draw's t_j is its masked response tokens / |o|.
Per sample: ELBO = mean over draws of the mean log-prob of the draw's masked tokens; EUBO =
(1/beta) mean_k log P_k with P_k = mean_j 1[k masked in j] p_j(o_k)^beta / t_j over tokens masked at least once;
negative-advantage completions use w EUBO + (1 - w) ELBO (``training.eubo_weight`` w, SPG's mixture 0.5; 1 is pure
EUBO). Loss = -sum_i |o_i| A_i S_i / sum_i |o_i| over the batch; A = r - mean (``reward.advantage: dr_grpo``).
SPG's beta (``training.eubo_beta``): 1.5 for GSM8K and MATH, 1.0 for Sudoku.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from train.algorithms.base import RESPONSE, TAIL, Algorithm, BlockGeometry, Needs, Units, masked_response_full_units
from train.batch import TrainBatch
from train.loss import LossOutput
from train.samples import Sample
from train.settings import LossConfig, ViewConfig

FULL_ATTENTION_BLOCK = 32  # SPG's block length for models without blocks of their own


def block_random_masks(block_of: Tensor, trainable: Tensor, draws: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """[draws, L] masks of the response tokens (``block_of``: each token's block; ``trainable``: the tokens that
    may be picked) and [draws] first masked block; each draw masks 1..l_b random tokens of a random block b holding
    trainable tokens and every token after it."""
    candidates = torch.unique(block_of[trainable])
    if not len(candidates):  # nothing to train (a response of padding only): no draws, no rows
        return torch.zeros(0, len(block_of), dtype=torch.bool), torch.zeros(0, dtype=torch.long)
    masks, chosen = [], []
    for _ in range(draws):
        b = candidates[int(torch.randint(len(candidates), (), generator=gen))]
        inside = (block_of == b).nonzero().squeeze(1)
        count = int(torch.randint(1, len(inside) + 1, (), generator=gen))
        mask = block_of > b
        mask[inside[torch.randperm(len(inside), generator=gen)[:count]]] = True
        masks.append(mask)
        chosen.append(b)
    return torch.stack(masks), torch.stack(chosen)


def spg_scores(logp: Tensor, unit: Tensor, token: Tensor, level: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """ELBO and EUBO of ONE sample from its trained-token entries (log-prob, unit, response index, draw's t_j)."""
    units, unit_of = torch.unique(unit, return_inverse=True)
    n = len(units)
    per_unit = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add(0, unit_of, logp)
    counts = torch.bincount(unit_of, minlength=n).to(logp.dtype)
    elbo = (per_unit / counts).mean()
    tokens, token_of = torch.unique(token, return_inverse=True)
    # log P_k = log sum_j exp(beta log p_j - log t_j) - log n, summed in log space: exp(beta log p) underflows to 0
    # (log 0 = -inf, a NaN loss) once beta log p < -104 in float32
    terms = beta * logp - torch.log(level.to(logp.dtype))
    top = torch.full((len(tokens),), -torch.inf, dtype=logp.dtype, device=logp.device)
    top = top.scatter_reduce(0, token_of, terms.detach(), "amax")
    total = torch.zeros_like(top).index_add(0, token_of, torch.exp(terms - top[token_of]))
    return elbo, (top + torch.log(total) - math.log(n)).mean() / beta


class SPG(Algorithm):
    name = "spg"
    paper = "2510.09541"
    code = "facebookresearch/SPG spg/spg_trainer.py"
    needs = Needs(old_logprobs="none", reference_model="none", fresh_masks=True, whole_samples=True,
                  monte_carlo_draws="training.mask_times_per_sample")
    prompt_mask_p = 0.15

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        is_resp = geometry.kind == RESPONSE
        resp_masks, first = block_random_masks(geometry.block[is_resp], geometry.trainable[is_resp],
                                               cfg.mask_times_per_sample, gen)
        masked = (geometry.kind == TAIL)[None].repeat(len(resp_masks), 1)
        masked[:, is_resp] = resp_masks
        level = (resp_masks.sum(1, keepdim=True) / max(int(is_resp.sum()), 1)).expand(masked.shape).clone().float()
        trained = masked & (is_resp & geometry.trainable)[None]
        in_copy = (geometry.block[None] >= first[:, None]) & (geometry.block <= geometry.block[is_resp].max())[None]
        return Units(masked, trained, in_copy, geometry.steps, level)

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        block = sample.block or FULL_ATTENTION_BLOCK
        resp_masks, _ = block_random_masks(torch.arange(len(sample.resp)) // block, sample.trainable,
                                           cfg.mask_times_per_sample, gen)
        level = (resp_masks.sum(1, keepdim=True) / len(sample.resp)).expand(resp_masks.shape).clone().float()
        return masked_response_full_units(sample, resp_masks, level)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        device = logp_new.device
        sample_index, unit, token = (t.to(device) for t in (mb.sample_index, mb.unit, mb.token_index))
        level, resp_len = (mb.extra[k].to(device, logp_new.dtype) for k in ("level", "resp_len"))
        advantages = mb.advantages.to(device, logp_new.dtype)
        total_len = mb.extra["batch_resp_len"][0] if mb.num_tokens else 1.0
        loss = logp_new.new_zeros(())
        for sample in torch.unique(sample_index).tolist():
            sel = sample_index == sample
            elbo, eubo = spg_scores(logp_new[sel], unit[sel], token[sel], level[sel], cfg.eubo_beta)
            a = advantages[sel][0]
            score = elbo if a > 0 else cfg.eubo_weight * eubo + (1 - cfg.eubo_weight) * elbo
            loss = loss - resp_len[sel][0] * a * score / total_len
        value = float(loss.detach())
        return LossOutput(loss, {"loss": value, "policy_loss": value, "tokens": float(len(logp_new))})


ALGORITHM = SPG()
