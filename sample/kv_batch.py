"""Batch management of the KV cache for the samplers: sequences joining and leaving the batch, rows of
different history lengths, repacking, swapping rows.

``models.common.KVCache`` is the storage a forward reads and appends to (keys, values, per-row validity); these
operations exist only because a sampler keeps many sequences of different lengths in one batched cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.common import KVCache


class BatchKVCache(KVCache):
    """A KV cache whose rows are sequences of a sampler's batch."""

    def select_rows(self, rows: Tensor, compact: bool = True) -> BatchKVCache:
        """A cache holding only the given rows (finished sequences leave the batch); ``compact``: without the
        leading columns no row uses any more (a host sync), else every column kept."""
        out = BatchKVCache(len(self.keys))
        out.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
        out.values = [None if v is None else v.index_select(0, rows) for v in self.values]
        out.valid = None if self.valid is None else self.valid.index_select(0, rows)
        return out.compact() if compact else out

    def row_copy(self, row: int, n: int) -> BatchKVCache:
        """A one-row cache holding a copy of row ``row``'s first ``n`` columns (its own storage: keeping it does not
        keep this cache's tensors alive)."""
        out = BatchKVCache(len(self.keys))
        out.keys = [None if k is None else k[row:row + 1, :, :n].clone() for k in self.keys]
        out.values = [None if v is None else v[row:row + 1, :, :n].clone() for v in self.values]
        out.valid = self.valid[row:row + 1, :n].clone()
        return out

    def compact(self) -> BatchKVCache:
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
    def empty(cls, n_rows: int, num_layers: int, device: torch.device | str) -> BatchKVCache:
        """A cache for ``n_rows`` rows that have nothing cached yet (no key tensors, zero columns)."""
        out = cls(num_layers)
        out.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=device)
        return out

    def _with_tensors(self, template: BatchKVCache) -> BatchKVCache:
        """This cache with zero-width key/value tensors shaped like ``template``'s if it has none yet."""
        if self.keys[0] is not None or template.keys[0] is None:
            return self
        n = self.valid.shape[0]
        out = BatchKVCache(len(self.keys))
        out.keys = [k.new_zeros(n, k.shape[1], self.length, k.shape[3]) for k in template.keys]
        out.values = [v.new_zeros(n, v.shape[1], self.length, v.shape[3]) for v in template.values]
        out.valid = self.valid
        return out

    @staticmethod
    def concat_rows(caches: list[BatchKVCache]) -> BatchKVCache:
        """Stack caches of different lengths row-wise; shorter ones get invalid columns at the end.

        Caches without key tensors yet (rows with nothing cached) are allowed."""
        caches = [c for c in caches if c.valid is not None and c.valid.shape[0] > 0]
        template = next((c for c in caches if c.keys[0] is not None), None)
        width = max(c.length for c in caches)
        out = BatchKVCache(len(caches[0].keys))
        out.valid = torch.cat([F.pad(c.valid, (0, width - c.length), value=False) for c in caches], 0)
        if template is None:
            return out
        caches = [c._with_tensors(template) for c in caches]
        for idx in range(len(out.keys)):
            out.keys[idx] = torch.cat([_pad_cols(c.keys[idx], width) for c in caches], 0)
            out.values[idx] = torch.cat([_pad_cols(c.values[idx], width) for c in caches], 0)
        return out

    @staticmethod
    def join(first: BatchKVCache | None, second: BatchKVCache) -> BatchKVCache:
        """Rows of ``first`` (may be None or empty) followed by rows of ``second``."""
        if first is None or first.valid is None or first.valid.shape[0] == 0:
            return second
        return BatchKVCache.concat_rows([first, second])

    def repack(self, width: int | None = None) -> BatchKVCache:
        """Every row's valid columns moved to the left, ``width`` columns kept (default: the most any row has).

        Column order is kept (RoPE is already applied, so only relative order within a row matters)."""
        if self.valid is None or self.keys[0] is None:
            return self
        order, valid = _left_packed(self.valid, width)
        out = BatchKVCache(len(self.keys))
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            idx = order[:, None, :, None].expand(k.shape[0], k.shape[1], order.shape[1], k.shape[3])
            out.keys[layer], out.values[layer] = k.gather(2, idx), v.gather(2, idx)
        out.valid = valid
        return out

    def replace_rows(self, rows: Tensor, sub: BatchKVCache) -> BatchKVCache:
        """This cache with ``rows`` replaced by the rows of ``sub`` (widths padded with invalid columns)."""
        main = self._with_tensors(sub)
        width = max(main.length, sub.length)
        out = BatchKVCache(len(main.keys))
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


def _left_packed(valid: Tensor, width: int | None) -> tuple[Tensor, Tensor]:
    """(column order, validity) of ``valid`` [rows, T] with every row's valid columns moved to the left in their
    order, ``width`` columns kept (default: the most any row has): gather a cache's columns by the order."""
    counts = valid.sum(1)
    width = int(counts.max()) if width is None else width
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
    return order, torch.arange(width, device=valid.device)[None, :] < counts[:, None]


def _pad_cols(t: Tensor, width: int) -> Tensor:
    return F.pad(t, (0, 0, 0, width - t.shape[2]))


