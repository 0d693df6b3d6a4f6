"""bench.moe's sampler runs: every MoE family and its dense sibling sample the full budget on a tiny model."""

from __future__ import annotations

import pytest

from bench.moe import SIBLINGS, sampler_runs


@pytest.mark.parametrize("model_base", sorted({b for pair in SIBLINGS for b in pair}))
def test_sampler_runs_write_every_token_of_every_prompt(model_base):
    (stats,) = sampler_runs(model_base, batch=3, max_tokens=8, reps=1, size="test")
    assert stats.generated_tokens == 3 * 8 and stats.forwards > 0 and stats.wall_time > 0
