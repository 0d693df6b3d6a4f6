"""``TrainBatch``: what a training view hands the trainer (model inputs per row, flat vectors per trained token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from models.common import AttentionLayout
from train.layouts import select_layout_rows

TOKEN_FIELDS = ("rows", "cols", "token_cols", "labels", "advantages", "old_logprobs", "weights", "sample_index",
                "token_index", "steps", "unit")


@dataclass
class TrainBatch:
    """Model inputs per row plus flat per-trained-token vectors (all of length T)."""

    input_ids: Tensor  # [R, N]
    position_ids: Tensor  # [R, N]
    layout: AttentionLayout
    row_sample: Tensor  # [R] index into sample_ids
    rows: Tensor  # [T] row of the trained token (tokens are stored grouped by row, rows ascending)
    cols: Tensor  # [T] index of the hidden state whose logits predict it (shifted for Dream)
    token_cols: Tensor  # [T] index of the token itself in its row (where a value head reads it)
    labels: Tensor  # [T] token id
    advantages: Tensor  # [T] float
    old_logprobs: Tensor  # [T] float, the sampler's log-prob (NaN when the view cannot reproduce it)
    weights: Tensor  # [T] float, loss weight (sums over the whole batch, layout independent)
    sample_index: Tensor  # [T] index into sample_ids
    token_index: Tensor  # [T] index of the token in its response
    steps: Tensor  # [T] (shrunk) step at which the token was decoded
    unit: Tensor  # [T] per-round row ("unit") the token is trained in, global over the batch
    sample_ids: list[str]
    num_units: int
    exact: bool  # True when old_logprobs (sampler) are valid for this view
    dropped: list[tuple[str, str]]  # (sample_id, reason) of trajectories left out
    extra: dict[str, Tensor] = field(default_factory=dict)  # more [T] vectors (e.g. old values), kept by select_rows
    filler: bool = False  # a zero-weight copy that only keeps collective ops in step across processes
    # what the loss weights were normalised by (train/views.py, NORM_COUNTS): units, tokens, longest response,
    # summed response length, prompt groups, samples; and the loss_norm that used them
    counts: dict[str, float] = field(default_factory=dict)
    loss_norm: str = "token_mean"
    # [R] each row's leading columns that rows of the same prompt may compute once (its complete clean prompt blocks;
    # 0 = none); None: no row's (or sharing is off for this micro-batch). Read on the host by train/shared_prefix.py
    shared_cols: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.rows.numel())

    @property
    def num_input_tokens(self) -> int:
        return int(self.layout.valid.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {name: getattr(self, name).to(device) for name in (*TOKEN_FIELDS, "input_ids", "position_ids",
                                                                   "row_sample")}
        extra = {k: v.to(device) for k, v in self.extra.items()}
        return replace(self, layout=self.layout.to(device), extra=extra, **moved)

    def select_rows(self, rows: Tensor | Sequence[int]) -> TrainBatch:
        """A micro-batch of the given rows, in that order; weights are kept (normalised over the whole batch).

        Trained tokens are stored grouped by row, so a row's tokens are one contiguous range: O(selected tokens).
        """
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = max(int(self.layout.valid[rows].sum(1).max()), 1) if rows.numel() else 1
        counts = torch.bincount(self.rows, minlength=self.num_rows)
        starts = torch.cumsum(counts, 0) - counts
        selected_counts = counts[rows]
        first = torch.repeat_interleave(starts[rows] - (torch.cumsum(selected_counts, 0) - selected_counts),
                                        selected_counts)
        keep = first + torch.arange(int(selected_counts.sum()))
        tokens = {name: getattr(self, name)[keep] for name in TOKEN_FIELDS}
        tokens["rows"] = torch.repeat_interleave(torch.arange(rows.numel()), selected_counts)
        tokens["extra"] = {k: v[keep] for k, v in self.extra.items()}
        return replace(self, input_ids=self.input_ids[rows, :width], position_ids=self.position_ids[rows, :width],
                       layout=select_layout_rows(self.layout, rows, width), row_sample=self.row_sample[rows],
                       shared_cols=None if self.shared_cols is None else self.shared_cols[rows], **tokens)

    def with_weights(self, weights: Tensor) -> TrainBatch:
        return replace(self, weights=weights)

    def as_filler(self) -> TrainBatch:
        """A zero-weight copy that counts as nothing (no tokens to normalise by, nothing dropped): it only keeps a
        process in step with the others' collective forwards and reductions."""
        return replace(self, weights=torch.zeros_like(self.weights), filler=True, dropped=[],
                       counts=dict.fromkeys(self.counts, 0.0))
