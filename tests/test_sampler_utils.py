"""Shared helpers of the sampler tests (sharpened tiny models, independent replays) and the KV-cache row ops."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from models.common import AttentionLayout, predicting_columns
from models.tiny import build_tiny
from sample.kv_batch import BatchKVCache
from sample.strategies import block_schedule, split_steps
from sample.trajectory import Trajectory

# P < b, P mod b != 0, P mod b == 0. An empty prompt is left out of exact greedy comparisons: its first block is
# all masks, so every position has the same confidence up to float noise (a tie any batching may flip).
PROMPT_LENGTHS = (1, 2, 5, 6, 9, 13)


def sharp_tiny(model_base: str, tokenizer, seed: int = 0, gain: float = 12.0, **kw):
    """A tiny random model whose LM head is scaled so that confidences spread over (0, 1), not ~1/V."""
    adapter = build_tiny(model_base, tokenizer, seed=seed, **kw)
    vocab = len(tokenizer)
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            if p.dim() == 2 and p.shape[0] == vocab and "emb" not in name and "wte" not in name:
                p.mul_(gain / 3.0)
    return adapter


def prompts_of(lengths=PROMPT_LENGTHS, offset: int = 20) -> list[list[int]]:
    return [[offset + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]


def greedy_draw(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax tokens, confidence, entropy) of the greedy sampler, from raw logits [..., V]."""
    filtered = logits.float().clone()
    filtered[..., mask_id] = float("-inf")
    probs = filtered.softmax(-1)
    conf, tokens = probs.max(-1)
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    return tokens, conf, entropy


def expected_transfer(strategy: str, masked: list[int], conf: dict, ent: dict, n_t: int, threshold: float,
                      eb_threshold: float) -> set[int]:
    """The positions a strategy must commit, written independently of sample/strategies.py."""
    n = min(n_t, len(masked))
    by_conf = sorted(masked, key=lambda i: (-conf[i], i))
    if strategy == "sequential":
        return set(sorted(masked)[:n])
    if strategy == "low_confidence_static":
        return set(by_conf[:n])
    if strategy == "low_confidence_dynamic":
        above = {i for i in masked if conf[i] > threshold}
        return above if len(above) >= n else set(by_conf[:n])
    by_ent = sorted(masked, key=lambda i: (ent[i], i))
    total, out = 0.0, []
    for i in by_ent:  # the lowest entropies while their running total stays below the bound, at least one
        total += ent[i]
        if total >= eb_threshold:
            break
        out.append(i)
    return set(out or by_ent[:1])


NEAR_TIE = 1e-5  # batched and one-at-a-time forwards round differently: scores closer than this are ties


def consistent_transfer(committed: set[int], strategy: str, masked: list[int], conf: dict, ent: dict, n_t: int,
                        threshold: float, eb_threshold: float) -> bool:
    """Whether the sampler's committed set is what the strategy picks from scores within NEAR_TIE of the
    replay's: exact agreement, or agreement once committed positions are nudged up (and the others down) by
    NEAR_TIE, i.e. the two differ only on a near-tie that float rounding may flip."""
    if committed == expected_transfer(strategy, masked, conf, ent, n_t, threshold, eb_threshold):
        return True
    up = {i: conf[i] + (NEAR_TIE if i in committed else -NEAR_TIE) for i in conf}
    low = {i: ent[i] + (-NEAR_TIE if i in committed else NEAR_TIE) for i in ent}
    return committed == expected_transfer(strategy, masked, up, low, n_t, threshold, eb_threshold)


def _forward_logits(adapter, ids: list[int], layout_fn) -> torch.Tensor:
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        return adapter.forward(x, pos, layout_fn(pos))[0].float()


