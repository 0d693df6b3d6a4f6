"""TraceRL: train on the trajectory the sampler took (arXiv 2509.06949; Gen-Verse/dLLM-RL train/rl_trado.py for
block models, train/rl_dream.py for full attention).

A round is the tokens committed at one (collapsed) step. Block models (block size b): a round of block k masks every
response/tail token of block k whose step is >= its step, with the earlier blocks clean; full attention: one row per
distinct step v, every response/tail token of step >= v masked. Trained = the response tokens of the round's step.
The rows reproduce the sampler's states, so its recorded log-probs are the old ones (exact, with ``shrink`` 1 and,
for full attention, no truncation). ``shrink`` merges runs of consecutive distinct steps into one round (the
reference's collapse_k_unique).

TraceRL + value (the paper's diffusion value model: ``model.value_base_model``, train/value_trainer.py and
train/gae.py): a token's value is read at its masked copy in its round, so the value model is served by these rows
only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import PROMPT, RESPONSE, Algorithm, BlockGeometry, Needs, Units, full_attention_units
from train.samples import Sample
from train.settings import ViewConfig


def group_ranks(group: Tensor, steps: Tensor, shrink: int = 1) -> tuple[Tensor, Tensor]:
    """Per element: 1-based rank of its collapsed step among the distinct collapsed steps of its group, and the
    collapsed step itself (``collapse_k_unique`` per group: distinct values cut into runs of ``shrink``, each value
    replaced by the largest of its run)."""
    if steps.numel() == 0:
        return torch.zeros_like(steps), steps.clone()
    base = int(steps.max()) + 1
    uniq, inverse = torch.unique(group * base + steps, sorted=True, return_inverse=True)
    ugroup, uvalue = uniq // base, uniq % base
    idx = torch.arange(uniq.numel())
    is_first = torch.ones_like(idx, dtype=torch.bool)
    is_first[1:] = ugroup[1:] != ugroup[:-1]
    start = torch.cummax(torch.where(is_first, idx, torch.zeros_like(idx)), 0).values
    is_last = torch.ones_like(is_first)
    is_last[:-1] = is_first[1:]
    end = torch.flip(torch.cummin(torch.flip(torch.where(is_last, idx, idx.numel()), [0]), 0).values, [0])
    run = (idx - start) // shrink
    top = torch.minimum(start + run * shrink + shrink - 1, end)
    return (run + 1)[inverse], uvalue[top][inverse]


class TraceRL(Algorithm):
    name = "tracerl"
    paper = "2509.06949"
    code = "Gen-Verse/dLLM-RL train/rl_trado.py, train/rl_dream.py"
    needs = Needs(old_logprobs="sampler")  # exact views; training.old_logp=recompute recomputes them anyway

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        generated = geometry.kind != PROMPT
        rank, collapsed = torch.zeros_like(geometry.steps), torch.zeros_like(geometry.steps)
        rank[generated], collapsed[generated] = group_ranks(geometry.block[generated], geometry.steps[generated],
                                                            cfg.shrink)
        candidate = (geometry.kind == RESPONSE) & geometry.trainable
        rounds = torch.unique(rank[candidate])
        masked = generated[None] & (rank[None] >= rounds[:, None])
        trained = candidate[None] & (rank[None] == rounds[:, None])
        in_copy = (torch.stack([torch.isin(geometry.block, geometry.block[round_tokens]) for round_tokens in trained])
                   if len(rounds) else masked)
        return Units(masked, trained, in_copy, collapsed, torch.ones(masked.shape))

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        resp_len = len(sample.resp)
        all_steps = torch.cat([sample.steps, sample.tail_steps])
        rank, collapsed = group_ranks(torch.zeros_like(all_steps), all_steps, cfg.shrink)
        rounds = torch.unique(rank[:resp_len][sample.trainable])
        masked = rank[None] >= rounds[:, None]
        trained = (rank[:resp_len][None] == rounds[:, None]) & sample.trainable[None]
        return full_attention_units(masked, trained, collapsed, torch.ones(masked.shape))

    def exact(self, cfg, traits, samples) -> bool:
        # a token rewritten by token editing is masked in the rows until its last write, where the sampler held
        # the earlier token: those states are not the sampler's
        return cfg.shrink == 1 and not any(sample.rewritten for sample in samples) and not (
            traits.attention == "full" and any(sample.truncated for sample in samples))


ALGORITHM = TraceRL()
