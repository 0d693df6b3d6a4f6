"""Random masking: response tokens masked at a random ratio, the baseline of TraceRL's paper (arXiv 2509.06949;
Gen-Verse/dLLM-RL train/rl_trado.py random_masking, train/rl_dream.py and train/rl_llada.py).

Per draw, a noise level t ~ U(lower_p, upper_p) per sequence (or the reference's per-position draw,
``random_mask_mode="per_position"``) masks each response token with probability t; tail tokens are always masked and
never trained; ``mask_times_per_sample`` draws per sample. Block models: a row copies every block of the response
with the clean sequence before it. The rows do not reproduce sampler states, so old log-probs are recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import Needs, ResponseMasking
from train.settings import ViewConfig


def noise_masks(length: int, cfg: ViewConfig, gen: torch.Generator, complement: bool = False) -> tuple[Tensor, Tensor]:
    """[D, length] masks of response tokens, D = mask_times_per_sample (doubled when each draw is followed by its
    ``complement``), and the [D, length] probability each token was masked with."""
    draws = cfg.mask_times_per_sample
    if cfg.random_mask_mode == "per_sequence":
        level = torch.empty(draws, 1).uniform_(cfg.lower_p, cfg.upper_p, generator=gen)
    else:  # the reference's per-position draw (Gen-Verse/dLLM-RL train/rl_trado.py random_masking)
        level = torch.empty(draws, length).uniform_(cfg.lower_p, cfg.upper_p, generator=gen)
    masks = torch.rand(draws, length, generator=gen) < level
    level = level.expand(draws, length)
    if complement:  # each draw followed by its complement
        masks = torch.stack([masks, ~masks], 1).flatten(0, 1)
        level = torch.stack([level, 1 - level], 1).flatten(0, 1)
    return masks, level


class RandomMasking(ResponseMasking):
    name = "random_masking"
    paper = "2509.06949"
    code = "Gen-Verse/dLLM-RL train/rl_trado.py (random_masking), train/rl_dream.py, train/rl_llada.py"
    needs = Needs(old_logprobs="recompute", monte_carlo_draws="training.mask_times_per_sample")
    complement = False  # coupled: each random mask followed by its complement

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return noise_masks(length, cfg, gen, self.complement)

ALGORITHM = RandomMasking()