def replay_block(adapter, traj: Trajectory, b: int, steps: int, strategy: str = "low_confidence_static",
                 threshold: float = 0.9, eb_threshold: float = 0.35, check_rule: bool = True) -> int:
    """Re-derive every step of a block-model trajectory with independent plain forwards (no cache).

    Checks, per token: the recorded log-prob equals log_softmax of a block-causal forward of prompt + decoded
    tokens (positions of the same block not yet decoded are masked, later blocks absent); greedy tokens are the
    argmax; the committed set follows the strategy. Returns the number of forwards replayed.
    """
    mask = adapter.mask_id
    prompt, p_len = traj.prompt_ids, len(traj.prompt_ids)
    toks, stps = traj.response_ids + traj.tail_ids, traj.step_map + traj.tail_steps
    sched = block_schedule(b, steps)
    n_forwards = 0
    blocks = sorted({(p_len + i) // b for i in range(len(toks))})
    for k in blocks:
        cols = [i for i in range(len(toks)) if (p_len + i) // b == k]
        end = cols[-1] + 1
        assert (p_len + end) % b == 0, "a block model decodes whole blocks"
        first = min(stps[i] for i in cols)
        assert sorted({stps[i] for i in cols}) == list(range(first, max(stps[i] for i in cols) + 1))
        for s in range(first, max(stps[i] for i in cols) + 1):
            ids = prompt + [toks[i] if (i < cols[0] or stps[i] < s) else mask for i in range(end)]
            logits = _forward_logits(adapter, ids, lambda pos: AttentionLayout.block_causal(pos, b))
            n_forwards += 1
            logp = logits.log_softmax(-1)
            tokens, conf, ent = greedy_draw(logits, mask)
            committed = {i for i in cols if stps[i] == s}
            for i in committed:
                if i < len(traj.response_ids):
                    assert math.isclose(traj.logprobs[i], logp[p_len + i, toks[i]].item(), abs_tol=1e-4)
                assert toks[i] == tokens[p_len + i].item()
            if check_rule:
                masked = [i for i in cols if stps[i] >= s]
                cmap = {i: conf[p_len + i].item() for i in masked}
                emap = {i: ent[p_len + i].item() for i in masked}
                n_t = sched[min(s - first, len(sched) - 1)]
                assert consistent_transfer(committed, strategy, masked, cmap, emap, n_t, threshold, eb_threshold), (
                    k, s, committed, cmap)
    return n_forwards


def replay_full(adapter, traj: Trajectory, block_length: int, total_steps: int | None,
                strategy: str = "low_confidence_static") -> int:
    """Re-derive every step of a full-attention trajectory (cache none) with plain full forwards of the canvas."""
    mask = adapter.mask_id
    prompt, p_len = traj.prompt_ids, len(traj.prompt_ids)
    toks, stps = traj.response_ids + traj.tail_ids, traj.step_map + traj.tail_steps
    gen = len(toks)
    assert gen % block_length == 0
    n_blocks = gen // block_length
    per_block = split_steps(total_steps or gen, n_blocks)
    last = max(traj.step_map + [s for s, t in zip(traj.tail_steps, traj.tail_ids) if t != mask], default=0)
    n_forwards = 0
    for s in range(1, last + 1):
        ids = prompt + [t if st < s else mask for t, st in zip(toks, stps)]
        logits = _forward_logits(adapter, ids, lambda pos: AttentionLayout.full(torch.ones_like(pos, dtype=bool)))
        n_forwards += 1
        pred = [max(predicting_columns(torch.tensor(p_len + i), adapter.shift_logits).item(), 0) for i in range(gen)]
        logp = logits.log_softmax(-1)
        tokens, conf, _ = greedy_draw(logits, mask)
        committed = {i for i in range(gen) if stps[i] == s}
        assert committed, f"step {s} committed nothing"
        k = min(i for i in committed) // block_length
        assert all(i // block_length == k for i in committed), "a step stays inside one block"
        for i in committed:
            if i < len(traj.response_ids):
                assert math.isclose(traj.logprobs[i], logp[pred[i], toks[i]].item(), abs_tol=1e-4)
            assert toks[i] == tokens[pred[i]].item()
        cols = range(k * block_length, (k + 1) * block_length)
        first = min(stps[i] for i in cols)
        masked = [i for i in cols if stps[i] >= s]
        sched = block_schedule(block_length, per_block[k])
        n_t = sched[min(s - first, len(sched) - 1)]
        cmap = {i: conf[pred[i]].item() for i in masked}
        assert consistent_transfer(committed, strategy, masked, cmap, {}, n_t, 0.9, 0.35), (s, committed, cmap)
    return n_forwards


# ---------------------------------------------------------------- KV-cache row operations


def _cache(rows: int, cols: int, valid: torch.Tensor | None = None, layers: int = 2, seed: int = 0) -> BatchKVCache:
    g = torch.Generator().manual_seed(seed)
    c = BatchKVCache(layers)
    c.keys = [torch.randn(rows, 2, cols, 3, generator=g) for _ in range(layers)]
    c.values = [torch.randn(rows, 2, cols, 3, generator=g) for _ in range(layers)]
    c.valid = torch.ones(rows, cols, dtype=torch.bool) if valid is None else valid
    return c


def _visible(c: BatchKVCache, row: int) -> list[torch.Tensor]:
    """The (key, value) columns a row can see, in order: what attention depends on."""
    keep = c.valid[row]
    return [t[row][:, keep] for t in c.keys + c.values]


def _same_visible(a: BatchKVCache, ra: int, b: BatchKVCache, rb: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_visible(a, ra), _visible(b, rb)))


def test_kvcache_join_handles_rows_without_columns():
    a = _cache(2, 3)
    empty = BatchKVCache.empty(1, 2, torch.device("cpu"))
    joined = BatchKVCache.join(a, empty)
    assert joined.valid.shape == (3, 3) and not joined.valid[2].any()
    assert _same_visible(joined, 1, a, 1)
    both_empty = BatchKVCache.join(BatchKVCache.empty(2, 2, torch.device("cpu")), empty)
    assert both_empty.valid.shape == (3, 0) and both_empty.keys[0] is None
    assert BatchKVCache.join(None, a) is a


def test_repack_keeps_each_rows_visible_columns():
    main = _cache(3, 6, torch.tensor([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1]], dtype=torch.bool))
    packed = main.repack()
    assert packed.length == 6 and packed.valid.sum(1).tolist() == [3, 6, 3]
    sparse = _cache(2, 5, torch.tensor([[1, 0, 0, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.bool))
    narrow = sparse.repack(2)
    assert narrow.length == 2 and narrow.valid.tolist() == [[True, True], [True, False]]
    for r in range(2):
        assert _same_visible(narrow, r, sparse, r)
    for r in range(3):
        assert _same_visible(packed, r, main, r)


def test_replace_rows_swaps_in_new_rows_of_another_width():
    main = _cache(3, 2)
    sub = _cache(1, 5, seed=3)
    out = main.replace_rows(torch.tensor([1]), sub)
    assert _same_visible(out, 1, sub, 0) and _same_visible(out, 0, main, 0) and _same_visible(out, 2, main, 2)


@pytest.mark.parametrize("b,steps,want", [(4, 4, [1, 1, 1, 1]), (4, 3, [2, 1, 1]), (4, 8, [1, 1, 1, 1]),
                                          (32, 5, [7, 7, 6, 6, 6])])
def test_block_schedule(b, steps, want):
    assert block_schedule(b, steps) == want and sum(want) == b


def test_split_steps_gives_earlier_blocks_the_remainder():
    assert split_steps(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="smaller than the number of blocks"):
        split_steps(3, 4)


class DeviceWaits:
    """Counts, on CPU, what the sampler's own code (``sample/``) does that makes the host wait for a CUDA device:
    ``reads`` bring a value back (item, tolist, bool, nonzero, boolean indexing) and ``copies`` send one from
    pageable host memory (``torch.tensor(..., device=...)``, ``.to(device)``, ``x[rows] = scalar``), whereas
    ``sample.engine.on_device`` copies from pinned memory without waiting. On an H100, torch's sync debug mode
    found exactly such sites (``pytest -m gpu``); this proxy lets the CPU suite pin them. Use as a context manager;
    ``reads`` and ``copies`` map a call site to its count."""

    READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "_unique2", "unique_consecutive"}

    def __init__(self):
        self.reads: dict[str, int] = {}
        self.copies: dict[str, int] = {}

    def __enter__(self) -> DeviceWaits:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        waits = self

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name.split("::")[1]
                if name in DeviceWaits.READS or name == "index" and any(
                        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                    waits._count(waits.reads, name)
                elif name.startswith("index_put") and isinstance(args[2], torch.Tensor) and args[2].dim() == 0:
                    waits._count(waits.copies, "x[rows] = scalar")
                return func(*args, **(kwargs or {}))

        class Calls(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                kwargs = kwargs or {}
                if name in ("tolist", "item", "cpu", "numpy"):
                    waits._count(waits.reads, name)
                elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
                    waits._count(waits.copies, "torch.tensor(device=)")
                elif name == "to" and (kwargs.get("device") is not None or any(
                        isinstance(a, (str, torch.device)) for a in args[1:])):  # from pageable memory: blocking
                    waits._count(waits.copies, ".to(device)")
                return func(*args, **kwargs)

        self._modes = [Aten(), Calls()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @staticmethod
    def _count(into: dict[str, int], what: str) -> None:
        import traceback

        root, here = Path(__file__).resolve().parents[1], Path(__file__).resolve()
        frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith("<")]  # not <frozen ...>
        ours = [(Path(f.filename).resolve(), f) for f in frames]
        ours = [(path, f) for path, f in ours if path.is_relative_to(root) and path != here
                and not any(path.is_relative_to(lib) for lib in _library_dirs())]
        if not ours:
            return
        where, frame = ours[-1][0].relative_to(root).as_posix(), ours[-1][1]
        # the model's own CPU-only branches (models/) do not run on CUDA; on_device is pinned there
        if where.startswith("sample/") and frame.name != "on_device":
            key = f"{what} @ {where}:{frame.lineno}"
            into[key] = into.get(key, 0) + 1


@functools.cache
def _library_dirs() -> list[Path]:
    """Where installed code lives (the standard library, site-packages, torch), wherever the virtualenv is."""
    import sysconfig

    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")] + [Path(torch.__file__).parent]
