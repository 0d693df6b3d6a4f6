"""The adapter facts a training view needs (``ModelTraits``): ids and attention kind, without the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.registry import Adapter


@dataclass(frozen=True, kw_only=True)
class ModelTraits:
    """The adapter facts a view needs (kept separate so views stay pure and testable without a model)."""

    mask_id: int
    pad_id: int
    attention: str = "block"
    block_size: int | None = None
    shift_logits: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ("block", "full"):
            raise ValueError(f"view config: attention={self.attention!r} is not one of ('block', 'full')")
        if self.attention == "block" and not self.block_size:
            raise ValueError("block-attention views need a block_size")
        if self.attention == "block" and self.shift_logits:
            raise ValueError("shifted logits are not supported for block-attention models")

    @classmethod
    def from_adapter(cls, adapter: Adapter) -> ModelTraits:
        return cls(mask_id=adapter.mask_id, pad_id=adapter.pad_id, attention=adapter.attention,
                   block_size=adapter.block_size if adapter.attention == "block" else None,
                   shift_logits=adapter.shift_logits)
