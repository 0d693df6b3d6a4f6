"""Training views: pure functions from sampled trajectories (+ advantages) to the tensors the trainer consumes.

A view reproduces the context each response token had when the sampler decoded it, so that the trainer's
log-prob of a token equals the sampler's recorded one for the same weights (the reference's trainer aligns blocks to
the response start instead of absolute positions, a defect we avoid: Gen-Verse/dLLM-RL train/rl_trado.py). All views
return a ``TrainBatch``: input ids, position ids and an ``AttentionLayout`` per
row, plus flat vectors over the trained tokens (row, hidden index, label, advantage, old log-prob, loss weight...).

Block models (block size b, prompt length P): blocks sit at ABSOLUTE positions, block k = [k*b, (k+1)*b); the first
generated block holds the prompt's last P mod b tokens (never masked). A row is
``[clean prompt + response prefix (copy 0) | noisy copies of blocks]``. A copy of block k for round r holds every
position of block k present in prompt-tail/response/tail with its original position id; a response/tail token is
masked iff its (shrunk) step >= sigma_{k,r}, the r-th distinct step of block k (response and tail steps counted);
trained = response tokens of block k with step == sigma_{k,r}. ``layout="per_round"`` gives one row per round
(copy index 1, exhausted blocks omitted); ``layout="packed"`` one row per sample with all rounds (copy index r).

Full-attention models: one row per distinct (shrunk) step value v of the response, input = prompt + response +
tail with every response/tail token of step >= v masked; trained = response tokens of step v. For shifted families
(Dream) the hidden index of token i is i - 1 (i itself for the first token of an empty prompt, as in the sampler).
Exact when sampled with cache "none" and shrink 1.

Filtering: a prompt longer than ``max_prompt_len`` drops its trajectory (reported in ``TrainBatch.dropped``);
advantages are looked up by ``sample_id``, so no other sample shifts (the reference indexes rewards by row after
dropping rows, Gen-Verse/dLLM-RL train/rl_trado.py). ``max_gen_length`` cuts
responses with their step maps; for block models the cut tokens of the last kept block stay as masked/visible
context (still exact), for full attention they are dropped (the view is then marked inexact).

Random masking / coupled: a per-sequence noise level t ~ U(lower_p, upper_p) (or the reference's per-position
draw, ``random_mask_mode="per_position"``) masks response tokens; tail tokens are always masked and never
trained; ``coupled`` adds the exact complement of each draw as another row. These views do not reproduce sampler
states, so their old log-probs must be recomputed (``TrainBatch.exact`` is False).

Loss weights are computed from the trajectory batch, independent of the layout, so packed == per-round exactly and
micro-batches of one optimiser step simply add up (gradient accumulation divides once):
* ``padded_length`` (the reference's block models, train/rl_trado.py forward_process): every trained token
  weighs 1 / (U * L1max), U = number of per-round rows ("units"; counted as per-round rows even when packed),
  L1max = longest response in the batch;
* ``row_mean`` (the reference's full-attention models, train/rl_dream.py and rl_llada.py): mean over the tokens of
  a unit, then mean over units;
* ``token_mean``: mean over all trained tokens.

``post_num``: responses are cut at their stop token, so the generated stop token is always trained (the reference drops
it, since its pad id is the EOS). ``post_num`` only limits the other pad-id tokens of a response: the first ``post_num``
of them (counted
left to right over the whole response, not per row) are trained, later ones stay in the input as context but are
not trained.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from models.common import AttentionLayout, predicting_columns
from sample.trajectory import Trajectory
from train.layouts import Segment, clean_segment, collate_rows, select_layout_rows
from train.settings import ViewConfig

PROMPT, RESPONSE, TAIL = 0, 1, 2


# ---------------------------------------------------------------- configuration


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"view config: {key}={value!r} is not one of {choices}")


@dataclass(frozen=True, kw_only=True)
class ModelTraits:
    """The adapter facts a view needs (kept separate so views stay pure and testable without a model)."""

    mask_id: int
    pad_id: int
    attention: str = "block"
    block_size: int | None = None
    shift_logits: bool = False

    def __post_init__(self) -> None:
        _check_choice("attention", self.attention, ("block", "full"))
        if self.attention == "block" and not self.block_size:
            raise ValueError("block-attention views need a block_size")
        if self.attention == "block" and self.shift_logits:
            raise ValueError("shifted logits are not supported for block-attention models")

    @classmethod
    def from_adapter(cls, adapter: Any) -> ModelTraits:
        return cls(mask_id=adapter.mask_id, pad_id=adapter.pad_id, attention=adapter.attention,
                   block_size=adapter.block_size if adapter.attention == "block" else None,
                   shift_logits=adapter.shift_logits)


# ---------------------------------------------------------------- the batch

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
        n = counts[rows]
        first = torch.repeat_interleave(starts[rows] - (torch.cumsum(n, 0) - n), n)
        keep = first + torch.arange(int(n.sum()))
        tokens = {name: getattr(self, name)[keep] for name in TOKEN_FIELDS}
        tokens["rows"] = torch.repeat_interleave(torch.arange(rows.numel()), n)
        tokens["extra"] = {k: v[keep] for k, v in self.extra.items()}
        return replace(self, input_ids=self.input_ids[rows, :width], position_ids=self.position_ids[rows, :width],
                       layout=select_layout_rows(self.layout, rows, width), row_sample=self.row_sample[rows],
                       **tokens)

    def with_weights(self, weights: Tensor) -> TrainBatch:
        return replace(self, weights=weights)


# ---------------------------------------------------------------- shrink (the reference's collapse_k_unique)


def group_ranks(group: Tensor, steps: Tensor, shrink: int = 1) -> tuple[Tensor, Tensor]:
    """Per element: 1-based rank of its collapsed step among the distinct collapsed steps of its group, and the
    collapsed step itself (``collapse_k_unique`` per group: distinct values cut into runs of ``shrink``, each value
    replaced by the largest of its run)."""
    if steps.numel() == 0:
        return torch.zeros_like(steps), steps.clone()
    base = int(steps.max()) + 1
    uniq, inverse = torch.unique(group * base + steps, sorted=True, return_inverse=True)
    ugroup, uvalue = uniq // base, uniq % base
    idx = torch.arange(uniq.numel())
    is_first = torch.ones_like(idx, dtype=torch.bool)
    is_first[1:] = ugroup[1:] != ugroup[:-1]
    start = torch.cummax(torch.where(is_first, idx, torch.zeros_like(idx)), 0).values
    is_last = torch.ones_like(is_first)
    is_last[:-1] = is_first[1:]
    end = torch.flip(torch.cummin(torch.flip(torch.where(is_last, idx, idx.numel()), [0]), 0).values, [0])
    run = (idx - start) // shrink
    top = torch.minimum(start + run * shrink + shrink - 1, end)
    return (run + 1)[inverse], uvalue[top][inverse]


def collapse_k_unique(steps: Sequence[int] | Tensor, k: int) -> list[int]:
    """As the reference's collapse_k_unique: ``[5,3,3,7]``, k=2 -> ``[5,5,5,7]``; k=1 is the identity."""
    steps = torch.as_tensor(steps, dtype=torch.long)
    return group_ranks(torch.zeros_like(steps), steps, k)[1].tolist()


