"""The models package's user error (its own module, so that every module of models/ can raise it)."""

from core.errors import UserError


class ModelLoadError(UserError, ValueError):
    """A user-facing loading problem (unknown model_base, missing path, mismatched checkpoint, bad tokenizer)."""
