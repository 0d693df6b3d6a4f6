"""AR SFT of a model adapted from an AR model (Dream / DiffuCoder, shifted logits):
the clean sequence under causal attention, every trainable response token predicted from the hidden state before
it. Refuses models without shifted logits (they would see the token they predict), so every block model.
"""

from __future__ import annotations

import torch

from train.algorithms.base import Algorithm, Needs, Row
from train.layouts import clean_segment
from train.samples import Sample


class AR(Algorithm):
    name = "ar"
    needs = Needs(old_logprobs="none", reference_model="none")
    causal = True

    def refusal(self, traits) -> str:
        if traits.shift_logits:
            return ""
        return ("the ar view needs a model with shifted logits (Dream / DiffuCoder): an unshifted model would see "
                "the token it predicts")

    def full_rows(self, sample: Sample, sample_index: int, cfg, traits, gen) -> list[Row]:
        sequence = torch.cat([sample.prompt, sample.resp])
        hit = sample.trainable.nonzero().squeeze(1)
        return [Row([clean_segment(sequence, 1)], sample_index, len(sample.prompt) + hit, hit, torch.zeros_like(hit),
                    sample.steps[hit], torch.ones(len(hit)))]


ALGORITHM = AR()