# ---------------------------------------------------------------- sample preparation


@dataclass
class _Sample:
    """One trajectory after filtering/truncation, as tensors."""

    sample_id: str
    prompt: Tensor
    resp: Tensor
    steps: Tensor
    tail: Tensor
    tail_steps: Tensor
    logp: Tensor
    adv: Tensor
    trainable: Tensor  # [L] bool, after post_num
    truncated: bool
    block: int | None = None  # block size the sample was decoded with (block models)


def prepare_samples(trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                    cfg: ViewConfig, ids: ModelTraits) -> tuple[list[_Sample], list[tuple[str, str]]]:
    """Filter (over-long prompt, empty response), truncate and attach advantages BY sample_id (the reference indexes
    rewards by row after dropping rows, Gen-Verse/dLLM-RL train/rl_trado.py)."""
    seen: set[str] = set()
    samples, dropped = [], []
    for traj in trajectories:
        sid = traj.sample_id
        if sid in seen:
            raise ValueError(f"duplicate sample_id {sid!r} in the trajectory batch")
        seen.add(sid)
        if sid not in advantages:
            raise ValueError(f"no advantage for sample_id {sid!r}")
        reason = _drop_reason(traj, cfg, ids)
        if reason:
            dropped.append((sid, reason))
            continue
        samples.append(_prepare_one(traj, advantages[sid], cfg, ids))
    return samples, dropped


