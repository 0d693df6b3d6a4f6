"""The demo's starting models, built on first use (nothing is downloaded): tiny random models, and the SFT demo
model that the RL demo starts from.

Below every job that needs them: the SFT job is passed in (``train_sft``) rather than imported, so the SFT job can
use this module too without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.config import DEMO_MODEL_DIRS, load_config
from models.registry import ModelLoadError

# The demo's SFT models and the config that trains each: arithmetic (the RL demo's start) and Countdown (the
# Countdown start of bench/methods.py).
SFT_DEMOS = {"runs/sft_demo/ckpt/optimized": "configs/demo/sft_demo.yaml",
             "runs/sft_countdown/ckpt/optimized": "configs/demo/sft_countdown.yaml"}


def ensure_demo_model(model_cfg: Any, train_sft: Callable[[Any], Any]) -> None:
    """Demo configs only: build the model at one of the demo paths when it is missing (and say so); an SFT demo
    model is trained with ``train_sft`` (the SFT job) from its config (``SFT_DEMOS``).

    Any other missing path is an error: a mistyped path must never silently become a random model.
    """
    path = Path(model_cfg.pretrained_model)
    if not model_cfg.init_tiny_if_missing or (path / "config.json").is_file():
        return
    if path.as_posix().rstrip("/") not in DEMO_MODEL_DIRS:
        raise ModelLoadError(f"model path {str(path)!r} does not exist (model.init_tiny_if_missing only builds the "
                             f"demo's own paths: {', '.join(DEMO_MODEL_DIRS)})")
    sft_config = SFT_DEMOS.get(path.as_posix().rstrip("/"))
    if sft_config:
        print(f"{path} is missing: training the demo's starting model with {sft_config} (runs once)", flush=True)
        train_sft(load_config([f"config={sft_config}", "experiment.overwrite=true"], "sft"))
        return
    from models.tiny import save_tiny_checkpoint
    from models.tokenizers import build_demo_tokenizer

    print(f"building a tiny random {model_cfg.model_base} model at {path} (demo; nothing is downloaded)")
    save_tiny_checkpoint(path, str(model_cfg.model_base), build_demo_tokenizer(), size="demo")
