"""Semi-autoregressive SFT (the reference's SFT method ``semi-ar``, Gen-Verse/dLLM-RL; no paper of its own).

Full attention: ``training.mask_times_per_sample`` units per response block k (``training.block_size``): later
blocks and the tail fully masked, block k noised by one random-masking draw each, earlier blocks clean; trained =
the noised tokens of block k. Block models: random masking over the block layout, which already keeps later blocks
out of view.
"""

from __future__ import annotations

import torch

from train.algorithms.base import Needs, Units
from train.algorithms.random_masking import RandomMasking, noise_masks
from train.samples import Sample
from train.settings import ViewConfig


class SemiAR(RandomMasking):
    name = "semi_ar"
    paper = ""
    code = "Gen-Verse/dLLM-RL (SFT method semi-ar)"
    needs = Needs(old_logprobs="none", reference_model="none")

    def full_units(self, sample: Sample, cfg: ViewConfig, gen: torch.Generator) -> Units:
        if not sample.block:
            raise ValueError("semi-AR views of full-attention models need a block size (training.block_size)")
        resp_len, tail_len = len(sample.resp), len(sample.tail)
        resp_block = torch.arange(resp_len) // sample.block
        n_blocks = int(resp_block.max()) + 1 if resp_len else 0
        # training.mask_times_per_sample draws of each block, one unit each (block-major)
        draws = [noise_masks(resp_len, cfg, gen) for _ in range(n_blocks)]
        noise = torch.cat([masks for masks, _ in draws]) if draws else torch.zeros(0, resp_len, dtype=torch.bool)
        noise_level = torch.cat([level for _, level in draws]) if draws else torch.ones(0, resp_len)
        unit_block = torch.arange(n_blocks).repeat_interleave(cfg.mask_times_per_sample)[:, None]
        n_units = len(unit_block)
        resp_masked = (resp_block[None] > unit_block) | ((resp_block[None] == unit_block) & noise)
        trained = (resp_block[None] == unit_block) & noise & sample.trainable[None]
        masked = torch.cat([resp_masked, torch.ones(n_units, tail_len, dtype=torch.bool)], 1)
        trained = torch.cat([trained, torch.zeros(n_units, tail_len, dtype=torch.bool)], 1)
        level = torch.cat([noise_level, torch.ones(n_units, tail_len)], 1)
        return Units(masked, trained, torch.ones_like(masked), torch.cat([sample.steps, sample.tail_steps]), level)


ALGORITHM = SemiAR()
