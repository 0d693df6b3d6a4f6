"""Pieces shared by every architecture: attention layouts, the KV cache, attention backends, RoPE, RMSNorm.

A model family differs only in parameter names and small details (q/k norm, biases); the attention math lives
here once so that the sampler and the trainer see exactly the same computation for every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    packed layout (several masked copies, one per round).
    """

    block: Tensor  # [B, N] long
    copy: Tensor  # [B, N] long, 0 = clean
    valid: Tensor  # [B, N] bool, False = padding (never a visible key)
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
        return mask[:, None]

    def to(self, device: torch.device | str) -> AttentionLayout:
        return AttentionLayout(self.block.to(device), self.copy.to(device), self.valid.to(device))


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

    def select_rows(self, rows: Tensor) -> KVCache:
        """A cache holding only the given rows (finished sequences leave the batch)."""
        out = KVCache(len(self.keys))
        out.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
        out.values = [None if v is None else v.index_select(0, rows) for v in self.values]
        out.valid = None if self.valid is None else self.valid.index_select(0, rows)
        return out.compact()

    def compact(self) -> KVCache:
        """Drop leading columns that no row uses (left behind by rows that left the batch)."""
        if self.valid is None or self.valid.shape[1] == 0:
            return self
        used = self.valid.any(0)
        if used.all():
            return self
        keep = used.nonzero().squeeze(1)
        self.keys = [None if k is None else k.index_select(2, keep) for k in self.keys]
        self.values = [None if v is None else v.index_select(2, keep) for v in self.values]
        self.valid = self.valid.index_select(1, keep)
        return self

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` columns (a prefix cache)."""
        self.keys = [None if k is None else k[:, :, :n] for k in self.keys]
        self.values = [None if v is None else v[:, :, :n] for v in self.values]
        if self.valid is not None:
            self.valid = self.valid[:, :n]

    @classmethod
    def empty(cls, n_rows: int, num_layers: int, device: torch.device | str) -> KVCache:
        """A cache for ``n_rows`` rows that have nothing cached yet (no key tensors, zero columns)."""
        out = cls(num_layers)
        out.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=device)
        return out

    def _with_tensors(self, template: KVCache) -> KVCache:
        """This cache with zero-width key/value tensors shaped like ``template``'s if it has none yet."""
        if self.keys[0] is not None or template.keys[0] is None:
            return self
        n = self.valid.shape[0]
        out = KVCache(len(self.keys))
        out.keys = [k.new_zeros(n, k.shape[1], self.length, k.shape[3]) for k in template.keys]
        out.values = [v.new_zeros(n, v.shape[1], self.length, v.shape[3]) for v in template.values]
        out.valid = self.valid
        return out

    @staticmethod
    def concat_rows(caches: list[KVCache]) -> KVCache:
        """Stack caches of different lengths row-wise; shorter ones get invalid columns at the end.

        Caches without key tensors yet (rows with nothing cached) are allowed."""
        caches = [c for c in caches if c.valid is not None and c.valid.shape[0] > 0]
        template = next((c for c in caches if c.keys[0] is not None), None)
        width = max(c.length for c in caches)
        out = KVCache(len(caches[0].keys))
        out.valid = torch.cat([F.pad(c.valid, (0, width - c.length), value=False) for c in caches], 0)
        if template is None:
            return out
        caches = [c._with_tensors(template) for c in caches]
        for idx in range(len(out.keys)):
            out.keys[idx] = torch.cat([_pad_cols(c.keys[idx], width) for c in caches], 0)
            out.values[idx] = torch.cat([_pad_cols(c.values[idx], width) for c in caches], 0)
        return out

    @staticmethod
    def join(first: KVCache | None, second: KVCache) -> KVCache:
        """Rows of ``first`` (may be None or empty) followed by rows of ``second``."""
        if first is None or first.valid is None or first.valid.shape[0] == 0:
            return second
        return KVCache.concat_rows([first, second])

    def repack(self, width: int | None = None) -> KVCache:
        """Every row's valid columns moved to the left, ``width`` columns kept (default: the most any row has).

        Column order is kept (RoPE is already applied, so only relative order within a row matters)."""
        if self.valid is None or self.keys[0] is None:
            return self
        counts = self.valid.sum(1)
        width = int(counts.max()) if width is None else width
        order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        out = KVCache(len(self.keys))
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            idx = order[:, None, :, None].expand(k.shape[0], k.shape[1], width, k.shape[3])
            out.keys[layer], out.values[layer] = k.gather(2, idx), v.gather(2, idx)
        out.valid = torch.arange(width, device=counts.device)[None, :] < counts[:, None]
        return out

    def replace_rows(self, rows: Tensor, sub: KVCache) -> KVCache:
        """This cache with ``rows`` replaced by the rows of ``sub`` (widths padded with invalid columns)."""
        main = self._with_tensors(sub)
        width = max(main.length, sub.length)
        out = KVCache(len(main.keys))
        for layer in range(len(main.keys)):
            for store, big, small in ((out.keys, main.keys[layer], sub.keys[layer]),
                                      (out.values, main.values[layer], sub.values[layer])):
                big = F.pad(big, (0, 0, 0, width - big.shape[2]))
                big[rows] = F.pad(small, (0, 0, 0, width - small.shape[2]))
                store[layer] = big
        valid = F.pad(main.valid, (0, width - main.length), value=False)
        valid[rows] = F.pad(sub.valid, (0, width - sub.length), value=False)
        out.valid = valid
        return out.compact()


def stored_columns(store: bool | int, new: int) -> int:
    """How many of ``new`` columns a forward with ``store_kv=store`` keeps in the cache."""
    if store is True:
        return new
    return 0 if store is False else min(int(store), new)


def _pad_cols(t: Tensor, width: int) -> Tensor:
    return F.pad(t, (0, 0, 0, width - t.shape[2]))


# ---------------------------------------------------------------- attention


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
    if backend == "flash" and flash_attn_func is not None and q.is_cuda and _layout_is_full(layout) and past_k is None:
        out = flash_attn_func(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), causal=False)
        return out.transpose(1, 2)
    mask = layout_mask(layout, cache if past_k is not None else None)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


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


def _layout_is_full(layout: AttentionLayout) -> bool:
    """Unpadded full attention (flash-attn needs no mask); evaluated once per forward, not per layer."""
    if "is_full" not in layout._masks:
        flags = torch.stack([layout.valid.all(), (layout.block == 0).all(), (layout.copy == 0).all()])
        layout._masks["is_full"] = bool(flags.all())  # one host sync
    return layout._masks["is_full"]


_FLEX_COMPILED: dict = {}


def _flex(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """FlexAttention with a block-sparse mask from the layout rule (compiled on CUDA; eager elsewhere, for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if "block_mask" not in layout._masks:
        layout._masks["block_mask"] = _flex_block_mask(layout, q.shape[2], q.device)
    fn = flex_attention
    if q.is_cuda:  # pragma: no cover - GPU only
        # Default compile settings (not dynamic=False): row lengths vary per batch, and automatic dynamic shapes
        # avoid a recompile per length (the FlexAttention maintainers' advice, pytorch/pytorch#141486).
        fn = _FLEX_COMPILED.setdefault("fn", torch.compile(flex_attention))
    return fn(q, k, v, block_mask=layout._masks["block_mask"], enable_gqa=q.shape[1] != k.shape[1])


def _flex_block_mask(layout: AttentionLayout, n: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    block, copy, valid = layout.block, layout.copy, layout.valid

    def mask_mod(b, h, qi, kj):  # the AttentionLayout rule, evaluated per (query, key) pair
        return visible(block[b, qi], block[b, kj], copy[b, qi], copy[b, kj], valid[b, kj], qi == kj)

    return create_block_mask(mask_mod, block.shape[0], None, n, n, device=device)


# ---------------------------------------------------------------- RoPE and norms


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, N, D] for rotate-half RoPE, computed in fp32 from explicit positions.

    Frequencies are computed on the fly (no buffer), so nothing can be left uninitialised by ``from_pretrained``.
    """
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def split_heads(x: Tensor, n_heads: int, head_dim: int) -> Tensor:
    b, n, _ = x.shape
    return x.view(b, n, n_heads, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def init_linear_normal(module: nn.Module, std: float) -> None:
    """Plain normal init for freshly built (random) models; loading a checkpoint overwrites it."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


__all__ = [
    "AttentionLayout",
    "KVCache",
    "RMSNorm",
    "apply_rope",
    "attend",
    "layout_mask",
    "merge_heads",
    "rope_cos_sin",
    "split_heads",
    "init_linear_normal",
    "stored_columns",
]
