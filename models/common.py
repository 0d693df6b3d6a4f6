"""Attention shared by every architecture: the layout rule, the KV cache storage, the attention backends.

A model family differs only in parameter names and small details (q/k norm, biases); the attention math lives
here once so that the sampler and the trainer see exactly the same computation for every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # optional GPU extra
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # pragma: no cover - not installed on CPU machines
    flash_attn_func = None

@dataclass
class AttentionLayout:
    """Who may attend to whom, described per token instead of as a dense N x N matrix.

    Every token carries a block index, a copy index and a validity flag. Query i may see key j iff key j is valid
    and either
      * j is clean (copy 0) and lies in an earlier block, or in the same block when i is clean too; or
      * j lies in the same noisy copy (copy > 0) and the same block as i.
    Every token also sees itself, so padding queries never produce NaNs.

    This one rule covers all layouts we need: full attention (all blocks 0), causal (block = position),
    block-causal (block = position // b), the TraceRL doubled layout (clean response + a masked copy) and the
    packed layout (several masked copies, one per round). The one exception, attention annealing (``annealed``),
    adds random (query, key) pairs no per-token rule can describe: ``extra``, a dense [N, N] pattern shared by the
    rows, ORed into the rule (its keys still only where valid).
    """

    block: Tensor  # [B, N] long
    copy: Tensor  # [B, N] long, 0 = clean
    valid: Tensor  # [B, N] bool, False = padding (never a visible key)
    extra: Tensor | None = None  # [N, N] bool: more visible pairs (query, key), for every row
    # Masks derived from the vectors, built once per forward and shared by all layers. A layout is treated as
    # immutable once it has been used.
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def full(cls, valid: Tensor) -> AttentionLayout:
        zeros = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
        return cls(zeros, zeros, valid.bool())

    @classmethod
    def block_causal(cls, position_ids: Tensor, block_size: int, valid: Tensor | None = None) -> AttentionLayout:
        """Blocks at absolute positions: block = position // block_size (the sampler's convention)."""
        if valid is None:
            valid = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
        copy = torch.zeros_like(position_ids)
        return cls(torch.div(position_ids, block_size, rounding_mode="floor"), copy, valid.bool())

    @classmethod
    def causal(cls, valid: Tensor) -> AttentionLayout:
        b, n = valid.shape
        block = torch.arange(n, device=valid.device).expand(b, n).contiguous()
        return cls(block, torch.zeros_like(block), valid.bool())

    @classmethod
    def annealed(cls, valid: Tensor, ratio: float, generator: torch.Generator | None = None) -> AttentionLayout:
        """Causal attention with each later key also visible with probability ``ratio``, one draw for all rows: the
        attention mask annealing of DiffuLLaMA (arXiv 2410.17891), which adapts an AR model to full attention by
        raising ``ratio`` from 0 to 1 over training."""
        n = valid.shape[1]
        extra = torch.rand(n, n, generator=generator).to(valid.device) < ratio
        return replace(cls.causal(valid), extra=extra)

    def dense_mask(self) -> Tensor:
        """Boolean [B, 1, N, N] mask (True = visible), built by broadcasting the per-token vectors."""
        if "dense" not in self._masks:
            self._masks["dense"] = self._build_dense_mask()
        return self._masks["dense"]

    def _build_dense_mask(self) -> Tensor:
        n = self.block.shape[1]
        same = torch.eye(n, dtype=torch.bool, device=self.block.device)
        mask = visible(self.block[:, :, None], self.block[:, None, :], self.copy[:, :, None], self.copy[:, None, :],
                       self.valid[:, None, :], same)
        if self.extra is not None:
            mask = mask | (self.extra[None] & self.valid[:, None, :])
        return mask[:, None]

    def to(self, device: torch.device | str) -> AttentionLayout:
        extra = None if self.extra is None else self.extra.to(device)
        return AttentionLayout(self.block.to(device), self.copy.to(device), self.valid.to(device), extra)


def visible(block_q: Tensor, block_k: Tensor, copy_q: Tensor, copy_k: Tensor, valid_k: Tensor,
            same_token: Tensor) -> Tensor:
    """The layout rule, elementwise over broadcast query / key attributes: the dense mask and the FlexAttention
    block mask are both built from this one function."""
    clean_key = (copy_k == 0) & ((block_k < block_q) | ((block_k == block_q) & (copy_q == 0)))
    same_copy = (copy_k != 0) & (copy_k == copy_q) & (block_k == block_q)
    return ((clean_key | same_copy) & valid_k) | same_token


class KVCache:
    """Per-layer keys/values (after RoPE) plus a per-row validity mask over the cached columns.

    Cached keys are visible to every query of their row (committed blocks, or a Fast-dLLM prefix/suffix), so only
    validity is stored. Commit semantics: a forward with ``store_kv=False`` reads the cache without changing it;
    ``store_kv=True`` appends the new keys/values once. Rows of different history lengths are padded with invalid
    columns, which lets one batched tensor serve sequences at different stages.
    """

    # Whether a layer may run under gradient checkpointing with this cache: a recomputed layer must see the cache as
    # the first pass did, which a cache that stores new columns breaks. train/shared_prefix.py's caches keep it: one
    # is read-only, the other only collects (a recompute collects the same values again).
    checkpointable = False

    def __init__(self, num_layers: int):
        self.keys: list[Tensor | None] = [None] * num_layers  # used columns [B, Hkv, T, D] (views into buffers)
        self.values: list[Tensor | None] = [None] * num_layers
        self.valid: Tensor | None = None  # [B, T] bool
        # Preallocated storage per layer: new keys are written after the used columns and attention reads a view,
        # so a forward never copies the cache (torch.cat per layer per step would copy O(T) every step).
        self._kbuf: list[Tensor | None] = [None] * num_layers
        self._vbuf: list[Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def extend_layer(self, idx: int, k: Tensor, v: Tensor, store: bool | int) -> tuple[Tensor, Tensor]:
        """Keys/values of (cached columns + ``k``/``v``) for attention; with ``store`` the new columns stay cached
        (``store=n``: only the first n new columns, e.g. a finished block stored in the forward that also denoises
        the next block).

        Columns not stored are written to scratch space after the used ones and are overwritten by the next call,
        which is what makes "denoise a block many times, store it once" cheap.
        """
        past_k, past_v = self.keys[idx], self.values[idx]
        used = 0 if past_k is None else past_k.shape[2]
        kbuf = self._buffer(self._kbuf, idx, past_k, k, used)
        vbuf = self._buffer(self._vbuf, idx, past_v, v, used)
        end = used + k.shape[2]
        kbuf[:, :, used:end] = k
        vbuf[:, :, used:end] = v
        k_all, v_all = kbuf[:, :, :end], vbuf[:, :, :end]
        if store is not False:
            kept = used + stored_columns(store, k.shape[2])
            self.keys[idx], self.values[idx] = kbuf[:, :, :kept], vbuf[:, :, :kept]
        return k_all, v_all

    @staticmethod
    def _buffer(bufs: list[Tensor | None], idx: int, past: Tensor | None, new: Tensor, used: int) -> Tensor:
        """This layer's buffer, (re)allocated with room for ``new`` and holding ``past`` in its first columns."""
        buf = bufs[idx]
        need = used + new.shape[2]
        owns_past = past is None or (buf is not None and past.data_ptr() == buf.data_ptr()
                                     and past.shape[:2] == buf.shape[:2] and past.stride() == buf.stride())
        if buf is not None and owns_past and buf.shape[2] >= need and buf.shape[0] == new.shape[0]:
            return buf
        capacity = max(need + need // 2, 16)  # grow geometrically: amortised O(1) copies per column
        fresh = new.new_empty(new.shape[0], new.shape[1], capacity, new.shape[3])
        if past is not None and used:
            fresh[:, :, :used] = past
        bufs[idx] = fresh
        return fresh

    def append_valid(self, valid: Tensor) -> None:
        valid = valid.bool()
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)

def predicting_columns(columns: Tensor, shift_logits: bool, first: Tensor | int | None = None) -> Tensor:
    """The column whose hidden state predicts the token at each column: the one before it for families adapted
    from AR models (shifted logits), itself otherwise; with ``first``, never before it (a row's first real column
    predicts itself: the reference's "duplicate the first logit" convention). Sampler and trainer both use this."""
    if not shift_logits:
        return columns
    cols = columns - 1
    return cols if first is None else torch.maximum(cols, torch.as_tensor(first, device=cols.device))


def stored_columns(store: bool | int, new: int) -> int:
    """How many of ``new`` columns a forward with ``store_kv=store`` keeps in the cache."""
    if store is True:
        return new
    return 0 if store is False else min(int(store), new)


# ---------------------------------------------------------------- attention

# Forwards over a cache fold the query heads that share a K/V head into the query axis
# (``_grouped_query_attention``) unless their device is set False here. CPU: see that function. CUDA: measured for
# the sampler's decode only (H100, bf16, batch 128, 4 queries over 128-2,048 keys; ``bench.gpu --sections
# attention``): 1.1-1.7x per call on SDAR-1.7B's 2 query heads per K/V head, 2.0-2.8x on SDAR-4B's 4, since each
# K/V head is read once instead of once per query head; the SDAR-4B batch-128 sampler 1.28x with CUDA graphs
# (``--fold-query-heads on`` / ``off``). A CUDA forward under autograd (training over a shared prompt prefix, with
# hundreds of queries) keeps ``enable_gqa``: unmeasured there, and its backward would keep the G-times mask too.
FOLD_QUERY_HEADS = {"cpu": True, "cuda": True}


def folds_query_heads(q: Tensor) -> bool:
    """Whether a forward over a cache with these queries folds the query heads (``FOLD_QUERY_HEADS``)."""
    return FOLD_QUERY_HEADS.get(q.device.type, True) and not (q.is_cuda and torch.is_grad_enabled())


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: AttentionLayout,
    cache: KVCache | None,
    layer_idx: int,
    store_kv: bool,
    backend: str = "sdpa",
) -> Tensor:
    """Attention of new queries over (cached keys + new keys). q: [B, H, Q, D]; k, v: [B, Hkv, Q, D]."""
    past_k = cache.keys[layer_idx] if cache is not None else None
    if cache is not None and (past_k is not None or store_kv is not False):
        k_all, v_all = cache.extend_layer(layer_idx, k, v, store_kv)
    else:
        k_all, v_all = k, v
    if backend == "flex" and past_k is None:
        return _flex(q, k_all, v_all, layout)
    if backend == "flash" and flash_attn_func is not None and q.is_cuda and past_k is None and _all_visible(layout):
        out = flash_attn_func(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), causal=False)
        return out.transpose(1, 2)
    past = cache if past_k is not None else None
    # On CPU a layout in which every query sees every key (one row decoding one block, an unpadded full-attention
    # row) runs without a mask: building it is ~30 small operations per forward, a tenth of a batch-1 decode step.
    # On CUDA the check would be a host sync inside the forward; the mask is built there.
    unmasked = not q.is_cuda and _all_visible(layout, past)
    if cache is None and not q.is_cuda and not unmasked and _split_pays(layout):
        return _split_attention(q, k, v, layout)
    groups = q.shape[1] // k.shape[1]
    if past is not None and groups > 1 and folds_query_heads(q):
        mask = None if unmasked else additive_mask(layout, cache, q.dtype, groups)
        return _grouped_query_attention(q, k_all, v_all, mask)
    mask = None if unmasked else additive_mask(layout, past, q.dtype)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=groups > 1)


