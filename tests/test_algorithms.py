"""The algorithm registry: every name has its module, the method names resolve there, refusals come at load."""

from __future__ import annotations

import importlib

import pytest

from core.loader import ConfigError
from jobs.config import load_config
from train.algorithms import REGISTRY, algorithm, canonical_method
from train.algorithms.base import Algorithm
from train.settings import ViewConfig
from train.views import ModelTraits, build_view


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_registered_algorithm_is_its_module(name):
    module = importlib.import_module(REGISTRY[name].module)
    assert module.__name__.rsplit(".", 1)[1] == name and module.__doc__
    assert isinstance(module.ALGORITHM, Algorithm) and module.ALGORITHM.name == name
    assert algorithm(name) is module.ALGORITHM


def test_method_names_and_aliases_resolve():
    assert canonical_method("TraceRL") == canonical_method("trace_rl") == "tracerl"
    assert ViewConfig(method="Coupled").method == "coupled"
    with pytest.raises(ValueError, match="one of TraceRL, random_masking, coupled, CJ-GRPO, .*, semi_ar, ar"):
        ViewConfig(method="grpo")


def test_value_model_needs_an_algorithm_that_serves_it():
    cfg = load_config(["config=configs/rl_trado_with_value.yaml"], "rl")
    assert cfg.model.value_base_model and cfg.training.method == "tracerl"
    with pytest.raises(ConfigError, match="training.method 'coupled' cannot train with the value model"):
        load_config(["config=configs/rl_trado_with_value.yaml", "training.method=coupled"], "rl")


def test_ar_refuses_models_without_shifted_logits():
    with pytest.raises(ValueError, match="shifted logits"):
        build_view([], {}, ViewConfig(method="ar"), ModelTraits(mask_id=9, pad_id=0, attention="block", block_size=2))


def test_rl_job_refuses_an_sft_method():
    from jobs.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="training.method 'semi_ar' is an SFT method"):
        load_config(["config=configs/demo/rl_demo.yaml", "training.method=semi_ar"], "rl")
