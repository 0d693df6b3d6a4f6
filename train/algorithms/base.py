"""What an algorithm gives the shared view machinery (train/views.py): units of a sample, a loss, its needs.

A **unit** is one per-round row of a sample: which of its tokens are masked, which are trained, which blocks it
copies (block models) and with which probability each token was masked. The view machinery turns units into rows
(packed or per-round for block models, one row per unit for full attention), numbers them over the batch and
normalises the loss weights; an algorithm only decides the units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from train.layouts import Segment
from train.loss import policy_loss
from train.samples import Sample
from train.settings import ViewConfig

if TYPE_CHECKING:
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

    def nonempty(self) -> Units:
        keep = self.trained.any(1)
        return Units(self.masked[keep], self.trained[keep], self.in_copy[keep], self.steps, self.level[keep])


def full_attention_units(masked: Tensor, trained_response: Tensor, steps: Tensor, level: Tensor) -> Units:
    """Units of a full-attention sample over response + tail tokens: tail tokens are never trained."""
    tail_len = masked.shape[1] - trained_response.shape[1]
    trained = torch.cat([trained_response, torch.zeros(len(trained_response), tail_len, dtype=torch.bool)], 1)
    return Units(masked, trained, torch.ones_like(masked), steps, level)


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


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs besides the trajectories and their advantages."""

    old_logprobs: str  # "sampler": recorded at rollout when the view is exact; "recompute": a no-grad forward; "none"
    reference_model: str = "optional"  # "optional": a frozen reference model when training.ref_beta > 0; "none"
    inner_iterations: str = "training.num_train_epochs"  # passes over one step's rows ("" = one)
    monte_carlo_draws: str = ""  # the setting that counts random draws per sample ("" = none: deterministic units)


class Algorithm:
    """A training method. Subclasses fill in the facts and the unit builders of the families they serve."""

    name = ""
    paper = ""  # arXiv id
    code = ""  # the public code it follows
    needs = Needs(old_logprobs="recompute")
    loss = staticmethod(policy_loss)  # RL loss over the trained tokens (SFT uses its NLL, the value model its own)

    def refusal(self, ids: ModelTraits) -> str:
        """One line saying why this algorithm cannot train a model with these traits ("" when it can)."""
        return ""

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        """Units of a block-attention sample."""
        raise NotImplementedError

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        """Units of a full-attention sample (one row each)."""
        raise NotImplementedError

    def full_rows(self, sample: Sample, sample_index: int, cfg: ViewConfig, ids: ModelTraits,
                  gen: torch.Generator) -> list[Row] | None:
        """Rows of a full-attention sample built directly (None: one row per unit of ``full_units``)."""
        return None

    def exact(self, cfg: ViewConfig, ids: ModelTraits, samples: Sequence[Sample]) -> bool:
        """True when the rows reproduce the sampler's states, so its recorded log-probs are the old ones."""
        return False
