"""Shared fixtures: the offline demo tokenizer and tiny random models of every family."""

from __future__ import annotations

import warnings

import pytest
import torch

from models.tiny import build_tiny
from models.tokenizers import build_demo_tokenizer

warnings.filterwarnings("ignore", message=".*rope_scaling.*")
# Tiny models are overhead-bound: one thread is several times faster than two on a busy 2-core machine.
torch.set_num_threads(1)

MODEL_BASES = ("sdar", "dream", "llada", "mmada")


@pytest.fixture(scope="session")
def demo_tokenizer():
    return build_demo_tokenizer()


@pytest.fixture
def tiny(demo_tokenizer):
    """Factory: ``tiny("sdar", seed=1, block_size=4)`` -> Adapter of a tiny fp32 model in eval mode."""

    def make(model_base: str, **kw):
        return build_tiny(model_base, demo_tokenizer, **kw)

    return make
