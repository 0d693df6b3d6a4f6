"""What an algorithm gives the shared view machinery (train/views.py): units of a sample, a loss, its needs.

A **unit** is one per-round row of a sample: which of its tokens are masked, which are trained, which blocks it
copies (block models) and with which probability each token was masked. The view machinery turns units into rows
(packed or per-round for block models, one row per unit for full attention), numbers them over the batch and
normalises the loss weights; an algorithm only decides the units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from train.algorithms import attention_refusal
from train.layouts import Segment
from train.loss import LossOutput, policy_loss
from train.samples import Sample
from train.settings import LossConfig, ViewConfig

if TYPE_CHECKING:
    from sample.trajectory import Trajectory
    from train.batch import TrainBatch
    from train.traits import ModelTraits

PROMPT, RESPONSE, TAIL = 0, 1, 2  # token kinds of a block geometry


@dataclass
class Units:
    """Per unit (per-round row) of one sample: masked / trained flags over its tokens and the unit's copy set."""

    masked: Tensor  # [U, n] bool
    trained: Tensor  # [U, n] bool
    in_copy: Tensor  # [U, n] bool (block models: tokens of the blocks this unit copies)
    steps: Tensor  # [n] collapsed step of each token (0 for prompt tokens)
    level: Tensor  # [U, n] float: the probability t with which each token was masked (1 for TraceRL rounds)
    # [U, P] bool over the whole prompt: prompt tokens masked in the unit's input (None: the prompt stays clean)
    prompt_masked: Tensor | None = None

    def nonempty(self) -> Units:
        keep = self.trained.any(1)
        prompt = None if self.prompt_masked is None else self.prompt_masked[keep]
        return Units(self.masked[keep], self.trained[keep], self.in_copy[keep], self.steps, self.level[keep], prompt)


def full_attention_units(masked: Tensor, trained_response: Tensor, steps: Tensor, level: Tensor) -> Units:
    """Units of a full-attention sample over response + tail tokens: tail tokens are never trained."""
    tail_len = masked.shape[1] - trained_response.shape[1]
    trained = torch.cat([trained_response, torch.zeros(len(trained_response), tail_len, dtype=torch.bool)], 1)
    return Units(masked, trained, torch.ones_like(masked), steps, level)


def masked_response_block_units(geometry: BlockGeometry, resp_masks: Tensor, resp_level: Tensor) -> Units:
    """Block units from [D, response length] masks of the response tokens (and the probability each was masked
    with): tail tokens always masked, never trained; each unit copies every block holding response tokens."""
    is_resp = geometry.kind == RESPONSE
    masked = (geometry.kind == TAIL)[None].repeat(len(resp_masks), 1)
    masked[:, is_resp] = resp_masks
    level = torch.ones(masked.shape)
    level[:, is_resp] = resp_level
    trained = masked & (is_resp & geometry.trainable)[None]
    in_copy = torch.isin(geometry.block, geometry.block[is_resp])[None].repeat(len(masked), 1)
    return Units(masked, trained, in_copy, geometry.steps, level)


def masked_response_full_units(sample: Sample, resp_masks: Tensor, resp_level: Tensor) -> Units:
    """Full-attention units from [D, response length] masks of the response tokens: the tail always masked."""
    tail_len = len(sample.tail)
    masked = torch.cat([resp_masks, torch.ones(len(resp_masks), tail_len, dtype=torch.bool)], 1)
    level = torch.cat([resp_level, torch.ones(len(resp_masks), tail_len)], 1)
    return full_attention_units(masked, resp_masks & sample.trainable[None],
                                torch.cat([sample.steps, sample.tail_steps]), level)