def _grouped_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """SDPA with the G query heads that share a K/V head folded into the query axis: [B, Hkv, G*Q, D].

    Each query meets the same keys in the same order as under ``enable_gqa``, so on CPU the result is the same
    bit for bit; but a decode step (a few queries over many cached keys) becomes one [G*Q, L] problem per K/V head
    instead of G [Q, L] ones, each too small for a fused kernel, and each K/V head is read once. On 2 cores
    (``bench.cpu_kernels``): 1.3-1.4x per call at batch 32 with 4 queries over 100 keys, about equal at batch 1 and
    with long caches; a batch-32 rollout ~1.1x. On an H100: see ``FOLD_QUERY_HEADS``. ``mask`` is the layout's
    mask repeated for the G heads (``additive_mask(..., groups=G)``), or None.
    """
    b, h, n, d = q.shape
    kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv * n, d), k, v, attn_mask=mask)
    return out.reshape(b, h, n, d)  # on CUDA the kernels may return [B, G*Q, Hkv, D] strides: not a view


def mask_per_group(mask: Tensor, groups: int) -> Tensor:
    """A [B, 1, Q, L] mask repeated along the query axis for ``_grouped_query_attention``: [B, 1, G*Q, L]."""
    b, one, n, keys = mask.shape
    return mask[:, :, None].expand(b, one, groups, n, keys).reshape(b, one, groups * n, keys)


