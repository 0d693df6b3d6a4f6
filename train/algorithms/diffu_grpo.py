"""diffu-GRPO (d1, arXiv 2504.12216; dllm-reasoning/d1 diffu-grpo/diffu_grpo_trainer.py): GRPO with d1's one-step
mean-field log-probabilities.

A row masks the whole completion (block models: every response block fully masked, earlier blocks clean, the
block-causal [noisy | clean] layout) and each prompt token with probability ``training.prompt_mask_p`` (d1: 0.15); one
forward gives every completion token's log-probability. Each of the ``training.num_train_epochs`` inner iterations
(d1's mu, 12) draws fresh prompt masks, and the old log-probs of every iteration are computed with its own masks
before any update, so the first pass has ratio 1. Loss: the clipped surrogate per token, mean over the batch's
completion tokens, with the k3 KL to a frozen reference (``training.ref_beta``, d1: 0.04); A = r - mean (Dr. GRPO's
baseline, ``reward.advantage: dr_grpo``). d1's hyper-parameters: eps 0.5, lr 3e-6, 6 completions per prompt.
"""

from __future__ import annotations

import torch

from train.algorithms.base import Needs, ResponseMasking
from train.settings import ViewConfig


def all_masked(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw masking every response token (probability 1)."""
    return torch.ones(1, length, dtype=torch.bool), torch.ones(1, length)


class DiffuGRPO(ResponseMasking):
    name = "diffu_grpo"
    paper = "2504.12216"
    code = "dllm-reasoning/d1 diffu-grpo/diffu_grpo_trainer.py"
    needs = Needs(old_logprobs="recompute", fresh_masks=True)
    loss_norm = "token_mean"
    prompt_mask_p = 0.15

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return all_masked(length)

ALGORITHM = DiffuGRPO()
