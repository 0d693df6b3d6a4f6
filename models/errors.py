"""The models package's user error (its own module, so that every module of models/ can raise it)."""

from core.errors import UserError


class ModelLoadError(UserError, ValueError):
    """A user-facing loading problem (unknown model_base, missing path, mismatched checkpoint, bad tokenizer)."""


def not_a_model_folder(path: object, name: str = "model path") -> str:
    """The one line for a model folder without a ``config.json``; a LoRA adapter's folder is named as one."""
    from pathlib import Path

    if (Path(str(path)) / "adapter_config.json").is_file():
        return (f"{name} {str(path)!r} holds a LoRA adapter, not a whole model: set it as model.adapter and its base "
                "model as model.pretrained_model (or merge the two: python -m tools.merge_lora)")
    return (f"{name} {str(path)!r} is not a folder with a config.json (weights cannot be downloaded at run time; "
            "download the checkpoint first)")


def not_an_adapter_folder(path: object) -> str:
    """The one line for a LoRA adapter path without an ``adapter_config.json``."""
    return f"{path} is not a LoRA adapter folder (no adapter_config.json; peft's format)"