def stratified_masks(length: int, draws: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """[draws, length] masks with stratified mask counts (VRPO's variance reduction, arXiv 2505.19223): draw j
    masks m_j = clamp(round((j + u) / draws * length), 1, length) uniformly chosen tokens, one u ~ U(0, 1) shared;
    and each draw's masking probability m_j / length on every token."""
    u = float(torch.rand((), generator=gen))
    counts = ((torch.arange(draws) + u) / draws * length).round().clamp(1, length).long()
    ranks = torch.rand(draws, length, generator=gen).argsort(1).argsort(1)
    masks = ranks < counts[:, None]
    return masks, (counts.float() / length)[:, None].expand(draws, length).clone()


@dataclass
class BlockGeometry:
    """Tokens of the generated blocks of one sample: prompt tail, response and tail, at absolute positions."""

    ids: Tensor
    pos: Tensor
    block: Tensor
    kind: Tensor
    steps: Tensor
    trainable: Tensor


def block_geometry(sample: Sample, block_size: int) -> BlockGeometry:
    prompt_len, resp_len, tail_len = len(sample.prompt), len(sample.resp), len(sample.tail)
    start = (prompt_len // block_size) * block_size
    prompt_tail = prompt_len - start
    pos = torch.arange(start, prompt_len + resp_len + tail_len)
    kind = torch.cat([torch.full((prompt_tail,), PROMPT), torch.full((resp_len,), RESPONSE),
                      torch.full((tail_len,), TAIL)])
    trainable = torch.cat([torch.zeros(prompt_tail, dtype=torch.bool), sample.trainable,
                           torch.zeros(tail_len, dtype=torch.bool)])
    return BlockGeometry(torch.cat([sample.prompt[start:], sample.resp, sample.tail]), pos, pos // block_size, kind,
                         torch.cat([torch.zeros(prompt_tail, dtype=torch.long), sample.steps, sample.tail_steps]),
                         trainable)


@dataclass
class Row:
    """One row's segments and its trained tokens (cols in the row, response index, local unit, step)."""

    segments: list[Segment]
    sample: int
    cols: Tensor
    resp_index: Tensor
    unit: Tensor
    steps: Tensor
    level: Tensor  # masking probability t of each trained token (1 where the view does not noise at random)
    shared_cols: int = 0  # leading columns that depend on the prompt alone (train/shared_prefix.py)


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs besides the trajectories and their advantages."""

    old_logprobs: str  # "sampler": recorded at rollout when the view is exact; "recompute": a no-grad forward; "none"
    # "optional": a frozen reference model when training.ref_beta > 0; "required": always loaded; "none"
    reference_model: str = "optional"
    inner_iterations: str = "training.num_train_epochs"  # passes over one step's rows ("" = one)
    monte_carlo_draws: str = ""  # the setting that counts random draws per sample ("" = none: deterministic units)
    # every inner iteration draws its own masks (old log-probs of every iteration computed before any update), as
    # d1's mu iterations do; False: every iteration reuses the step's rows
    fresh_masks: bool = False
    # the loss combines several trained tokens of one sample (a sequence ratio, a per-token mix of units), so a
    # micro-batch holds whole samples
    whole_samples: bool = False
    whole_groups: bool = False  # a micro-batch holds all rows of its prompt groups (losses over pairs of responses)


class Algorithm:
    """A training method. Subclasses fill in the facts and the unit builders of the families they serve."""

    name = ""
    paper = ""  # arXiv id
    code = ""  # the public code it follows
    needs = Needs(old_logprobs="recompute")
    loss_norm = "padded_length"  # training.loss_norm when the config leaves it unset
    prompt_mask_p = 0.0  # training.prompt_mask_p when unset: probability of masking each prompt token of a row
    # (train/views.py draws the prompt masks for every algorithm)
    causal = False  # its rows attend causally (AR training): no full attention for SFT's annealing to reach

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        """The RL loss of a micro-batch from the new log-probs of its trained tokens (default: the clipped
        policy-gradient loss per token, or per sample with ``training.ratio_level: sequence``)."""
        return policy_loss(logp_new, mb.old_logprobs, mb.advantages, mb.weights, cfg, logp_ref,
                           mb.sample_index if cfg.ratio_level == "sequence" else None)

    def sample_advantages(self, trajectories: Sequence[Trajectory],
                          advantages: Mapping[str, float | Sequence[float]]) -> Mapping[str, float | Sequence[float]]:
        """The per-sample quantity the loss multiplies (default: the advantages as the reward computed them)."""
        return advantages

    def refusal(self, traits: ModelTraits) -> str:
        """One line saying why this algorithm cannot train a model with these traits ("" when it can); the
        registry's attention kinds are checked here, so a view refuses what config loading refuses."""
        return attention_refusal(self.name, traits.attention)

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        """Units of a block-attention sample."""
        raise NotImplementedError

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        """Units of a full-attention sample (one row each)."""
        raise NotImplementedError

    def full_rows(self, sample: Sample, sample_index: int, cfg: ViewConfig, traits: ModelTraits,
                  gen: torch.Generator) -> list[Row] | None:
        """Rows of a full-attention sample built directly (None: one row per unit of ``full_units``)."""
        return None

    def exact(self, cfg: ViewConfig, traits: ModelTraits, samples: Sequence[Sample]) -> bool:
        """True when the rows reproduce the sampler's states, so its recorded log-probs are the old ones."""
        return False


class ResponseMasking(Algorithm):
    """An algorithm whose units are masks of the response tokens (tail always masked, prompt clean), the same for
    every family: subclasses only say how the masks are drawn."""

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """[D, length] masks of a response's tokens and the probability each token was masked with."""
        raise NotImplementedError

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        length = int((geometry.kind == RESPONSE).sum())
        return masked_response_block_units(geometry, *self.response_masks(length, cfg, gen))

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        return masked_response_full_units(sample, *self.response_masks(len(sample.resp), cfg, gen))