def _drop_reason(traj: Trajectory, cfg: ViewConfig, ids: ModelTraits) -> str:
    if cfg.max_prompt_len is not None and len(traj.prompt_ids) > cfg.max_prompt_len:
        return f"prompt has {len(traj.prompt_ids)} tokens > max_prompt_len {cfg.max_prompt_len}"
    if not traj.response_ids:
        return "empty response"
    if min(traj.step_map + traj.tail_steps) < 1:
        raise ValueError(f"trajectory {traj.sample_id!r}: step ids must be >= 1 (1-based)")
    return ""


def _prepare_one(traj: Trajectory, adv: float | Sequence[float], cfg: ViewConfig, ids: ModelTraits) -> _Sample:
    t = {name: torch.tensor(getattr(traj, name), dtype=torch.long)
         for name in ("prompt_ids", "response_ids", "step_map", "tail_ids", "tail_steps")}
    resp, steps, tail, tail_steps = t["response_ids"], t["step_map"], t["tail_ids"], t["tail_steps"]
    adv_t = _advantage_vector(traj, adv)
    logp = torch.tensor(traj.logprobs, dtype=torch.float32)
    n = len(resp) if cfg.max_gen_length is None else min(len(resp), cfg.max_gen_length)
    truncated = n < len(resp)
    if truncated:  # cut tokens stay context (tail) for block models; full attention drops them (view inexact)
        keep_cut = ids.attention == "block"
        tail = torch.cat([resp[n:], tail]) if keep_cut else tail[:0]
        tail_steps = torch.cat([steps[n:], tail_steps]) if keep_cut else tail_steps[:0]
        resp, steps, adv_t, logp = resp[:n], steps[:n], adv_t[:n], logp[:n]
    prompt = t["prompt_ids"]
    # Block models train on the blocks the sample was decoded with (the sampling block size may differ from the
    # model's own, e.g. when TraceRL adapts a block-4 model to block 8).
    block = traj.block_size or ids.block_size  # (full attention: the semi-AR block of SFT, else unused)
    if ids.attention == "block":  # the tail only matters inside the final response block
        end = ((len(prompt) + n - 1) // block + 1) * block
        keep = max(end - len(prompt) - n, 0)
        tail, tail_steps = tail[:keep], tail_steps[:keep]
    stop = traj.finish_reason in ("eos", "stop") and not truncated  # the sampler cut right after the stop token
    trainable = _trainable(resp, ids.pad_id, cfg.post_num, stop)
    return _Sample(traj.sample_id, prompt, resp, steps, tail, tail_steps, logp, adv_t, trainable, truncated, block)


def _advantage_vector(traj: Trajectory, adv: float | Sequence[float]) -> Tensor:
    """The sample's scalar advantage on every response token, or its per-token advantages (value model)."""
    n = len(traj.response_ids)
    vec = torch.as_tensor(adv, dtype=torch.float32)
    if vec.dim() == 0:
        return vec.expand(n).clone()
    vec = vec.flatten()
    if vec.numel() != n:
        raise ValueError(f"sample {traj.sample_id!r}: per-token advantages have {vec.numel()} values for {n} "
                         "response tokens")
    return vec


def _trainable(resp: Tensor, pad_id: int, post_num: int, ends_with_stop: bool) -> Tensor:
    """Response tokens that may be trained: all but pad-id tokens beyond the first ``post_num`` (stop excluded)."""
    is_pad = resp == pad_id
    if ends_with_stop:
        is_pad[-1] = False
    return ~is_pad | (torch.cumsum(is_pad.long(), 0) <= post_num)


# ---------------------------------------------------------------- units and rows


@dataclass
class _Row:
    """One row's segments and its trained tokens (cols in the row, response index, local unit, step)."""

    segments: list[Segment]
    sample: int
    cols: Tensor
    resp_index: Tensor
    unit: Tensor
    steps: Tensor
    level: Tensor  # masking probability t of each trained token (1 where the view does not noise at random)


@dataclass
class _Units:
    """Per unit (per-round row) of one sample: masked / trained flags over its tokens and the unit's copy set."""

    masked: Tensor  # [U, n] bool
    trained: Tensor  # [U, n] bool
    in_copy: Tensor  # [U, n] bool (block models: tokens of the blocks this unit copies)
    steps: Tensor  # [n] collapsed step of each token (0 for prompt tokens)
    level: Tensor  # [U, n] float: the probability t with which each token was masked (1 for TraceRL rounds)

    def nonempty(self) -> _Units:
        keep = self.trained.any(1)
        return _Units(self.masked[keep], self.trained[keep], self.in_copy[keep], self.steps, self.level[keep])


@dataclass
class _BlockGeometry:
    """Tokens of the generated blocks of one sample: prompt tail, response and tail, at absolute positions."""

    ids: Tensor
    pos: Tensor
    block: Tensor
    kind: Tensor
    steps: Tensor
    trainable: Tensor


def _block_geometry(s: _Sample, b: int) -> _BlockGeometry:
    p, n, t = len(s.prompt), len(s.resp), len(s.tail)
    start = (p // b) * b
    m = p - start
    pos = torch.arange(start, p + n + t)
    kind = torch.cat([torch.full((m,), PROMPT), torch.full((n,), RESPONSE), torch.full((t,), TAIL)])
    trainable = torch.cat([torch.zeros(m, dtype=torch.bool), s.trainable, torch.zeros(t, dtype=torch.bool)])
    return _BlockGeometry(torch.cat([s.prompt[start:], s.resp, s.tail]), pos, pos // b, kind,
                          torch.cat([torch.zeros(m, dtype=torch.long), s.steps, s.tail_steps]), trainable)


def _tracerl_block_units(g: _BlockGeometry, shrink: int) -> _Units:
    gen = g.kind != PROMPT
    rank, collapsed = torch.zeros_like(g.steps), torch.zeros_like(g.steps)
    rank[gen], collapsed[gen] = group_ranks(g.block[gen], g.steps[gen], shrink)
    candidate = (g.kind == RESPONSE) & g.trainable
    rounds = torch.unique(rank[candidate])
    masked = gen[None] & (rank[None] >= rounds[:, None])
    trained = candidate[None] & (rank[None] == rounds[:, None])
    in_copy = torch.stack([torch.isin(g.block, g.block[t]) for t in trained]) if len(rounds) else masked
    return _Units(masked, trained, in_copy, collapsed, torch.ones(masked.shape))


def _noise_masks(n: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """[D, n] masks of response tokens, D = mask_times_per_sample (doubled with complements for coupled), and the
    [D, n] probability each token was masked with."""
    d = cfg.mask_times_per_sample
    if cfg.random_mask_mode == "per_sequence":
        level = torch.empty(d, 1).uniform_(cfg.lower_p, cfg.upper_p, generator=gen)
    else:  # the reference's per-position draw (Gen-Verse/dLLM-RL train/rl_trado.py random_masking)
        level = torch.empty(d, n).uniform_(cfg.lower_p, cfg.upper_p, generator=gen)
    masks = torch.rand(d, n, generator=gen) < level
    level = level.expand(d, n)
    if cfg.method == "coupled":  # each draw followed by its complement
        masks = torch.stack([masks, ~masks], 1).flatten(0, 1)
        level = torch.stack([level, 1 - level], 1).flatten(0, 1)
    return masks, level


def _random_block_units(g: _BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> _Units:
    is_resp = g.kind == RESPONSE
    resp_masks, resp_level = _noise_masks(int(is_resp.sum()), cfg, gen)
    masked = (g.kind == TAIL)[None].repeat(len(resp_masks), 1)
    masked[:, is_resp] = resp_masks
    level = torch.ones(masked.shape)
    level[:, is_resp] = resp_level
    trained = masked & (is_resp & g.trainable)[None]
    in_copy = torch.isin(g.block, g.block[is_resp])[None].expand_as(masked)
    return _Units(masked, trained, in_copy, g.steps, level)


def _block_rows(s: _Sample, si: int, cfg: ViewConfig, ids: ModelTraits, gen: torch.Generator) -> list[_Row]:
    b = s.block
    g = _block_geometry(s, b)
    units = (_tracerl_block_units(g, cfg.shrink) if cfg.method == "tracerl"
             else _random_block_units(g, cfg, gen)).nonempty()
    clean_ids = torch.cat([s.prompt, s.resp])
    n_units = len(units.masked)
    if n_units == 0:
        return []
    # clean context a unit needs: every block before the last block it copies (positions are absolute)
    clean_len = [int(g.block[units.in_copy[u]].max()) * b for u in range(n_units)]
    budget = 1 if cfg.layout == "per_round" else cfg.max_row_tokens  # per-round: one unit per row, copy index 1
    rows = []
    for group in _pack_units(clean_len, units.in_copy.sum(1).tolist(), budget):
        copies = [_copy_segment(g, units, u, ids.mask_id, j + 1) for j, u in enumerate(group)]  # copy index j + 1
        rows.append(_assemble(s, si, clean_ids[:max(clean_len[u] for u in group)], b, copies, group, units))
    return rows


def _pack_units(clean_len: list[int], copy_len: list[int], budget: int | None) -> list[list[int]]:
    """Units grouped into packed rows, in order: a row takes units while its clean context plus its copies fit
    ``budget`` tokens (at least one unit per row; no budget: one row)."""
    groups: list[list[int]] = []
    clean = copies = 0  # the current row's clean context and copy tokens
    for u, (need, size) in enumerate(zip(clean_len, copy_len)):
        if not groups or (budget is not None and max(clean, need) + copies + size > budget):
            groups.append([])
            clean = copies = 0
        groups[-1].append(u)
        clean, copies = max(clean, need), copies + size
    return groups


def _copy_segment(g: _BlockGeometry, units: _Units, u: int, mask_id: int, copy: int) -> tuple[Segment, Tensor]:
    """A noisy copy of the unit's blocks and the indices of the copied tokens."""
    idx = units.in_copy[u].nonzero().squeeze(1)
    ids = torch.where(units.masked[u, idx], mask_id, g.ids[idx])
    return Segment(ids, g.pos[idx], g.block[idx], copy), idx


def _assemble(s: _Sample, si: int, clean_ids: Tensor, b: int, copies: list[tuple[Segment, Tensor]],
              unit_ids: list[int], units: _Units) -> _Row:
    segments, cols, resp_index, unit, steps, level = [clean_segment(clean_ids, b)], [], [], [], [], []
    offset = len(clean_ids)
    response_start = (len(s.prompt) // b) * b - len(s.prompt)  # g index -> response index shift
    for (seg, idx), u in zip(copies, unit_ids):
        hit = units.trained[u, idx].nonzero().squeeze(1)
        cols.append(offset + hit)
        resp_index.append(idx[hit] + response_start)
        unit.append(torch.full_like(hit, u))
        steps.append(units.steps[idx[hit]])
        level.append(units.level[u, idx[hit]])
        segments.append(seg)
        offset += len(seg.ids)
    return _Row(segments, si, torch.cat(cols), torch.cat(resp_index), torch.cat(unit), torch.cat(steps),
                torch.cat(level))


def _semi_ar_units(s: _Sample, cfg: ViewConfig, gen: torch.Generator) -> _Units:
    """Full-attention semi-AR SFT: one unit per response block k: later blocks (and the tail) fully masked, block k
    noised (a draw of _noise_masks), earlier blocks clean; trained = the noised tokens of block k."""
    if not s.block:
        raise ValueError("semi-AR views of full-attention models need a block size (training.block_size)")
    n, t = len(s.resp), len(s.tail)
    blk = torch.arange(n) // s.block
    n_blocks = int(blk.max()) + 1 if n else 0
    draws = [_noise_masks(n, cfg, gen) for _ in range(n_blocks)]
    noise = torch.cat([m[:1] for m, _ in draws]) if draws else torch.zeros(0, n, dtype=torch.bool)
    noise_level = torch.cat([lv[:1] for _, lv in draws]) if draws else torch.ones(0, n)
    k = torch.arange(n_blocks)[:, None]
    resp_masked = (blk[None] > k) | ((blk[None] == k) & noise)
    trained = (blk[None] == k) & noise & s.trainable[None]
    masked = torch.cat([resp_masked, torch.ones(n_blocks, t, dtype=torch.bool)], 1)
    trained = torch.cat([trained, torch.zeros(n_blocks, t, dtype=torch.bool)], 1)
    level = torch.cat([noise_level, torch.ones(n_blocks, t)], 1)
    return _Units(masked, trained, torch.ones_like(masked), torch.cat([s.steps, s.tail_steps]), level)


def _full_units(s: _Sample, cfg: ViewConfig, gen: torch.Generator) -> _Units:
    n, t = len(s.resp), len(s.tail)
    all_steps = torch.cat([s.steps, s.tail_steps])
    if cfg.method == "semi_ar":
        return _semi_ar_units(s, cfg, gen)
    if cfg.method == "tracerl":
        rank, collapsed = group_ranks(torch.zeros_like(all_steps), all_steps, cfg.shrink)
        rounds = torch.unique(rank[:n][s.trainable])
        masked = rank[None] >= rounds[:, None]
        trained = (rank[:n][None] == rounds[:, None]) & s.trainable[None]
        level = torch.ones(masked.shape)
    else:
        resp_masks, resp_level = _noise_masks(n, cfg, gen)
        masked = torch.cat([resp_masks, torch.ones(len(resp_masks), t, dtype=torch.bool)], 1)
        level = torch.cat([resp_level, torch.ones(len(resp_masks), t)], 1)
        trained = resp_masks & s.trainable[None]
        collapsed = all_steps
    trained = torch.cat([trained, torch.zeros(len(trained), t, dtype=torch.bool)], 1)
    return _Units(masked, trained, torch.ones_like(masked), collapsed, level)


def _ar_rows(s: _Sample, si: int, ids: ModelTraits) -> list[_Row]:
    """AR SFT of a model adapted from an AR model (shifted logits): the clean sequence under causal attention,
    every trainable response token predicted from the hidden state before it."""
    if not ids.shift_logits:
        raise ValueError("the ar view needs a model with shifted logits (Dream / DiffuCoder): an unshifted model "
                         "would see the token it predicts")
    seq = torch.cat([s.prompt, s.resp])
    hit = s.trainable.nonzero().squeeze(1)
    return [_Row([clean_segment(seq, 1)], si, len(s.prompt) + hit, hit, torch.zeros_like(hit), s.steps[hit],
                 torch.ones(len(hit)))]


def _full_rows(s: _Sample, si: int, cfg: ViewConfig, ids: ModelTraits, gen: torch.Generator) -> list[_Row]:
    if cfg.method == "ar":
        return _ar_rows(s, si, ids)
    units = _full_units(s, cfg, gen).nonempty()
    p = len(s.prompt)
    gen_ids = torch.cat([s.resp, s.tail])
    rows = []
    for u in range(len(units.masked)):
        seq = torch.cat([s.prompt, torch.where(units.masked[u], ids.mask_id, gen_ids)])
        hit = units.trained[u].nonzero().squeeze(1)
        rows.append(_Row([clean_segment(seq, None)], si, p + hit, hit, torch.full_like(hit, u), units.steps[hit],
                         units.level[u, hit]))
    return rows


# ---------------------------------------------------------------- public entry


def build_view(trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
               cfg: ViewConfig, ids: ModelTraits) -> TrainBatch:
    """The training batch of ``trajectories`` under ``cfg`` (TraceRL / random masking / coupled)."""
    samples, dropped = prepare_samples(trajectories, advantages, cfg, ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    make_rows = _block_rows if ids.attention == "block" else _full_rows
    rows: list[_Row] = []
    for si, s in enumerate(samples):
        rows.extend(make_rows(s, si, cfg, ids, gen))
    exact = cfg.method == "tracerl" and cfg.shrink == 1 and not (
        ids.attention == "full" and any(s.truncated for s in samples))
    return _finish(rows, samples, dropped, cfg, ids, exact)


def _finish(rows: list[_Row], samples: list[_Sample], dropped: list[tuple[str, str]], cfg: ViewConfig,
            ids: ModelTraits, exact: bool) -> TrainBatch:
    tensors = collate_rows([r.segments for r in rows], ids.pad_id)
    n_tok = [len(r.cols) for r in rows]
    sample_index = torch.cat([torch.full((k,), r.sample) for r, k in zip(rows, n_tok)]) if rows else _empty()
    resp_index = torch.cat([r.resp_index for r in rows]) if rows else _empty()
    unit = _global_units(rows, samples)
    token_cols = torch.cat([r.cols for r in rows]) if rows else _empty()
    # the 1/t weighting of the masked-diffusion ELBO: each noised token counts 1 / (its masking probability)
    level = torch.cat([r.level for r in rows]) if rows and cfg.elbo_weight else torch.ones(len(token_cols))
    gather = _per_sample_gather(samples, sample_index, resp_index)
    return TrainBatch(
        input_ids=tensors.input_ids, position_ids=tensors.position_ids, layout=tensors.layout,
        row_sample=torch.tensor([r.sample for r in rows], dtype=torch.long),
        rows=torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(n_tok, dtype=torch.long)),
        cols=predicting_columns(token_cols, ids.shift_logits, first=0), token_cols=token_cols,
        labels=gather("resp"), advantages=gather("adv"), old_logprobs=gather("logp") if exact else
        torch.full((len(token_cols),), math.nan), weights=_weights(unit, samples, cfg.loss_norm) / level,
        sample_index=sample_index, token_index=resp_index,
        steps=torch.cat([r.steps for r in rows]) if rows else _empty(), unit=unit,
        sample_ids=[s.sample_id for s in samples], num_units=int(unit.max()) + 1 if len(unit) else 0,
        exact=exact, dropped=dropped)


def _empty() -> Tensor:
    return torch.zeros(0, dtype=torch.long)


def _global_units(rows: list[_Row], samples: list[_Sample]) -> Tensor:
    """Number units globally: sample by sample, local unit order (identical for packed and per-round)."""
    if not rows:
        return _empty()
    per_sample = torch.zeros(len(samples), dtype=torch.long)
    for r in rows:
        if len(r.unit):
            per_sample[r.sample] = max(int(per_sample[r.sample]), int(r.unit.max()) + 1)
    offsets = torch.cumsum(per_sample, 0) - per_sample
    return torch.cat([r.unit + offsets[r.sample] for r in rows])


def _per_sample_gather(samples: list[_Sample], sample_index: Tensor, resp_index: Tensor):
    """Gather a per-response-token attribute of each trained token from its own sample."""

    def gather(name: str) -> Tensor:
        if not samples:
            return torch.zeros(0, dtype=torch.long if name == "resp" else torch.float32)
        flat = torch.cat([getattr(s, name) for s in samples])
        offsets = torch.tensor([0] + [len(s.resp) for s in samples[:-1]]).cumsum(0)
        return flat[offsets[sample_index] + resp_index]

    return gather


def _weights(unit: Tensor, samples: list[_Sample], loss_norm: str) -> Tensor:
    """Per-token loss weights from the batch's units and responses only (layout independent)."""
    if unit.numel() == 0:
        return torch.zeros(0)
    n_units = int(unit.max()) + 1
    if loss_norm == "padded_length":
        l1max = max(len(s.resp) for s in samples)
        return torch.full((unit.numel(),), 1.0 / (n_units * l1max))
    if loss_norm == "row_mean":
        per_unit = torch.bincount(unit, minlength=n_units).float()
        return 1.0 / (n_units * per_unit[unit])
    return torch.full((unit.numel(),), 1.0 / unit.numel())
