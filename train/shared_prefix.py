"""Shared prompts in training: the rows of one prompt compute its clean prompt blocks once per forward.

An RL step trains n samples of each prompt, and every row a block model trains on starts with the same clean prompt
blocks (train/views.py). Under the block-causal rule those blocks' keys and values depend on the prompt alone, and
every later token of the row sees all of them. So a micro-batch's forward can run in two parts, exactly:

1. one forward of each distinct prompt prefix (its complete blocks), keeping every layer's keys and values with
   their gradients (``PrefixKeys``);
2. one forward of the rows without their prefix, each reading its prefix's keys and values as a cache
   (``SharedPrefix``) and its own tokens by the row's layout.

The gradients of all rows of a prompt meet in its prefix's keys and values, as they would in one forward of every
row. The prefix tokens' hidden states predict nothing: the plan keeps a row whole when a trained token's predicting
column lies in its prefix. This is Prefix Grouper's idea (arXiv 2506.05433, GRPO on AR models) on our layouts: in
the real-weights recipe a row is 84 prompt tokens of 143, and 16 samples share each prompt.

Both forwards attend with masked SDPA: FlexAttention's block-sparse masks and CPU split attention serve one-forward
rows only, so sharing pays where the prompt is a large part of the rows (``MAX_SHARED_FRACTION`` counts tokens).
Dropout (a LoRA's) draws once per prompt on the prefix instead of once per row: the same gradient in expectation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from models.common import AttentionLayout, KVCache
from train.batch import TrainBatch

# Share only when the padded tokens of the two forwards are at most this fraction of the one forward's: a second
# forward costs its own launches and its own padding.
MAX_SHARED_FRACTION = 0.9


@dataclass
class SharedPlan:
    """A micro-batch as distinct prefixes plus the rows' remainders (all on one device)."""

    prefix_ids: Tensor  # [U, K] the distinct prefixes, right-padded
    prefix_pos: Tensor  # [U, K]
    prefix_layout: AttentionLayout
    owner: Tensor  # [R] the prefix each row reads
    visible: Tensor  # [R, K] bool, the prefix columns a row sees (its own prefix's valid columns; none without one)
    ids: Tensor  # [R, S] each row from its first column after the prefix on
    pos: Tensor  # [R, S]
    layout: AttentionLayout
    cols: Tensor  # [T] predicting columns of the trained tokens in the rows' remainders

    def to(self, device: torch.device | str) -> SharedPlan:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def shared_prefix_plan(mb: TrainBatch) -> SharedPlan | None:
    """The plan of a host micro-batch whose rows share prompt prefixes, or None when sharing would not cut its
    padded tokens below ``MAX_SHARED_FRACTION``."""
    if mb.shared_cols is None or mb.num_rows < 2 or mb.layout.extra is not None:  # extra: pairs it cannot split
        return None
    width = mb.input_ids.shape[1]
    shared = _shareable_columns(mb)
    ids, blocks = mb.input_ids.cpu().numpy(), mb.layout.block.cpu().numpy()
    prefixes: dict[tuple[int, bytes, bytes], int] = {}
    first_row, owner = [], []
    for row, k in enumerate(shared.tolist()):
        # the same tokens in the same blocks: a prompt decoded at another block size attends otherwise inside it
        key = (k, ids[row, :k].tobytes(), blocks[row, :k].tobytes())
        if k and key not in prefixes:
            prefixes[key] = len(prefixes)
            first_row.append(row)
        owner.append(prefixes.get(key, 0))  # a row without a prefix reads none of prefix 0's columns
    prefix_width = int(shared.max())
    rest_width = int((mb.layout.valid.sum(1) - shared).max())
    if not prefixes or len(prefixes) * prefix_width + mb.num_rows * rest_width > (
            MAX_SHARED_FRACTION * mb.num_rows * width):
        return None
    first = torch.tensor(first_row)
    prefix_cols = torch.arange(prefix_width)
    prefix_valid = prefix_cols < shared[first, None]
    rest = shared[:, None] + torch.arange(rest_width)
    inside = rest < width
    rest = rest.clamp(max=width - 1)
    layout = mb.layout
    return SharedPlan(
        prefix_ids=mb.input_ids[first, :prefix_width], prefix_pos=mb.position_ids[first, :prefix_width],
        prefix_layout=AttentionLayout(layout.block[first, :prefix_width], layout.copy[first, :prefix_width],
                                      layout.valid[first, :prefix_width] & prefix_valid),
        owner=torch.tensor(owner), visible=prefix_cols < shared[:, None],
        ids=mb.input_ids.gather(1, rest), pos=mb.position_ids.gather(1, rest),
        layout=AttentionLayout(layout.block.gather(1, rest), layout.copy.gather(1, rest),
                               layout.valid.gather(1, rest) & inside),
        cols=mb.cols - shared[mb.rows])


def _shareable_columns(mb: TrainBatch) -> Tensor:
    """Each row's prefix length: the view's shareable columns, 0 where a trained token's predicting column lies
    inside them (the prefix forward keeps no hidden states)."""
    shared = mb.shared_cols.clone()
    first_trained = torch.full_like(shared, torch.iinfo(shared.dtype).max).scatter_reduce(
        0, mb.rows.cpu(), mb.cols.cpu(), "amin")
    shared[first_trained < shared] = 0
    return shared


class PrefixKeys(KVCache):
    """Collects each layer's keys and values of the prefix forward as computed (gradients kept).

    Its ``keys`` stay empty, so attention treats the prefixes as uncached sequences. Under gradient checkpointing a
    recomputed layer collects again: the same values, and the rows' forward already holds the first ones."""

    checkpointable = True

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.kept_keys: list[Tensor | None] = [None] * num_layers
        self.kept_values: list[Tensor | None] = [None] * num_layers

    def extend_layer(self, idx: int, k: Tensor, v: Tensor, store: bool | int) -> tuple[Tensor, Tensor]:
        self.kept_keys[idx], self.kept_values[idx] = k, v
        return k, v


class SharedPrefix(KVCache):
    """The rows' view of the prefixes: row r reads prefix ``owner[r]``'s keys and values before its own.

    Holds the prefixes' keys once and spreads them to the rows one layer at a time (all layers spread at once
    would hold L x R copies of the prefix). Read-only, so a recomputed layer sees what the first pass saw."""

    checkpointable = True

    def __init__(self, prefixes: PrefixKeys, owner: Tensor, visible: Tensor):
        super().__init__(len(prefixes.kept_keys))
        self.keys, self.values = prefixes.kept_keys, prefixes.kept_values  # per prefix [U, Hkv, K, D]
        self.owner = owner
        self.valid = visible

    def extend_layer(self, idx: int, k: Tensor, v: Tensor, store: bool | int) -> tuple[Tensor, Tensor]:
        return (torch.cat([self.keys[idx].index_select(0, self.owner), k], 2),
                torch.cat([self.values[idx].index_select(0, self.owner), v], 2))


def shared_prefix_hidden(model, plan: SharedPlan, num_layers: int) -> Tensor:
    """Final hidden states [R, S, H] of the rows' remainders (``plan.cols`` index them), the prefixes forwarded
    once each."""
    prefixes = PrefixKeys(num_layers)
    model(input_ids=plan.prefix_ids, position_ids=plan.prefix_pos, layout=plan.prefix_layout,
          past_key_values=prefixes, store_kv=True, logits_to_keep=1)
    cache = SharedPrefix(prefixes, plan.owner, plan.visible)
    out = model(input_ids=plan.ids, position_ids=plan.pos, layout=plan.layout, past_key_values=cache,
                logits_to_keep=1)
    return out.hidden_states[-1]
