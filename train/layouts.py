"""Row assembly for training views: token segments -> right-padded tensors + an AttentionLayout.

A row is a concatenation of segments (a clean prefix, noisy copies). Every token carries its own position id,
block index and copy index, so the order of segments inside a row does not matter to the model: the
AttentionLayout rule (models/common.py) decides visibility from (block, copy, valid) alone. Rows of a batch are
right-padded with invalid tokens; no left padding is ever needed because positions are explicit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.common import AttentionLayout


@dataclass
class Segment:
    """A run of tokens of one row, all with the same copy index."""

    ids: Tensor  # [n] long
    pos: Tensor  # [n] long, position ids (RoPE)
    block: Tensor  # [n] long, block index for the layout rule
    copy: int  # 0 = clean, > 0 = a noisy copy


def clean_segment(ids: Tensor, block_size: int | None) -> Segment:
    """The clean prefix at positions 0..n-1: block-causal (block = pos // b) or one full block (b=None)."""
    pos = torch.arange(ids.numel(), dtype=torch.long)
    block = pos // block_size if block_size else torch.zeros_like(pos)
    return Segment(ids, pos, block, 0)


def row_length(segments: list[Segment]) -> int:
    return sum(int(s.ids.numel()) for s in segments)


@dataclass
class RowTensors:
    """Padded batch tensors of a list of rows."""

    input_ids: Tensor  # [R, N]
    position_ids: Tensor  # [R, N]
    layout: AttentionLayout


def collate_rows(rows: list[list[Segment]], pad_id: int) -> RowTensors:
    """Concatenate each row's segments and right-pad all rows to the longest (pads are invalid keys)."""
    n = max((row_length(r) for r in rows), default=1) or 1
    shape = (len(rows), n)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    pos = torch.zeros(shape, dtype=torch.long)
    block = torch.zeros(shape, dtype=torch.long)
    copy = torch.zeros(shape, dtype=torch.long)
    valid = torch.zeros(shape, dtype=torch.bool)
    for r, segments in enumerate(rows):
        if not segments:
            continue
        k = row_length(segments)
        ids[r, :k] = torch.cat([s.ids for s in segments])
        pos[r, :k] = torch.cat([s.pos for s in segments])
        block[r, :k] = torch.cat([s.block for s in segments])
        copy[r, :k] = torch.cat([torch.full_like(s.ids, s.copy) for s in segments])
        valid[r, :k] = True
    return RowTensors(ids, pos, AttentionLayout(block, copy, valid))


def select_layout_rows(layout: AttentionLayout, rows: Tensor, width: int) -> AttentionLayout:
    """The layout of a subset of rows, cut to the first ``width`` columns."""
    extra = None if layout.extra is None else layout.extra[:width, :width]
    return AttentionLayout(layout.block[rows, :width], layout.copy[rows, :width], layout.valid[rows, :width], extra)
