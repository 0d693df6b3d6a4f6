"""Batched semi-autoregressive sampler for full-attention models (Dream, DiffuCoder, LLaDA, MMaDA).

Each row's canvas is its prompt followed by G masks (G = max_tokens rounded up to a multiple of block_size);
the batch is LEFT-padded, pads are invalid keys and position ids skip them, so a row's result does not depend on
its batch mates (the reference's Dream sampler ignores position ids: Gen-Verse/dLLM-RL sample/dream/modeling_dream.py).
Blocks of ``block_size`` are decoded left to right; ``steps``
is spread over the blocks (earlier blocks get the remainder) and, inside a block, the block's masks are spread
evenly over its steps with no zero-transfer iteration (the reference's Dream schedule wastes zero-transfer iterations:
Gen-Verse/dLLM-RL sample/dream_rl_rollout.py). The remasking strategies are
the block models' (sample/strategies.py); "low_confidence_dynamic" keeps the block-model rule (every candidate
with confidence > threshold when there are at least n_t of them, else the top n_t), not the reference's
">= threshold, else the single best". Every row keeps its own step counter starting at 1 (the reference shares
one across the batch); rows join and leave independently (continuous batching).

Shifted families (``adapter.shift_logits``): the token at column c is predicted by the hidden state at c-1. For
an empty prompt there is no earlier state, so the first response token is predicted by its own position (the
reference's "duplicate the first logit" convention); the trainer must do the same.

Cache modes: "none" runs the whole canvas every step (exact: the recorded log-probabilities are those of a plain
full forward of the canvas state). "prefix" (Fast-dLLM): at a block's first step one full forward doubles as a
cache refresh that keeps K/V of the columns before the window; later steps run only the window
[block_start - shift, min(block_end + further_horizon, canvas_end)). "dual" also keeps the suffix K/V from the
refresh (the window's columns marked invalid) and runs only [block_start - shift, block_end). Both are
approximations: their log-probabilities are those of the cached context.

A row is finished when its decoded region holds a stop token with no mask before it, or when its first
max_tokens positions are decoded. The response is cut after the stop token (or at max_tokens); all canvas
positions after the cut go to ``tail_ids`` / ``tail_steps``: decoded tokens with their step, and positions
never decoded as the mask id with step = (the row's last step + 1), so that the trainer can rebuild every
context exactly (they were masked whenever a response token was decoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from models.common import AttentionLayout, predicting_columns
from sample.engine import Finished, PromptTooLongError, RolloutStats, Sequence, append_rows, keep_rows, on_device
from sample.kv_batch import BatchKVCache
from sample.params import SamplingParams
from sample.strategies import (
    block_schedule,
    degenerate_logits_error,
    draw_tokens,
    schedule_table,
    select_transfer,
    split_steps,
)

_STATE = ("canvas", "valid", "pos", "decoded", "rec_step", "rec_logp", "rec_conf", "counter", "plen")


@dataclass
class _Running:
    """Host-side state of one running sequence (its canvas is a row of the sampler's tensors). The block and step
    counters live here only; each step sends them to the device once (``FullSampler.blk`` / ``t_block``)."""

    seq: Sequence
    blk: int = 0  # current block index
    t_block: int = 0  # steps done in the current block (0 = needs a cache refresh)
    masks_left: int = 0  # masks left in the current block
    response: list[int] = field(default_factory=list)  # the blocks before ``blk``: complete, final, no stop in them
    logprobs: list[float] = field(default_factory=list)  # their tokens' log-probs
    steps: list[int] = field(default_factory=list)  # and the steps that decoded them


class FullSampler:
    """Samples many prompts with a full-attention adapter; see the module docstring. This class recomputes the
    whole canvas every step (cache="none": exact log-probabilities); ``WindowCachedFullSampler`` overrides the cache
    hooks (``_reset_cache``, ``_admit_cache``, ``_keep_cache``, ``_hidden``) for cache="prefix" / "dual"."""

    def __init__(self, adapter, params: SamplingParams, stop_ids: set[int], limit: int | None,
                 generator: torch.Generator):
        self.adapter, self.params, self.generator = adapter, params, generator
        self.bl = params.block_for("full", None)
        self.gen_len = self.canvas(params)
        self.n_blocks = self.gen_len // self.bl
        per_block = split_steps(params.steps or self.gen_len, self.n_blocks)
        self.device = next(adapter.model.parameters()).device
        self.schedule = schedule_table([block_schedule(self.bl, s) for s in per_block], self.bl, self.device)
        self.shift = 1 if adapter.shift_logits else 0
        self.stop_ids, self.eos_ids = stop_ids, set(adapter.eos_ids)
        self.stop_tensor = on_device(sorted(stop_ids) or [-1], self.device)
        self.limit = limit
        self.stats = RolloutStats()
        self.num_layers = len(adapter.new_cache().keys)
        self.running: list[_Running] = []
        self.width = 0  # W: prompt columns (left-padded) before the generated region
        self._init_state()

    def _init_state(self) -> None:
        dev, g = self.device, self.gen_len
        long0 = dict(dtype=torch.long, device=dev)
        self.canvas = torch.empty(0, g, **long0)
        self.valid = torch.empty(0, g, dtype=torch.bool, device=dev)
        self.pos = torch.empty(0, g, **long0)
        self.decoded = torch.empty(0, g, dtype=torch.bool, device=dev)
        self.rec_step = torch.empty(0, g, **long0)
        self.rec_logp = torch.empty(0, g, dtype=torch.float32, device=dev)
        self.rec_conf = torch.empty(0, g, dtype=torch.float32, device=dev)
        for name in ("counter", "plen"):
            setattr(self, name, torch.empty(0, **long0))
        self.width = 0
        self._reset_cache()

    @staticmethod
    def canvas(params: SamplingParams) -> int:
        """The response canvas: max_tokens rounded up to whole blocks."""
        block = params.block_for("full", None)
        return -(-params.max_tokens // block) * block

    def check_prompt(self, index: int, prompt: list[int]) -> int:
        """The response budget; a clear error when prompt + canvas does not fit the model's positions."""
        if self.limit is not None and len(prompt) + self.gen_len > self.limit:
            raise PromptTooLongError(f"prompt {index} has {len(prompt)} tokens; with max_tokens "
                                     f"{self.params.max_tokens} rounded up to {self.gen_len} (block_size {self.bl}) "
                                     f"it needs {len(prompt) + self.gen_len} positions, but the model accepts "
                                     f"{self.limit} (max_position_embeddings)")
        return self.params.max_tokens

    def step(self) -> list[Finished]:
        """One denoising forward of every running sequence; the sequences that finished in it."""
        self._denoise_step()
        return self._after_step()

    # ------------------------------------------------------------ admission and removal

    def admit(self, sequences: list[Sequence]) -> None:
        self._widen(max(len(s.prompt) for s in sequences))
        dev, w, g = self.device, self.width, self.gen_len
        rows = [[self.adapter.pad_id] * (w - len(s.prompt)) + s.prompt + [self.adapter.mask_id] * g
                for s in sequences]
        canvas = on_device(rows, dev)
        plen = on_device([len(s.prompt) for s in sequences], dev)
        valid = torch.arange(w + g, device=dev)[None, :] >= (w - plen)[:, None]
        pos = (valid.long().cumsum(1) - 1).clamp(min=0).masked_fill(~valid, 0)
        n = len(sequences)
        zeros_g = torch.zeros(n, g, dtype=torch.long, device=dev)
        zeros_n = torch.zeros(n, dtype=torch.long, device=dev)
        add = {"canvas": canvas, "valid": valid, "pos": pos, "decoded": zeros_g.bool(), "rec_step": zeros_g,
               "rec_logp": zeros_g.float(), "rec_conf": zeros_g.float(),
               "counter": zeros_n, "plen": plen}
        cache = getattr(self, "cache", None)  # the window-cached samplers' batch cache, put back on failure
        self._admit_cache(n)  # first: a failure here leaves the cache as it was (a wider canvas is harmless)
        try:
            append_rows(self, add)
        except BaseException:
            if hasattr(self, "cache"):
                self.cache = cache
            raise
        self.running.extend(_Running(s, masks_left=self.bl) for s in sequences)

    def drop(self, rows: list[int]) -> None:
        """Remove running rows without a result (cancelled)."""
        self._drop(rows)

    def committed(self) -> dict[int, list[int]]:
        """Each running sequence's complete blocks (for streaming): a row decodes anywhere inside its block, but
        the blocks before it are done and final; they hold no stop token, or the row would have finished."""
        return {r.seq.index: r.response for r in self.running}

    def _widen(self, prompt_len: int) -> None:
        """Left-pad the canvas so that prompts of ``prompt_len`` tokens fit (cached K/V are column-free)."""
        extra = prompt_len - self.width
        if extra <= 0:
            return
        if self.canvas.shape[0]:
            self.canvas = F.pad(self.canvas, (extra, 0), value=self.adapter.pad_id)
            self.valid = F.pad(self.valid, (extra, 0), value=False)
            self.pos = F.pad(self.pos, (extra, 0), value=0)
        else:
            self.canvas = self.canvas.new_empty(0, prompt_len + self.gen_len)
            self.valid = self.valid.new_empty(0, prompt_len + self.gen_len)
            self.pos = self.pos.new_empty(0, prompt_len + self.gen_len)
        self.width = prompt_len

    def _drop(self, finished: list[int]) -> None:
        if len(set(finished)) == len(self.running):
            self.running = []
            self._init_state()
            return
        self._keep_cache(keep_rows(self, _STATE, finished))
        new_width = max(len(r.seq.prompt) for r in self.running)
        if new_width < self.width:
            cut = self.width - new_width
            self.canvas, self.valid, self.pos = self.canvas[:, cut:], self.valid[:, cut:], self.pos[:, cut:]
            self.width = new_width

    # ------------------------------------------------------------ one denoising step

    def _candidates(self) -> tuple[Tensor, Tensor]:
        """Masked positions of each row's current block, left to right: (gen-region index [R, K], valid)."""
        k = max(r.masks_left for r in self.running)
        cols = self.blk[:, None] * self.bl + torch.arange(self.bl, device=self.device)
        masked = ~self.decoded.gather(1, cols)
        order = torch.sort((~masked).to(torch.uint8), dim=1, stable=True).indices[:, :k]
        return cols.gather(1, order), masked.gather(1, order)

    def _predicting_columns(self, cand: Tensor) -> Tensor:
        """Canvas column whose hidden state predicts each candidate (c - 1 when shifted, never before the row)."""
        return predicting_columns(cand + self.width, self.adapter.shift_logits, (self.width - self.plen)[:, None])

    def _denoise_step(self) -> None:
        counters = on_device([[r.blk, r.t_block] for r in self.running], self.device)
        self.blk, self.t_block = counters.unbind(1)  # this step's, from the host counters
        cand, cand_valid = self._candidates()
        hidden = self._hidden(self._predicting_columns(cand))
        self.stats.denoise_forwards += 1
        draw = draw_tokens(self.adapter.logits(hidden), self.params, self.generator, self.adapter.mask_id,
                           self.adapter.pad_id, check=False)
        self.degenerate = torch.isnan(draw.confidence).sum(1)  # per row; raised at the step's sync (_status)
        n_t = self.schedule[self.blk, self.t_block.clamp(max=self.schedule.shape[1] - 1)]
        transfer = select_transfer(draw, cand_valid, n_t, self.params, self.generator)
        self.counter += 1
        self._write(cand, transfer, draw)

    def _write(self, cand: Tensor, transfer: Tensor, draw) -> None:
        """Commit the transferred candidates to the canvas and record step / logprob / confidence."""
        def put(grid: Tensor, values: Tensor) -> Tensor:
            return grid.scatter(1, cand, torch.where(transfer, values, grid.gather(1, cand)))

        gen = put(self.canvas[:, self.width:], draw.tokens)
        self.canvas = torch.cat([self.canvas[:, :self.width], gen], 1)
        self.decoded = put(self.decoded, torch.ones_like(transfer))
        self.rec_step = put(self.rec_step, self.counter[:, None].expand_as(cand))
        self.rec_logp = put(self.rec_logp, draw.logprob)
        self.rec_conf = put(self.rec_conf, draw.confidence)

    def _forward(self, ids: Tensor, pos: Tensor, valid: Tensor, cache: BatchKVCache | None = None,
                 store_kv: bool = False) -> Tensor:
        self.stats.forwards += 1
        return self.adapter.hidden(ids, pos, AttentionLayout.full(valid), cache, store_kv=store_kv)

    # ------------------------------------------------------------ after a step: blocks, stops, finished rows

    def _status(self) -> list[list[int]]:
        """Per row [masks left in block, finished, cut, stopped, token at the stop, degenerate positions] (the one
        host sync per step)."""
        g, budget = self.gen_len, self.params.max_tokens
        gen = self.canvas[:, self.width:]
        cols = self.blk[:, None] * self.bl + torch.arange(self.bl, device=self.device)
        masks_left = (~self.decoded.gather(1, cols)).sum(1)
        prefix_done = self.decoded.long().cumprod(1).bool()
        is_stop = prefix_done & torch.isin(gen, self.stop_tensor)
        has_stop = is_stop.any(1)
        first_stop = torch.where(has_stop, is_stop.int().argmax(1), g)
        stop_fin = first_stop < budget
        finished = stop_fin | prefix_done[:, budget - 1]
        cut = torch.where(stop_fin, first_stop + 1, budget)
        stop_tok = gen.gather(1, first_stop.clamp(max=g - 1)[:, None]).squeeze(1)
        return torch.stack([masks_left, finished.long(), cut, stop_fin.long(), stop_tok, self.degenerate], 1).tolist()

    def _after_step(self) -> list[Finished]:
        status = self._status()
        if degenerate := sum(row[-1] for row in status):
            raise degenerate_logits_error(degenerate)
        finished = []
        complete = []
        for i, (masks_left, fin, *_) in enumerate(status):
            row = self.running[i]
            row.t_block += 1
            row.masks_left = masks_left
            if fin:
                finished.append(i)
            elif masks_left == 0:
                complete.append(i)
        if complete:
            self._keep_complete_blocks(complete)
        done = self._trajectories(finished, [status[i] for i in finished]) if finished else []
        if finished:
            self._drop(finished)
        return done

    def _keep_complete_blocks(self, rows: list[int]) -> None:
        """Move ``rows`` to their next block, keeping the finished block's tokens, log-probs and steps on the host
        for ``committed`` (a copy once per block, not per step)."""
        idx = on_device(rows, self.device)
        cols = self.blk[idx, None] * self.bl + torch.arange(self.bl, device=self.device)
        tokens, logps, steps = torch.stack([self.canvas[idx, self.width:].gather(1, cols).double(),
                                            self.rec_logp[idx].gather(1, cols).double(),
                                            self.rec_step[idx].gather(1, cols).double()]).tolist()  # one read back
        for i, toks, lps, sts in zip(rows, tokens, logps, steps):
            row = self.running[i]
            row.response += [int(t) for t in toks]
            row.logprobs += lps
            row.steps += [int(t) for t in sts]
            row.blk, row.t_block, row.masks_left = row.blk + 1, 0, self.bl

    def _trajectories(self, finished: list[int], status: list[list[int]]) -> list[Finished]:
        idx = on_device(finished, self.device)
        gen = self.canvas[idx, self.width:]
        tokens = torch.where(self.decoded[idx], gen, self.adapter.mask_id)
        after_end = (self.counter[idx] + 1)[:, None].expand_as(gen)
        steps = torch.where(self.decoded[idx], self.rec_step[idx], after_end)
        host = [t.tolist() for t in (tokens, steps, self.rec_logp[idx], self.rec_conf[idx])]
        out = []
        for j, (i, (_, _, cut, stopped, stop_tok, _)) in enumerate(zip(finished, status)):
            toks, stps, logps, confs = (h[j] for h in host)
            reason = ("eos" if stop_tok in self.eos_ids else "stop") if stopped else "length"
            out.append(Finished(self.running[i].seq, toks[:cut], stps[:cut], logps[:cut], confs[:cut], reason,
                                self.bl, toks[cut:], stps[cut:], cached_logprobs=self.approximate_logprobs))
        return out

    # ------------------------------------------------------------ cache hooks (cache="none": none)

    approximate_logprobs = False  # the recorded log-probs are a plain forward's of each state

    def _reset_cache(self) -> None:
        pass

    def _admit_cache(self, n: int) -> None:
        pass

    def _keep_cache(self, rows: Tensor) -> None:
        pass

    def _hidden(self, cols: Tensor) -> Tensor:
        """Hidden states [R, K, H] at the predicting columns: the whole canvas, every step."""
        return _gather_rows(self._forward(self.canvas, self.pos, self.valid), cols)


class WindowCachedFullSampler(FullSampler):
    """cache="prefix" / "dual" (Fast-dLLM): a block's first step is a full forward that refreshes the cache, later
    steps run only the window against it (see the module docstring)."""

    cache: BatchKVCache | None = None
    # a window step reads K/V refreshed before the block's earlier steps decoded their tokens (and, with the prefix
    # cache, sees no column past the window): not a plain forward's log-probs, so the trainer recomputes them
    approximate_logprobs = True

    def _reset_cache(self) -> None:
        self.cache = None

    def _admit_cache(self, n: int) -> None:
        self.cache = BatchKVCache.join(self.cache, BatchKVCache.empty(n, self.num_layers, self.device))

    def _keep_cache(self, rows: Tensor) -> None:
        self.cache = self.cache.select_rows(rows)

    def _hidden(self, cols: Tensor) -> Tensor:
        """Hidden states [R, K, H] at the predicting columns: rows at their block's first step refresh, the
        others run their window."""
        refresh = [i for i, r in enumerate(self.running) if r.t_block == 0]
        if len(refresh) == len(self.running):
            return self._refresh(None, cols, None)
        if not refresh:
            return self._window(None, cols, None)
        going_on = [i for i in range(len(self.running)) if self.running[i].t_block]
        g1, g2 = on_device(refresh, self.device), on_device(going_on, self.device)
        h2 = self._window(g2, cols[g2], going_on)  # reads the old cache rows of g2 before g1's rows are replaced
        h1 = self._refresh(g1, cols[g1], refresh)
        out = h1.new_empty(len(self.running), *h1.shape[1:])
        out[g1], out[g2] = h1, h2
        return out

    def _window_bounds(self, rows: Tensor | None, host_rows: list[int] | None) -> tuple[Tensor, Tensor, int]:
        """Per-row window [start, end) in canvas columns and the common (padded) window width (``host_rows``:
        ``rows`` as the host knows them, so nothing is read back from the device)."""
        blk = self.blk if rows is None else self.blk[rows]
        start = (self.width + blk * self.bl - self.shift).clamp(min=0)
        block_end = self.width + (blk + 1) * self.bl
        horizon = self.params.further_horizon if self.params.cache == "prefix" else 0
        end = (block_end + horizon).clamp(max=self.canvas.shape[1])
        widths = [min(self.width + (self.running[i].blk + 1) * self.bl + horizon, self.canvas.shape[1])
                  - self._window_start(self.running[i].blk) for i in self._host_rows(rows, host_rows)]
        return start, end, max(widths)

    def _host_rows(self, rows: Tensor | None, host_rows: list[int] | None) -> list[int] | range:
        """The rows a step works on, as the host knows them (``rows`` None: every running row)."""
        return range(len(self.running)) if rows is None else host_rows

    def _window_start(self, blk: int) -> int:
        return max(self.width + blk * self.bl - self.shift, 0)

    def _refresh(self, rows: Tensor | None, cols: Tensor, host_rows: list[int] | None) -> Tensor:
        """Full forward of the rows' canvas (their block's first step); keep K/V outside the window."""
        sel = (lambda t: t) if rows is None else (lambda t: t[rows])
        cache = BatchKVCache(self.num_layers)
        hidden = self._forward(sel(self.canvas), sel(self.pos), sel(self.valid), cache, store_kv=True)
        start, end, _ = self._window_bounds(rows, host_rows)
        col = torch.arange(cache.length, device=self.device)[None, :]
        if self.params.cache == "prefix":
            cache.valid = cache.valid & (col < start[:, None])
            cache.truncate(max(self._window_start(self.running[i].blk) for i in self._host_rows(rows, host_rows)))
        else:
            cache.valid = cache.valid & ((col < start[:, None]) | (col >= end[:, None]))
        if rows is None:
            self.cache = cache.compact()
        else:
            self.cache = self.cache.replace_rows(rows, cache)
        return _gather_rows(hidden, cols)

    def _window(self, rows: Tensor | None, cols: Tensor, host_rows: list[int] | None) -> Tensor:
        """Forward of the rows' windows against their cached K/V (cache read only)."""
        start, end, width = self._window_bounds(rows, host_rows)
        idx = start[:, None] + torch.arange(width, device=self.device)
        inside = idx < end[:, None]
        idx = idx.clamp(max=self.canvas.shape[1] - 1)
        sel = (lambda t: t) if rows is None else (lambda t: t[rows])
        ids, pos = sel(self.canvas).gather(1, idx), sel(self.pos).gather(1, idx)
        valid = sel(self.valid).gather(1, idx) & inside
        cache = self.cache if rows is None else self.cache.select_rows(rows)
        hidden = self._forward(ids, pos, valid, cache)
        return _gather_rows(hidden, cols - start[:, None])


def _gather_rows(hidden: Tensor, cols: Tensor) -> Tensor:
    """hidden [R, N, H] at per-row columns [R, K] -> [R, K, H]."""
    return hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1]))
