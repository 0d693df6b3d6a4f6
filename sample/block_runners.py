"""Model runners of the block sampler: one forward of the active blocks of every row, against a cache.

``CachedRunner`` keeps a growing batched cache (``sample.kv_batch.BatchKVCache``): rows join, leave and are
repacked, so the shapes of its forwards change from step to step. ``StaticRunner`` (``rollout.cuda_graphs``) runs the
same steps on a fixed-capacity cache with the rows padded to a bucket, so a forward has one of three shapes per
bucket and, on CUDA, is captured once as a CUDA graph and replayed with its inputs copied in (on CPU the same
static-shape path runs eagerly: what the tests pin). ``RecomputeRunner`` is the reference path without a cache.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.common import AttentionLayout, stored_columns
from sample.engine import RolloutStats, on_device
from sample.kv_batch import BatchKVCache, StaticKVCache

PREFILL_TOKENS = 16384  # at most this many prompt tokens per prefill forward
# Prefills of the most recent distinct prompt prefixes are kept, up to this many bytes of keys and values, for later
# admissions: an RL group's n copies of a prompt join the batch over several steps as rows free up, and each copy
# after the first reuses the prefill instead of redoing it (SmolLM2-135M: ~90 prompts of 60 tokens in fp32;
# SDAR-4B in bf16: 3 prompts of 500 tokens, as many as a group-ordered rollout has partly admitted at a time).
PREFIX_MEMORY_BYTES = 256 * 2**20
REPACK_SLACK = 8  # blocks of invalid cache columns tolerated per row before a repack
# Padded batch sizes of graphed forwards: a few graphs cover every batch, padding at most a third of the rows
# past 16 (as vLLM / nano-vllm bucket theirs).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The fixed-capacity cache reserves the response budget up front only while the whole cache then takes at most this
# share of the device's free memory (256 rows x 2,000 tokens on a TraDo-4B shape would be ~80 GiB); past it the cache
# starts at the prompts and doubles as responses need it, the graphs captured again at each doubling.
RESERVE_MEMORY_SHARE = 0.5


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or for a CPU cache the host's available memory (Linux's MemAvailable); None
    where it is unknown. A server's settings group has no response budget of its own (each request brings one), so
    its hint is unbounded and only this keeps the reservation within memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bucket_for(rows: int) -> int:
    """The padded batch a forward of ``rows`` rows runs at: the smallest bucket that holds them (past the largest
    bucket, the next multiple of it)."""
    for size in GRAPH_BUCKETS:
        if rows <= size:
            return size
    top = GRAPH_BUCKETS[-1]
    return -(-rows // top) * top


class CachedRunner:
    """Runs the model over active blocks against a batched commit-semantics KV cache."""

    stores_blocks = True  # a finished block's K/V are stored by the next forward (it carries the block)

    def __init__(self, adapter, block_size: int, stats: RolloutStats):
        self.adapter, self.b, self.stats = adapter, block_size, stats
        self.num_layers = len(adapter.new_cache().keys)
        self.device = next(adapter.model.parameters()).device
        self.cache: BatchKVCache | None = None
        self.memory: OrderedDict[tuple[int, ...], BatchKVCache] = OrderedDict()  # prefix -> its one-row prefill

    def admit(self, prefixes: list[list[int]]) -> None:
        """Prefill the complete prompt blocks of new rows and append the rows to the batch cache."""
        cache = self.cache
        for part in self._prefilled(prefixes):
            cache = BatchKVCache.join(cache, part)
        self.cache = cache  # only once every part is in: a failure leaves the batch cache as it was

    def admission_mark(self) -> Any:
        """What :meth:`undo_admission` needs to put the batch back as it is now (no copy)."""
        return self.cache

    def undo_admission(self, mark: Any) -> None:
        self.cache = mark

    def _prefilled(self, prefixes: list[list[int]]) -> list[BatchKVCache]:
        """The cache rows of ``prefixes`` (token ids), in order, as consecutive parts; one forward per distinct
        prefix: copies of a prompt (an RL group's samples, a request's n choices) share it, within this admission
        and with the prefixes of earlier ones still kept (``PREFIX_MEMORY_BYTES``). Without copies or kept ones
        the parts are the prefill chunks themselves (nothing copied: a large admission's peak memory as before)."""
        keys = [tuple(p) for p in prefixes]
        distinct = list(dict.fromkeys(keys))
        new = [k for k in distinct if k not in self.memory]
        parts = [self._prefill(chunk) for chunk in _chunks([on_device(list(k), self.device) for k in new],
                                                           PREFILL_TOKENS)] if new else []
        kept = [k for k in distinct if k in self.memory]
        kept_parts = [self.memory[k] for k in kept]
        self._remember(parts, new, kept)
        if not kept and len(new) == len(keys):
            return parts
        # kept prefills are copied into the pool: the batch cache built from it is written to by later forwards
        pool = BatchKVCache.concat_rows(parts + kept_parts)
        pool_keys = new + kept
        if pool_keys == keys:
            return [pool]
        where = {k: j for j, k in enumerate(pool_keys)}
        return [pool.select_rows(on_device([where[k] for k in keys], self.device), compact=False)]

    def _remember(self, parts: list[BatchKVCache], new: list[tuple[int, ...]], kept: list[tuple[int, ...]]) -> None:
        """Make this admission's prefixes the most recent kept ones: copies of the ``new`` prefills (the rows of
        ``parts``, in order), the ``kept`` ones moved up. When ``PREFIX_MEMORY_BYTES`` cannot hold them all, the
        last that fit are kept and the oldest kept ones go."""
        sized = next((c for c in [*parts, *self.memory.values()] if c.keys[0] is not None), None)
        if sized is None:
            return  # nothing was prefilled (prompts shorter than a block): nothing to reuse
        per_token = 2 * sum(k[0, :, :1].nbytes for k in sized.keys if k is not None)  # K and V of one position
        keys, rows = new + kept, [(part, r) for part in parts for r in range(part.valid.shape[0])]
        first, total = len(keys), 0
        while first > 0 and total + len(keys[first - 1]) * per_token <= PREFIX_MEMORY_BYTES:
            first -= 1
            total += len(keys[first]) * per_token
        for j in range(first, len(keys)):
            if j >= len(new):
                self.memory.move_to_end(keys[j])
            elif rows[j][0].keys[0] is not None:
                self.memory[keys[j]] = rows[j][0].row_copy(rows[j][1], len(keys[j]))
        size = sum(map(len, self.memory)) * per_token
        while size > PREFIX_MEMORY_BYTES:
            size -= len(self.memory.popitem(last=False)[0]) * per_token

    def _prefill(self, prefixes: list[Tensor]) -> BatchKVCache:
        device = prefixes[0].device
        width = max(p.numel() for p in prefixes)
        if width == 0:
            return BatchKVCache.empty(len(prefixes), self.num_layers, device)
        ids = torch.stack([F.pad(p, (0, width - p.numel()), value=self.adapter.pad_id) for p in prefixes])
        valid = torch.stack([torch.arange(width, device=device) < p.numel() for p in prefixes])
        pos = torch.arange(width, device=device).expand_as(ids)
        cache = BatchKVCache(self.num_layers)
        self.adapter.hidden(ids, pos, AttentionLayout.block_causal(pos, self.b, valid), cache, store_kv=True)
        self.stats.forwards += 1
        return cache

    def step(self, tokens: Tensor, positions: Tensor, carry: Tensor | None, carrying: Tensor | None,
             fused: bool = True) -> Tensor:
        """Hidden states [R, b, H] of the active blocks. With ``carry``, rows in ``carrying`` also hold their
        finished previous block, whose K/V are stored: fused, it runs in front of the active block in the same
        row (for the other rows those columns are padding: invalid keys, repacked later); not fused, it runs
        instead of the active block (those rows' hidden states are then not used)."""
        self.stats.forwards += 1
        if carry is None:
            return self._forward(tokens, positions, None, False)
        if not fused:
            ids = torch.where(carrying[:, None], carry, tokens)
            return self._forward(ids, positions - self.b * carrying[:, None].long(), None, True, keep=carrying)
        ids = torch.cat([carry, tokens], 1)
        pos = torch.cat([(positions - self.b).clamp(min=0), positions], 1)
        valid = torch.cat([carrying[:, None].expand(-1, self.b), torch.ones_like(tokens, dtype=torch.bool)], 1)
        return self._forward(ids, pos, valid, self.b)[:, self.b:]

    def _forward(self, ids: Tensor, pos: Tensor, valid: Tensor | None, store: bool | int,
                 keep: Tensor | None = None) -> Tensor:
        """Hidden states of one forward storing ``store`` of its columns (stored columns stay valid only in the
        rows ``keep`` marks, when given)."""
        hidden = self.adapter.hidden(ids, pos, AttentionLayout.block_causal(pos, self.b, valid), self.cache,
                                     store_kv=store)
        if keep is not None:
            self.cache.valid[:, -self.b:] &= keep[:, None]
        return hidden

    def saved(self, rows: list[int], blocks: Tensor, max_cached: int) -> None:
        """After blocks finished: drop the invalid columns once they exceed the slack (no host sync needed)."""
        if self.cache.length > max_cached + REPACK_SLACK * self.b:
            self.cache = self.cache.repack(max_cached)

    def keep(self, rows: Tensor) -> None:
        self.cache = self.cache.select_rows(rows) if len(rows) else None


class StaticRunner(CachedRunner):
    """``CachedRunner``'s steps on a ``StaticKVCache``: the rows padded to ``bucket_for(rows)`` slots (padding
    rows attend within their own block and never store a valid column), so a forward's shapes depend only
    on (bucket, width, stored columns). With ``graphs`` (CUDA), each such forward is captured once as a CUDA graph
    and replayed with the inputs copied into its static buffers; the cache grows (and the graphs are captured
    again) only when a prompt or the batch outgrows it. ``capacity_hint``: the response budget, so the first
    allocation holds prompt + response + the repack slack."""

    def __init__(self, adapter, block_size: int, stats: RolloutStats, capacity_hint: int = 0,
                 graphs: bool = False):
        super().__init__(adapter, block_size, stats)
        self.capacity_hint, self.graphs = capacity_hint, graphs
        self.rows = 0
        self.store: StaticKVCache | None = None
        self.inputs: dict[str, Tensor] = {}
        self.captured: dict[tuple[int, int, bool | int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = None

    def admit(self, prefixes: list[list[int]]) -> None:
        for part in self._prefilled(prefixes):
            n = part.valid.shape[0]
            self._fit(self.rows + n, part)
            self.store.place(self.rows, part)
            self.rows += n

    def _fit(self, rows: int, prefill: BatchKVCache) -> None:
        """Make the cache hold ``rows`` rows and the prefilled prompts (with their responses where affordable)."""
        base = prefill.length + (REPACK_SLACK + 2) * self.b
        if self.store is None:
            self._allocate(bucket_for(rows), base, prefill)
            return
        if rows <= self.store.slots and base + self.capacity_hint <= self.store.capacity:
            return  # room for these prompts and their responses: no need to ask the device for its free memory
        slots = bucket_for(max(rows, self.store.slots))
        need = base + self._affordable_hint(slots, base, self.store.keys)
        if rows > self.store.slots or need > self.store.capacity:
            self._grow(slots, max(need, self.store.capacity))

    def _allocate(self, slots: int, base: int, prefill: BatchKVCache) -> None:
        k = prefill.keys[0]
        if k is None:  # nothing prefilled: one block's forward gives the cached K/V's heads, width and dtype
            probe = BatchKVCache(self.num_layers)
            pos = torch.arange(self.b, device=prefill.valid.device)[None]
            self.adapter.hidden(torch.full_like(pos, self.adapter.pad_id), pos,
                                AttentionLayout.block_causal(pos, self.b), probe, store_kv=True)
            k = probe.keys[0]
        capacity = base + self._affordable_hint(slots, base, k)
        self.store = StaticKVCache(self.num_layers, slots, k.shape[1], _round_up(capacity, self.b), 2 * self.b,
                                   k.shape[3], k.dtype, k.device)
        self._new_inputs(slots)

    def _affordable_hint(self, slots: int, base: int, keys: Tensor) -> int:
        """``capacity_hint`` if a cache of ``slots`` x (``base`` + hint) columns of keys like ``keys`` (heads and
        width in dims -3 and -1) fits RESERVE_MEMORY_SHARE of the device's free memory, else 0."""
        free = free_device_bytes(keys.device)
        if free is None or not self.capacity_hint:
            return self.capacity_hint
        column_bytes = 2 * self.num_layers * keys.shape[-3] * keys.shape[-1] * keys.element_size()  # K and V
        fits = slots * (base + self.capacity_hint) * column_bytes <= RESERVE_MEMORY_SHARE * free
        return self.capacity_hint if fits else 0

    def _grow(self, slots: int, capacity: int) -> None:
        self.store = self.store.resized(slots, _round_up(max(capacity, 2 * self.store.capacity), self.b)
                                        if capacity > self.store.capacity else self.store.capacity)
        self._new_inputs(slots)

    def _new_inputs(self, slots: int) -> None:
        """Static input buffers for forwards up to 2 blocks wide (new addresses: drop the captured graphs)."""
        device = self.store.valid.device
        self.inputs = {"ids": torch.full((slots, 2 * self.b), self.adapter.pad_id, dtype=torch.long, device=device),
                       "pos": torch.arange(2 * self.b, device=device).repeat(slots, 1),
                       "valid": torch.ones(slots, 2 * self.b, dtype=torch.bool, device=device)}
        # the dropped graphs release their memory pool; capturing into a released pool trips an internal assert of
        # torch's caching allocator (seen on torch 2.11, H100), so the next captures take a fresh pool
        self.captured.clear()
        self.pool = None

    def _forward(self, ids: Tensor, pos: Tensor, valid: Tensor | None, store: bool | int,
                 keep: Tensor | None = None) -> Tensor:
        rows, n = ids.shape
        stored = stored_columns(store, n)
        if self.store.end + stored > self.store.capacity:
            self.store.repack()
            if self.store.end + stored > self.store.capacity:
                self._grow(self.store.slots, self.store.capacity + stored)
        s = bucket_for(rows)
        buf = {name: t[:s, :n] for name, t in self.inputs.items()}
        buf["ids"][:rows] = ids
        buf["pos"][:rows] = pos
        buf["valid"][:rows] = True if valid is None else valid
        buf["valid"][rows:] = True  # padding rows (whatever tokens rows before left there) see their own block
        hidden = self._replay(s, n, store) if self.graphs else self._run(s, n, store)
        self.store.commit(stored, rows, keep)
        return hidden[:rows]

    def _run(self, s: int, n: int, store: bool | int) -> Tensor:
        pos, valid = self.inputs["pos"][:s, :n], self.inputs["valid"][:s, :n]
        return self.adapter.hidden(self.inputs["ids"][:s, :n], pos, AttentionLayout.block_causal(pos, self.b, valid),
                                   self.store.view(s), store_kv=store)

    def _replay(self, s: int, n: int, store: bool | int) -> Tensor:
        key = (s, n, store)
        if key not in self.captured:
            try:
                self.captured[key] = self._capture(s, n, store)
            except RuntimeError as exc:  # a forward that reads the device from the host cannot be captured
                warnings.warn(f"cuda_graphs: this model's forward cannot be captured as a CUDA graph "
                              f"({str(exc).splitlines()[0]}); sampling on without graphs", stacklevel=2)
                self.graphs = False
                return self._run(s, n, store)
        graph, out = self.captured[key]
        graph.replay()
        return out

    def _capture(self, s: int, n: int, store: bool | int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisations and allocator state before capture
            self._run(s, n, store)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(s, n, store)
        return graph, out

    def saved(self, rows: list[int], blocks: Tensor, max_cached: int) -> None:
        if self.store.end > max_cached + REPACK_SLACK * self.b:
            self.store.repack(max_cached)

    def keep(self, rows: Tensor) -> None:
        self.store.keep_rows(rows)
        self.rows = rows.shape[0]

    def admission_mark(self) -> Any:
        return self.rows

    def undo_admission(self, mark: Any) -> None:
        if self.store is not None:  # the rows placed after the mark are freed; the slots before it are untouched
            self.store.valid[mark:] = False
        self.rows = mark


class RecomputeRunner:
    """Reference path: recompute each row's whole sequence every step with the block-causal layout."""

    stores_blocks = False

    def __init__(self, adapter, block_size: int, stats: RolloutStats):
        self.adapter, self.b, self.stats = adapter, block_size, stats
        self.device = next(adapter.model.parameters()).device
        self.prefixes: list[Tensor] = []

    def admit(self, prefixes: list[list[int]]) -> None:
        self.prefixes.extend([on_device(p, self.device) for p in prefixes])

    def admission_mark(self) -> Any:
        return len(self.prefixes)

    def undo_admission(self, mark: Any) -> None:
        del self.prefixes[mark:]

    def step(self, tokens: Tensor, positions: Tensor, carry: Tensor | None, carrying: Tensor | None,
             fused: bool = True) -> Tensor:
        lengths = [p.numel() for p in self.prefixes]
        width = max(lengths) + self.b
        device = tokens.device
        seqs = [torch.cat([p, t]) for p, t in zip(self.prefixes, tokens)]
        ids = torch.stack([F.pad(s, (0, width - s.numel()), value=self.adapter.pad_id) for s in seqs])
        valid = torch.stack([torch.arange(width, device=device) < s.numel() for s in seqs])
        pos = torch.arange(width, device=device).expand_as(ids)
        hidden = self.adapter.hidden(ids, pos, AttentionLayout.block_causal(pos, self.b, valid))
        self.stats.forwards += 1
        idx = torch.tensor(lengths, device=device)[:, None] + torch.arange(self.b, device=device)
        return hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))

    def saved(self, rows: list[int], blocks: Tensor, max_cached: int) -> None:
        for row, block in zip(rows, blocks):
            self.prefixes[row] = torch.cat([self.prefixes[row], block])

    def keep(self, rows: Tensor) -> None:
        self.prefixes = [self.prefixes[i] for i in rows.tolist()]


def _chunks(prefixes: list[Tensor], budget: int) -> list[list[Tensor]]:
    """Split rows into prefill chunks of at most ``budget`` padded tokens (at least one row each)."""
    out: list[list[Tensor]] = [[]]
    for p in prefixes:
        width = max([q.numel() for q in out[-1]] + [p.numel()])
        if out[-1] and width * (len(out[-1]) + 1) > budget:
            out.append([])
        out[-1].append(p)
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
