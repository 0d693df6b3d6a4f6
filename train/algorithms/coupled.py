"""Coupled sampling: random masking with the complement of each random mask as another row, so every response
token is trained in exactly one of the pair (coupled-GRPO of DiffuCoder, arXiv 2506.20639, apple/ml-diffucoder;
ours is the reference's variant, Gen-Verse/dLLM-RL).

A draw at noise level t is followed by its complement at level 1 - t (``elbo_weight`` then needs upper_p < 1).
Old log-probs are recomputed, as for random masking.
"""

from __future__ import annotations

from train.algorithms.random_masking import RandomMasking


class Coupled(RandomMasking):
    name = "coupled"
    paper = "2506.20639"
    code = "apple/ml-diffucoder (coupled-GRPO); Gen-Verse/dLLM-RL"
    complement = True


ALGORITHM = Coupled()
