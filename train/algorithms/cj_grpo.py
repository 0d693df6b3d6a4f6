"""CJ-GRPO, consistency-trajectory GRPO (arXiv 2509.23924; yjyddq/EOSER-ASS-RL): TraceRL's rows with a per-step
normalisation.

One row per decoding step s (TraceRL with ``shrink`` 1): the state x_s as the sampler saw it, trained on the tokens
unmasked at s; loss = (1/S) sum_s the token mean of the clipped surrogate over step s's tokens (``loss_norm:
step_mean``; on block models a TraceRL row holds the r-th step of every block, and the mean is still per step);
A = r - mean (``reward.advantage: dr_grpo``); its paper's eps 0.5, k3 KL to the reference with
``training.ref_beta`` 0.04, mu 12. Its EOSER / ASS samplers (EOS-confidence scaling, 2^s tokens at step s) are
not part of this module: any of our samplers' trajectories train.
"""

from __future__ import annotations

from train.algorithms.tracerl import TraceRL


class CJGRPO(TraceRL):
    name = "cj_grpo"
    paper = "2509.23924"
    code = "yjyddq/EOSER-ASS-RL"
    loss_norm = "step_mean"


ALGORITHM = CJGRPO()