def additive_mask(layout: AttentionLayout, cache: KVCache | None, dtype: torch.dtype, groups: int = 1) -> Tensor:
    """``layout_mask`` as 0 / -inf in the attention's dtype, built once per forward for all layers; with
    ``groups`` > 1, repeated along the query axis for ``_grouped_query_attention``.

    SDPA turns a boolean mask into exactly this in every layer, and under autograd keeps each layer's copy for
    the backward pass (one [B, 1, N, N] tensor per layer); one shared tensor is kept once.
    """
    key = ("additive", cache.length if cache is not None and cache.valid is not None else None, dtype, groups)
    if key not in layout._masks:
        if groups > 1:
            layout._masks[key] = mask_per_group(additive_mask(layout, cache, dtype), groups)
        else:
            mask = layout_mask(layout, cache)
            layout._masks[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
    return layout._masks[key]


# Split attention (CPU, no cache): a TraceRL row [clean sequence | noisy copy 1 | copy 2 | ...] lets each query see a
# small part of the keys (a copy: the clean blocks before it and its own block), so one dense masked [N, N] area
# wastes most of its work. The queries are cut into pieces (each noisy copy; the clean part in chunks of
# SPLIT_CHUNK) and each piece attends only to the keys some query of it may see: the same result, a fraction of
# the area (on CUDA, FlexAttention's block-sparse masks do this: model.attn_backend=flex).
SPLIT_CHUNK = 256
SPLIT_MIN_TOKENS = 512  # shorter rows: one call is cheaper than several
SPLIT_MAX_DENSITY = 0.6  # visible fraction of the [N, N] area below which splitting pays


def _split_pays(layout: AttentionLayout) -> bool:
    if layout.extra is not None:  # annealing's random pairs: every chunk of queries sees nearly every key
        return False
    if "split" not in layout._masks:
        n = layout.block.shape[1]
        layout._masks["split"] = n >= SPLIT_MIN_TOKENS and float(
            layout.dense_mask().float().mean()) < SPLIT_MAX_DENSITY  # one host sync per forward
    return layout._masks["split"]


_Piece = tuple[int, int, Tensor, "Tensor | None"]  # q0, q1, visible key columns, additive mask over them


def _split_plan(layout: AttentionLayout, dtype: torch.dtype = torch.float32) -> list[list[_Piece]]:
    """Per row, pieces (q0, q1, visible key columns, additive mask of the piece over them) covering every query once.

    The masks are additive (0 / -inf) in the attention's dtype: SDPA would convert a boolean mask into one in every
    layer and keep each copy for the backward pass; one shared tensor per piece is kept once for all layers.
    """
    key = ("split_plan", dtype)
    if key in layout._masks:
        return layout._masks[key]
    mask = layout.dense_mask()[:, 0]
    copy = layout.copy.cpu()
    n = copy.shape[1]
    plan = []
    for row in range(copy.shape[0]):
        c = copy[row]
        bounds = [0, *((c[1:] != c[:-1]).nonzero().squeeze(1) + 1).tolist(), n]
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            step = SPLIT_CHUNK if int(c[start]) == 0 else end - start
            for q0 in range(start, end, step):
                q1 = min(q0 + step, end)
                keys = mask[row, q0:q1].any(0).nonzero().squeeze(1)
                visible = mask[row, q0:q1].index_select(1, keys)
                additive = None if bool(visible.all()) else torch.zeros(
                    visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))[None, None]
                pieces.append((q0, q1, keys, additive))
        plan.append(pieces)
    layout._masks[key] = plan
    return plan