class StaticKVCache:
    """A fixed-capacity KV cache for decode forwards of unchanging shapes (what a CUDA graph replays).

    Keys and values of all layers live in one buffer each, [L, S, Hkv, C + W, D]: S slots (a sampler's rows, then
    padding), C cache columns, W scratch columns. A forward over the first ``s`` slots (``view(s)``) writes its new
    keys to the scratch columns and attends over all C + n columns, the cache's invalid ones masked; so every
    forward of one (s, n) reads and writes the same addresses whatever is cached. The columns it stores are copied
    into the cache afterwards by ``commit``, outside the forward, at the column ``end`` shared by every slot (rows
    of different lengths leave invalid columns; attention does not depend on the order of its keys, and RoPE is
    applied before caching). Invariant: ``valid[:, end:]`` is all False.
    """

    def __init__(self, layers: int, slots: int, heads: int, capacity: int, scratch: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.capacity, self.scratch, self.end = capacity, scratch, 0
        shape = (layers, slots, heads, capacity + scratch, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(slots, capacity, dtype=torch.bool, device=device)
        self.pending_valid = torch.zeros(slots, scratch, dtype=torch.bool, device=device)

    @property
    def slots(self) -> int:
        return self.valid.shape[0]

    def view(self, s: int) -> StaticView:
        """The cache a forward over the first ``s`` slots reads and writes."""
        return StaticView(self, s)

    def commit(self, stored: int, rows: int, keep: Tensor | None = None) -> None:
        """Store the first ``stored`` scratch columns of the last forward at ``end``: valid for the first ``rows``
        slots where that forward's layout was valid (and, with ``keep`` [rows], only in the rows it marks)."""
        if stored == 0:
            return
        if self.end + stored > self.capacity:
            raise RuntimeError(f"static KV cache full: {self.end} + {stored} columns > capacity {self.capacity}")
        cols = slice(self.end, self.end + stored)
        scratch = slice(self.capacity, self.capacity + stored)
        self.keys[:, :, :, cols] = self.keys[:, :, :, scratch]
        self.values[:, :, :, cols] = self.values[:, :, :, scratch]
        valid = self.pending_valid[:, :stored].clone()
        valid[rows:] = False  # padding slots never hold a valid column
        if keep is not None:
            valid[:rows] &= keep[:, None]
        self.valid[:, cols] = valid
        self.end += stored

    def place(self, first: int, cache: BatchKVCache) -> None:
        """Write the rows of ``cache`` (a prefill) into slots ``first``.., at columns 0.. of those slots."""
        n = cache.valid.shape[0]
        width = cache.length
        self.valid[first:first + n] = False
        if width:
            for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
                self.keys[layer, first:first + n, :, :width] = k
                self.values[layer, first:first + n, :, :width] = v
            self.valid[first:first + n, :width] = cache.valid
        self.end = max(self.end, width)

    def keep_rows(self, rows: Tensor) -> None:
        """Slots 0..len(rows)-1 take the rows ``rows`` (ascending); the slots after them are freed."""
        n = rows.shape[0]
        self.keys[:, :n] = self.keys.index_select(1, rows)
        self.values[:, :n] = self.values.index_select(1, rows)
        self.valid[:n] = self.valid.index_select(0, rows)
        self.valid[n:] = False
        if n == 0:
            self.end = 0

    def repack(self, width: int | None = None) -> None:
        """Every slot's valid columns moved to its first columns, in place (the buffers keep their addresses);
        ``end`` becomes ``width`` (default: the most any slot holds)."""
        order, valid = _left_packed(self.valid[:, :self.end], width)
        width = order.shape[1]
        layers, slots, heads, _, dim = self.keys.shape
        idx = order[None, :, None, :, None].expand(layers, slots, heads, width, dim)
        for buf in (self.keys, self.values):
            buf[:, :, :, :width] = buf[:, :, :, :self.end].gather(3, idx)
        self.valid[:, :width] = valid
        self.valid[:, width:] = False
        self.end = width

    def resized(self, slots: int, capacity: int) -> StaticKVCache:
        """A larger cache holding this one's slots and columns (new addresses: graphs must be captured again)."""
        layers, old_slots, heads, _, dim = self.keys.shape
        out = StaticKVCache(layers, slots, heads, capacity, self.scratch, dim, self.keys.dtype, self.keys.device)
        keep = min(old_slots, slots)
        out.keys[:, :keep, :, :self.end] = self.keys[:, :keep, :, :self.end]
        out.values[:, :keep, :, :self.end] = self.values[:, :keep, :, :self.end]
        out.valid[:keep, :self.end] = self.valid[:keep, :self.end]
        out.end = self.end
        return out


class StaticView(KVCache):
    """The first ``s`` slots of a ``StaticKVCache`` as the cache a model forward reads (see there)."""

    def __init__(self, store: StaticKVCache, s: int):
        super().__init__(store.keys.shape[0])
        self.store, self.s = store, s
        cap = store.capacity
        self.keys = [store.keys[layer, :s, :, :cap] for layer in range(store.keys.shape[0])]
        self.values = [store.values[layer, :s, :, :cap] for layer in range(store.keys.shape[0])]
        self.valid = store.valid[:s]

    def extend_layer(self, idx: int, k: Tensor, v: Tensor, store: bool | int) -> tuple[Tensor, Tensor]:
        end = self.store.capacity + k.shape[2]
        kbuf, vbuf = self.store.keys[idx, :self.s], self.store.values[idx, :self.s]
        kbuf[:, :, self.store.capacity:end] = k
        vbuf[:, :, self.store.capacity:end] = v
        return kbuf[:, :, :end], vbuf[:, :, :end]

    def append_valid(self, valid: Tensor) -> None:
        self.store.pending_valid[:self.s, :valid.shape[1]] = valid
