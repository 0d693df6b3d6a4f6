"""Batched block-diffusion sampler for block-attention models (TraDo / SDAR), with continuous batching.

Blocks sit at ABSOLUTE positions: block k covers positions [k*b, (k+1)*b). A prompt of P tokens is prefilled up
to floor(P/b)*b; its last P mod b tokens open the first active block (never masked, never changed, never part of
the response). Each step is ONE forward of the active block of every row ([R, b] tokens, per-row absolute
positions) against a batched KV cache with per-row validity. When a row's block has no masks left, its stops
and budget are checked at once: a finished row leaves (its last block is never stored) and a waiting prompt takes
its place; a row that goes on opens its next block, and the finished block is stored by the next forward. Fused:
that forward runs [finished block, next block] in the row, storing the finished block's K/V and denoising the next
block, which sees the finished block exactly as a separate commit pass would have stored it (the reference engine
spends one extra forward per block on that commit: 5 forwards per block at 4 steps instead of 4). Fusing widens
every row of that forward to 2 blocks, which only pays while the forward is overhead-bound or most rows carry a
block; otherwise the finished block rides alone in its row (stored; that row skips denoising for one step), as in
the reference engine (``FUSE_MAX_TOKENS``, ``FUSE_CARRYING_SHARE``).

``cache="none"`` is the slow reference path: every step recomputes each row's whole sequence with the
block-causal layout (the baseline of the cache-equality test and of the benchmark). The forwards themselves are the
runners' (``sample/block_runners.py``); ``cuda_graphs`` picks the one with a fixed-capacity cache (CUDA graphs).

Token editing (``editing_threshold``, LLaDA2.1): each forward also draws at the block's decoded response positions
(never the prompt tail), and a position whose drawn token differs from the one it holds with confidence above the
threshold is rewritten, in the same step as that step's unmasking. Once the block has no mask, it gets up to
``max_post_steps`` more forwards and is complete after the first that rewrites nothing (or the last allowed), as
the authors' generate does. Each token's record (step, log-prob, confidence) is that of its last write;
``rewrites`` counts the writes it replaced.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.moe import expert_layers_sync_free
from sample.block_runners import CachedRunner, RecomputeRunner, StaticRunner
from sample.engine import (
    Finished,
    PromptTooLongError,
    RolloutStats,
    Sequence,
    append_rows,
    first_rows,
    keep_rows,
    on_device,
)
from sample.params import SamplingParams
from sample.strategies import (
    Draw,
    GridPositions,
    block_schedule,
    degenerate_logits_error,
    degenerate_positions,
    draw_tokens,
    schedule_table,
    select_transfer,
)

# Widest fused forward (rows x 2 blocks) worth padding rows that carry nothing. Measured (``python -m bench.gpu
# --sections fuse``): on an H100, SDAR-1.7B shape in bf16, always fusing against storing alone was 1.34x at 256
# tokens, 1.17x at 1,024 and 0.83x at 4,096, so CUDA fuses up to 2,048; a CPU forward is compute-bound past a few
# dozen tokens (bench/sampler.py: at batch 32 on 2 cores, always fusing is 0.74x).
FUSE_MAX_TOKENS = {"cuda": 2048, "cpu": 64}
# Fused (past FUSE_MAX_TOKENS) when at least this share of the rows carries a finished block; 1.0: only when every
# row does, the rule before. Rows out of phase (a request that joined a server's batch a step after the others)
# otherwise settle into taking turns: the carriers store their block alone while the others denoise, then the other
# way round, 5 forwards per block for the whole batch at 4 steps. Fusing when most rows carry pads the few that do
# not and puts them back in phase.
FUSE_CARRYING_SHARE = 0.5


# The batch's device-side state, one row per running sequence: name -> ("block": [R, b] | "row": [R], dtype).
# New rows start at zero except the opening block's tokens / masks / start (``_append_rows``).
_ROW_STATE: dict[str, tuple[str, torch.dtype]] = {
    "tokens": ("block", torch.long),  # the active block (mask ids where not decoded yet)
    "masked": ("block", torch.bool),
    "start": ("row", torch.long),  # absolute position of the active block
    "t_block": ("row", torch.long),  # steps taken on the active block (its schedule's index)
    "counter": ("row", torch.long),  # the row's denoising steps so far (the step map's clock)
    "rec_step": ("block", torch.long),  # per position of the block: step, log-prob, confidence of its last write
    "rec_logp": ("block", torch.float32),
    "rec_conf": ("block", torch.float32),
    "carry": ("block", torch.long),  # finished blocks whose K/V are not stored yet
    "carrying": ("row", torch.bool),
    # token editing: response positions of the block (not the prompt tail), writes replaced per position,
    # forwards since the block's last mask, and whether the last step rewrote anything
    "editable": ("block", torch.bool),
    "rec_rewrites": ("block", torch.long),
    "post": ("row", torch.long),
    "edited": ("row", torch.bool),
}


@dataclass
class _Running:
    """Host-side state of one running sequence (its device-side state is a row of the sampler's tensors)."""

    seq: Sequence
    tail_len: int  # prompt tokens at the start of the active block (first block only)
    cached: int  # cache columns this row uses (prefix + committed blocks)
    response: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    rewrites: list[int] = field(default_factory=list)


# ---------------------------------------------------------------- the sampler


class BlockSampler:
    """Samples many prompts with a block-attention adapter; see the module docstring."""

    def __init__(self, adapter, params: SamplingParams, stop_ids: set[int], limit: int | None,
                 generator: torch.Generator):
        self.adapter, self.params, self.generator = adapter, params, generator
        self.b = params.block_size or adapter.block_size
        if self.b is None:
            raise ValueError("block model without a block size: set SamplingParams.block_size")
        if params.cache == "dual":
            raise ValueError("cache='dual' is for full-attention models; block models use 'prefix' or 'none'")
        self.stop_ids, self.eos_ids = stop_ids, set(adapter.eos_ids)
        self.limit = limit
        self.device = next(adapter.model.parameters()).device
        self.stats = RolloutStats()
        graphs = params.cache != "none" and params.cuda_graphs is not False and self._capturable()
        if params.cache == "none":
            self.runner = RecomputeRunner(adapter, self.b, self.stats)
        elif params.cuda_graphs or graphs:
            self.runner = StaticRunner(adapter, self.b, self.stats, capacity_hint=params.max_tokens, graphs=graphs)
        else:
            self.runner = CachedRunner(adapter, self.b, self.stats)
        self.fuse_max_tokens = FUSE_MAX_TOKENS["cuda" if self.device.type == "cuda" else "cpu"]
        sched = block_schedule(self.b, params.denoising_steps)
        self.schedule = schedule_table([sched], fill=self.b, device=self.device)[0]
        self.running: list[_Running] = []
        self.n_carrying = 0  # rows whose finished block rides in front of the next step (known from the last sync)
        self.degenerate = torch.zeros((), dtype=torch.long, device=self.device)  # the last draw's, see _draw
        self._init_batch()

    def _capturable(self) -> bool:
        """Whether decode forwards can be captured as CUDA graphs: on CUDA, with expert layers (if any) that never
        read back to the host. A capture that fails half-way can leave torch's CUDA RNG in capture state, so the
        default does not try where a sync is known to come, nor on quantized weights (bitsandbytes' kernels) or
        ZeRO-3-partitioned ones (DeepSpeed's hooks run in every submodule's forward), neither captured on a GPU
        here; ``cuda_graphs=true`` tries those."""
        if self.device.type != "cuda":
            return False
        if self.params.compute_dtype is not None:  # autocast's weight casts inside a capture: not tried by default
            return bool(self.params.cuda_graphs)
        model = self.adapter.model
        if not expert_layers_sync_free(model):
            if self.params.cuda_graphs:
                warnings.warn("cuda_graphs: this model's expert layers read their counts back to the host here (the "
                              "grouped product needs bf16 on Hopper or newer); its decode forwards run without graphs",
                              stacklevel=3)
            return False
        return bool(self.params.cuda_graphs) or all(p.is_floating_point() and not hasattr(p, "ds_id")
                                                    for p in model.parameters())

    def _init_batch(self) -> None:
        for name in _ROW_STATE:
            setattr(self, name, self._zero_rows(name, 0))

    def _zero_rows(self, name: str, n: int) -> Tensor:
        """``n`` fresh rows of the per-row state ``name`` (see ``_ROW_STATE``)."""
        per_row, dtype = _ROW_STATE[name]
        return torch.zeros(n, *((self.b,) if per_row == "block" else ()), dtype=dtype, device=self.device)

    @staticmethod
    def longest_prompt(block: int, limit: int | None) -> int | None:
        """The longest prompt that leaves a block of room below ``limit`` positions (None: no limit)."""
        return None if limit is None else (limit // block) * block - 1

    def check_prompt(self, index: int, prompt: list[int]) -> int:
        """The response budget of a prompt; a clear error when it leaves no room below the position limit."""
        longest = self.longest_prompt(self.b, self.limit)
        if longest is None:
            return self.params.max_tokens
        if len(prompt) > longest:
            raise PromptTooLongError(f"prompt {index} has {len(prompt)} tokens; the model accepts {self.limit} "
                                     f"positions (max_position_embeddings), which leaves no room for a block of "
                                     f"{self.b}")
        return min(self.params.max_tokens, longest + 1 - len(prompt))

    def step(self) -> list[Finished]:
        """One forward of every running sequence; the sequences that finished in it."""
        self._step()
        return self._after_step()

    # ------------------------------------------------------------ admission

    def admit(self, sequences: list[Sequence]) -> None:
        prefixes, blocks, starts, tails, new = [], [], [], [], []
        for seq in sequences:
            prompt = seq.prompt
            cut = (len(prompt) // self.b) * self.b
            tail = prompt[cut:]
            prefixes.append(prompt[:cut])
            blocks.append(tail + [self.adapter.mask_id] * (self.b - len(tail)))
            starts.append(cut)
            tails.append(len(tail))
            new.append(_Running(seq, len(tail), cut))
        rows, mark = len(self.running), self.runner.admission_mark()
        try:
            self.runner.admit(prefixes)
            self._append_rows(blocks, starts, tails)
        except BaseException:  # out of memory in the prefill, say: the running rows go on as they were (put back
            first_rows(self, list(_ROW_STATE), rows)  # without copying: memory is what just ran out)
            self.runner.undo_admission(mark)
            raise
        self.running.extend(new)

    def _append_rows(self, blocks: list[list[int]], starts: list[int], tails: list[int]) -> None:
        dev, n = self.device, len(blocks)
        masked = torch.arange(self.b, device=dev)[None, :] >= on_device(tails, dev)[:, None]
        opening = {"tokens": on_device(blocks, dev), "masked": masked, "editable": masked,
                   "start": on_device(starts, dev)}
        append_rows(self, {name: opening[name] if name in opening else self._zero_rows(name, n) for name in _ROW_STATE})

    # ------------------------------------------------------------ one denoising step

    def _positions(self) -> Tensor:
        return self.start[:, None] + torch.arange(self.b, device=self.device)

    def _step(self) -> None:
        """One forward of every active block (every row has masks left): scheduled tokens committed, step /
        logprob / confidence recorded; finished blocks carried from the last step are stored by this forward."""
        carry = self.n_carrying > 0
        rows = len(self.running)
        fused = self.n_carrying >= FUSE_CARRYING_SHARE * rows or 2 * self.b * rows <= self.fuse_max_tokens
        hidden = self.runner.step(self.tokens, self._positions(), self.carry if carry else None,
                                  self.carrying if carry else None, fused)
        self.stats.denoise_forwards += 1
        denoised = torch.ones_like(self.carrying) if fused or not carry else ~self.carrying
        masked = self.masked & denoised[:, None]
        editing = self.params.editing_threshold is not None
        decoded = self.editable & ~self.masked & denoised[:, None] if editing else None
        draw = self._draw(hidden, masked | decoded if editing else masked)
        n_t = self.schedule[self.t_block.clamp(max=self.schedule.numel() - 1)]
        write = select_transfer(draw, masked, n_t, self.params, self.generator)
        if editing:
            rewrite = decoded & (draw.confidence > self.params.editing_threshold) & (draw.tokens != self.tokens)
            self.post += (denoised & ~self.masked.any(1)).long()  # a forward of a block with no mask left
            self.edited = rewrite.any(1)
            self.rec_rewrites += rewrite.long()
            write |= rewrite
        self.counter += denoised.long()
        self.t_block += denoised.long()
        self.tokens = torch.where(write, draw.tokens, self.tokens)
        self.masked &= ~write
        self.rec_step = torch.where(write, self.counter[:, None], self.rec_step)
        self.rec_logp = torch.where(write, draw.logprob, self.rec_logp)
        self.rec_conf = torch.where(write, draw.confidence, self.rec_conf)

    def _draw(self, hidden: Tensor, candidates: Tensor) -> Draw:
        """Tokens drawn at the candidate positions ([R, b] grid, zeros elsewhere). The LM head runs only there:
        decoded positions need no logits, and at a large vocabulary the head is a large share of a small model's
        step; the random stream is the whole grid's, so the tokens are those of a head over every position."""
        grid = GridPositions.of(candidates)
        draw = draw_tokens(self.adapter.logits(grid.take(hidden)), self.params, self.generator,
                           self.adapter.mask_id, self.adapter.pad_id, grid=grid, check=False)
        self.degenerate = degenerate_positions(draw.confidence)  # raised at the step's sync (_after_step)
        return draw

    # ------------------------------------------------------------ block completion

    def _after_step(self) -> list[Finished]:
        """The step's one host sync besides finding the masked positions: rows whose block is complete are cut,
        retired or moved to their next block (and degenerate logits raised)."""
        self.carrying.zero_()  # the blocks carried in this step are stored now
        self.n_carrying = 0
        complete = ~self.masked.any(1)
        if self.params.editing_threshold is not None and self.params.max_post_steps > 0:
            # after its last mask a block gets a forward that may edit; it ends at one that edits nothing
            complete &= (self.post >= 1) & (~self.edited | (self.post >= self.params.max_post_steps))
        *complete, degenerate = torch.cat([complete.long(), self.degenerate.view(1)]).tolist()
        if degenerate:
            raise degenerate_logits_error(degenerate)
        done_rows = [i for i, flag in enumerate(complete) if flag]
        return self._finish_blocks(done_rows) if done_rows else []

    def _finish_blocks(self, complete: list[int]) -> list[Finished]:
        """Cut the complete blocks at stops / budget, retire finished rows, open the next block of the others (their
        finished block is carried into the next step to be stored)."""
        idx = on_device(complete, self.device)
        packed = torch.cat([self.tokens[idx].double(), self.rec_step[idx].double(), self.rec_logp[idx].double(),
                            self.rec_conf[idx].double(), self.rec_rewrites[idx].double()], 1).tolist()
        b = self.b
        done, finished = [], []
        for row_idx, row in zip(complete, packed):
            tokens, steps = [int(x) for x in row[:b]], [int(x) for x in row[b:2 * b]]
            finished_seq = self._absorb_block(self.running[row_idx], tokens, steps, row[2 * b:3 * b],
                                              row[3 * b:4 * b], [int(x) for x in row[4 * b:]])
            if finished_seq is not None:
                done.append(finished_seq)
                finished.append(row_idx)
        gone = set(finished)
        going_on = [i for i in complete if i not in gone]
        if going_on:
            cont = on_device(going_on, self.device)
            for i in going_on:
                self.running[i].cached += b
            self.runner.saved(going_on, self.tokens[cont], max(r.cached for r in self.running))
            if self.runner.stores_blocks:
                self.carry[cont] = self.tokens[cont]
                self.carrying.index_fill_(0, cont, True)
                self.n_carrying = len(going_on)
        self._advance(idx, finished)
        return done

    def _absorb_block(self, row: _Running, tokens: list[int], steps: list[int], logps: list[float],
                      confs: list[float], rewrites: list[int]) -> Finished | None:
        """Append the block's response tokens to ``row``; its Finished record when the row is finished."""
        first = row.tail_len
        row.tail_len = 0
        reason = None
        end = self.b
        budget = row.seq.budget
        for pos in range(first, self.b):
            if len(row.response) >= budget:
                reason, end = "length", pos
                break
            tok = tokens[pos]
            row.response.append(tok)
            row.steps.append(steps[pos])
            row.logprobs.append(logps[pos])
            row.confidences.append(confs[pos])
            row.rewrites.append(rewrites[pos])
            if tok in self.stop_ids:
                reason, end = ("eos" if tok in self.eos_ids else "stop"), pos + 1
                break
        if reason is None and len(row.response) >= budget:
            reason = "length"
        if reason is None:
            return None
        return Finished(row.seq, row.response, row.steps, row.logprobs, row.confidences, reason, self.b,
                        tokens[end:], steps[end:], row.rewrites if any(row.rewrites) else [])

    def _advance(self, complete: Tensor, finished: list[int]) -> None:
        """Open the next block of the rows that go on; drop the finished rows from the batch."""
        self.start[complete] += self.b
        # index_fill_, not ``x[rows] = value``: on CUDA that assignment copies the value from the host and waits
        for name, value in (("tokens", self.adapter.mask_id), ("masked", True), ("t_block", 0), ("rec_step", 0),
                            ("editable", True), ("rec_rewrites", 0), ("post", 0), ("edited", False)):
            getattr(self, name).index_fill_(0, complete, value)
        if finished:
            self._drop_rows(finished)

    def drop(self, rows: list[int]) -> None:
        """Remove running rows without a result (cancelled); a carried block of theirs is never stored."""
        self._drop_rows(rows)
        self.n_carrying = int(self.carrying.sum()) if self.running else 0

    def committed(self) -> dict[int, list[int]]:
        """Each running sequence's response so far: whole blocks, cut at nothing (no stop in them), final."""
        return {r.seq.index: r.response for r in self.running}

    def _drop_rows(self, finished: list[int]) -> None:
        self.runner.keep(keep_rows(self, list(_ROW_STATE), finished))