def _split_attention(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for row, pieces in enumerate(_split_plan(layout, q.dtype)):
        qr, kr, vr = q[row:row + 1], k[row:row + 1], v[row:row + 1]
        parts = [F.scaled_dot_product_attention(qr[:, :, q0:q1], kr.index_select(2, keys), vr.index_select(2, keys),
                                                attn_mask=piece_mask, enable_gqa=gqa)
                 for q0, q1, keys, piece_mask in pieces]
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows, 0)


def layout_mask(layout: AttentionLayout, cache: KVCache | None) -> Tensor:
    """Boolean [B, 1, Q, T+Q] mask: cached columns visible where valid, then the layout among new tokens."""
    mask = layout.dense_mask()
    if cache is None or cache.valid is None:
        return mask
    key = ("with_cache", cache.length)  # the same cache width for every layer of one forward
    if key not in layout._masks:
        past = cache.valid[:, None, None, :].expand(-1, 1, mask.shape[2], -1)
        layout._masks[key] = torch.cat([past, mask], dim=-1)
    return layout._masks[key]


def _all_visible(layout: AttentionLayout, cache: KVCache | None = None) -> bool:
    """Every query may see every key: valid tokens of one block and one copy, and (with a cache) every cached
    column valid. Evaluated once per forward (one host sync), not per layer."""
    key = ("all_visible", cache.length if cache is not None and cache.valid is not None else None)
    if key not in layout._masks:
        flags = [layout.valid.all(), (layout.block == layout.block[:, :1]).all(),
                 (layout.copy == layout.copy[:, :1]).all()]
        if cache is not None and cache.valid is not None:
            flags.append(cache.valid.all())
        layout._masks[key] = bool(torch.stack(flags).all())
    return layout._masks[key]


_FLEX_COMPILED: dict = {}


def _flex(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """FlexAttention with a block-sparse mask from the layout rule (compiled on CUDA; eager elsewhere, for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "block_mask" not in layout._masks:
        layout._masks["block_mask"] = _flex_block_mask(layout, q.shape[2], q.device)
    fn = flex_attention
    if q.is_cuda:  # pragma: no cover - GPU only
        if q.shape[-1] < 16:  # torch's FlexAttention kernels refuse smaller heads (NYI) deep inside the compiler
            raise ValueError(f"model.attn_backend=flex needs a head dimension of at least 16 on CUDA; this model's is "
                             f"{q.shape[-1]}: use attn_backend=sdpa")
        # Default compile settings (not dynamic=False): row lengths vary per batch, and automatic dynamic shapes
        # avoid a recompile per length (the FlexAttention maintainers' advice, pytorch/pytorch#141486).
        fn = _FLEX_COMPILED.setdefault("fn", torch.compile(flex_attention))
    return fn(q, k, v, block_mask=layout._masks["block_mask"], enable_gqa=q.shape[1] != k.shape[1])


def _flex_block_mask(layout: AttentionLayout, n: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    block, copy, valid, extra = layout.block, layout.copy, layout.valid, layout.extra

    def mask_mod(b, h, qi, kj):  # the AttentionLayout rule, evaluated per (query, key) pair
        seen = visible(block[b, qi], block[b, kj], copy[b, qi], copy[b, kj], valid[b, kj], qi == kj)
        return seen if extra is None else seen | (extra[qi, kj] & valid[b, kj])

    return create_block_mask(mask_mod, block.shape[0], None, n, n, device=device)


__all__ = [
    "AttentionLayout",
    "KVCache",
    "attend",
    "layout_mask",
    "stored_columns",
]
