"""Training views: the shared layout machinery from sampled trajectories (+ advantages) to a ``TrainBatch``.

What rows a trajectory gives is the algorithm's (train/algorithms/: ``training.method`` picks TraceRL, random masking,
coupled, semi-AR or AR); this module turns an algorithm's units into rows, numbers them over the batch and normalises
the loss weights. A ``TrainBatch`` holds input ids, position ids and an ``AttentionLayout`` per row, plus flat vectors
over the trained tokens (row, hidden index, label, advantage, old log-prob, loss weight...). Exact views reproduce the
context each response token had when the sampler decoded it, so that the trainer's log-prob of a token equals the
sampler's recorded one for the same weights (the reference's trainer aligns blocks to the response start instead of
absolute positions, a defect we avoid: Gen-Verse/dLLM-RL train/rl_trado.py).

Block models (block size b): blocks sit at ABSOLUTE positions, block k = [k*b, (k+1)*b); the first generated block
holds the prompt's last P mod b tokens (never masked). A row is ``[clean prompt + response prefix (copy 0) | noisy
copies of blocks]``; a unit's copy holds every position of the blocks it copies with its original position id.
``layout="per_round"`` gives one row per unit (copy index 1); ``layout="packed"`` packs a sample's units into rows
(copy index r), ``max_row_tokens`` bounding a row. Full-attention models: one row per unit, input = prompt +
response + tail; for shifted families (Dream) the hidden index of token i is i - 1 (i itself for the first token of
an empty prompt, as in the sampler). Filtering, truncation and ``post_num``: train/samples.py.

Loss weights are computed from the trajectory batch, independent of the layout, so packed == per-round exactly and
micro-batches of one optimiser step simply add up (gradient accumulation divides once); with several processes,
each process's shard is rescaled to the whole step's counts (``normalised_over_processes``), so a token weighs the
same wherever it lands:
* ``padded_length`` (the reference's block models, train/rl_trado.py forward_process): every trained token
  weighs 1 / (U * L1max), U = number of per-round rows ("units"; counted as per-round rows even when packed),
  L1max = longest response in the batch;
* ``row_mean`` (the reference's full-attention models, train/rl_dream.py and rl_llada.py): mean over the tokens of
  a unit, then mean over units;
* ``token_mean``: mean over all trained tokens;
* ``unit_sum``: a unit's tokens summed, units averaged (wd1's sequence log-likelihood);
* ``step_mean``: mean over the tokens a sample decoded at one step, then mean over (sample, step) pairs
  (CJ-GRPO). On full attention a TraceRL unit is one step, so it equals ``row_mean``; on block models a unit is
  the r-th round of every block, several steps at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from models.common import predicting_columns
from sample.trajectory import Trajectory
from train.algorithms import algorithm as algorithm_named
from train.algorithms.base import PROMPT, Algorithm, BlockGeometry, Row, Units, block_geometry
from train.batch import TrainBatch
from train.layouts import Segment, clean_segment, collate_rows
from train.samples import Sample, prepare_samples
from train.settings import ViewConfig
from train.traits import ModelTraits

__all__ = ["ModelTraits", "TrainBatch", "ViewConfig", "build_view"]


# ---------------------------------------------------------------- block models: units -> packed / per-round rows


def _block_rows(sample: Sample, sample_index: int, algorithm: Algorithm, cfg: ViewConfig, traits: ModelTraits,
                gen: torch.Generator) -> list[Row]:
    block_size = sample.block
    geometry = block_geometry(sample, block_size)
    units = _noised_prompts(algorithm.block_units(geometry, cfg, gen).nonempty(), sample, cfg, algorithm, gen)
    clean_ids = torch.cat([sample.prompt, sample.resp])
    n_units = len(units.masked)
    if n_units == 0:
        return []
    # clean context a unit needs: every block before the last block it copies (positions are absolute)
    clean_len = [int(geometry.block[units.in_copy[unit]].max()) * block_size for unit in range(n_units)]
    budget = 1 if cfg.layout == "per_round" else cfg.max_row_tokens  # per-round: one unit per row, copy index 1
    if units.prompt_masked is not None:  # a masked prompt is the unit's own: its clean context is not shared
        budget = 1
        units.masked[:, geometry.kind == PROMPT] |= units.prompt_masked[:, len(sample.prompt) - _prompt_tail(geometry):]
    # the complete prompt blocks: their keys and values depend on the prompt alone (a masked prompt is the row's own)
    shared_cols = 0 if units.prompt_masked is not None else len(sample.prompt) // block_size * block_size
    rows = []
    for group in _pack_units(clean_len, units.in_copy.sum(1).tolist(), budget):
        copies = [_copy_segment(geometry, units, unit, traits.mask_id, copy + 1) for copy, unit in enumerate(group)]
        clean = clean_ids[:max(clean_len[unit] for unit in group)]
        if units.prompt_masked is not None:
            clean = _masked_prompt(clean, units.prompt_masked[group[0]], traits.mask_id)
        rows.append(_assemble(sample, sample_index, clean, block_size, copies, group, units, shared_cols))
    return rows


def prompt_mask_p(cfg: ViewConfig, algorithm: Algorithm) -> float:
    """The probability of masking each prompt token of a row: the config's, else the algorithm's own."""
    return algorithm.prompt_mask_p if cfg.prompt_mask_p is None else cfg.prompt_mask_p


def _noised_prompts(units: Units, sample: Sample, cfg: ViewConfig, algorithm: Algorithm,
                    gen: torch.Generator) -> Units:
    """Units with their own prompt masks (d1's prompt noise) when the prompt mask probability is above 0."""
    p = prompt_mask_p(cfg, algorithm)
    if p and len(units.masked):
        units.prompt_masked = torch.rand(len(units.masked), len(sample.prompt), generator=gen) < p
    return units


def _prompt_tail(geometry: BlockGeometry) -> int:
    return int((geometry.kind == PROMPT).sum())


def _masked_prompt(sequence: Tensor, prompt_masked: Tensor, mask_id: int) -> Tensor:
    """``sequence`` with its prompt tokens (its first ones) masked where ``prompt_masked`` says."""
    n = min(len(sequence), len(prompt_masked))
    return torch.cat([torch.where(prompt_masked[:n], mask_id, sequence[:n]), sequence[n:]])


def _pack_units(clean_len: list[int], copy_len: list[int], budget: int | None) -> list[list[int]]:
    """Units grouped into packed rows, in order: a row takes units while its clean context plus its copies fit
    ``budget`` tokens (at least one unit per row; no budget: one row)."""
    groups: list[list[int]] = []
    clean = copies = 0  # the current row's clean context and copy tokens
    for unit, (need, size) in enumerate(zip(clean_len, copy_len)):
        if not groups or (budget is not None and max(clean, need) + copies + size > budget):
            groups.append([])
            clean = copies = 0
        groups[-1].append(unit)
        clean, copies = max(clean, need), copies + size
    return groups


def _copy_segment(geometry: BlockGeometry, units: Units, unit: int, mask_id: int,
                  copy: int) -> tuple[Segment, Tensor]:
    """A noisy copy of the unit's blocks and the indices of the copied tokens."""
    idx = units.in_copy[unit].nonzero().squeeze(1)
    ids = torch.where(units.masked[unit, idx], mask_id, geometry.ids[idx])
    return Segment(ids, geometry.pos[idx], geometry.block[idx], copy), idx


def _assemble(sample: Sample, sample_index: int, clean_ids: Tensor, block_size: int,
              copies: list[tuple[Segment, Tensor]], unit_ids: list[int], units: Units, shared_cols: int) -> Row:
    segments, cols, resp_index, unit_of, steps, level = [clean_segment(clean_ids, block_size)], [], [], [], [], []
    offset = len(clean_ids)
    response_start = (len(sample.prompt) // block_size) * block_size - len(sample.prompt)  # geometry -> response
    for (segment, idx), unit in zip(copies, unit_ids):
        hit = units.trained[unit, idx].nonzero().squeeze(1)
        cols.append(offset + hit)
        resp_index.append(idx[hit] + response_start)
        unit_of.append(torch.full_like(hit, unit))
        steps.append(units.steps[idx[hit]])
        level.append(units.level[unit, idx[hit]])
        segments.append(segment)
        offset += len(segment.ids)
    return Row(segments, sample_index, torch.cat(cols), torch.cat(resp_index), torch.cat(unit_of), torch.cat(steps),
               torch.cat(level), shared_cols)


# ---------------------------------------------------------------- full attention: one row per unit


def _full_rows(sample: Sample, sample_index: int, algorithm: Algorithm, cfg: ViewConfig, traits: ModelTraits,
               gen: torch.Generator) -> list[Row]:
    direct = algorithm.full_rows(sample, sample_index, cfg, traits, gen)
    if direct is not None:
        return direct
    units = _noised_prompts(algorithm.full_units(sample, cfg, gen).nonempty(), sample, cfg, algorithm, gen)
    prompt_len = len(sample.prompt)
    generated = torch.cat([sample.resp, sample.tail])
    rows = []
    for unit in range(len(units.masked)):
        sequence = torch.cat([sample.prompt, torch.where(units.masked[unit], traits.mask_id, generated)])
        if units.prompt_masked is not None:
            sequence = _masked_prompt(sequence, units.prompt_masked[unit], traits.mask_id)
        hit = units.trained[unit].nonzero().squeeze(1)
        rows.append(Row([clean_segment(sequence, None)], sample_index, prompt_len + hit, hit,
                        torch.full_like(hit, unit), units.steps[hit], units.level[unit, hit]))
    return rows


# ---------------------------------------------------------------- public entry


def build_view(trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
               cfg: ViewConfig, traits: ModelTraits) -> TrainBatch:
    """The training batch of ``trajectories`` under ``cfg`` (its ``method`` names the algorithm)."""
    algorithm = algorithm_named(cfg.method)
    refusal = algorithm.refusal(traits)
    if refusal:
        raise ValueError(refusal)
    samples, dropped = prepare_samples(trajectories, advantages, cfg, traits)
    gen = torch.Generator().manual_seed(cfg.seed)
    make_rows = _block_rows if traits.attention == "block" else _full_rows
    rows: list[Row] = []
    for sample_index, sample in enumerate(samples):
        rows.extend(make_rows(sample, sample_index, algorithm, cfg, traits, gen))
    return _finish(rows, samples, dropped, cfg, traits, algorithm)


def _finish(rows: list[Row], samples: list[Sample], dropped: list[tuple[str, str]], cfg: ViewConfig,
            traits: ModelTraits, algorithm: Algorithm) -> TrainBatch:
    exact = (algorithm.exact(cfg, traits, samples) and not prompt_mask_p(cfg, algorithm)
             and not any(sample.cached_logp for sample in samples))
    tensors = collate_rows([row.segments for row in rows], traits.pad_id)
    n_tok = [len(row.cols) for row in rows]
    sample_index = (torch.cat([torch.full((count,), row.sample) for row, count in zip(rows, n_tok)]) if rows
                    else _empty())
    resp_index = torch.cat([row.resp_index for row in rows]) if rows else _empty()
    unit = _global_units(rows, samples)
    token_cols = torch.cat([row.cols for row in rows]) if rows else _empty()
    # the 1/t weighting of the masked-diffusion ELBO: each noised token counts 1 / (its masking probability)
    level = torch.cat([row.level for row in rows]) if rows else torch.ones(0)
    gather = _per_sample_gather(samples, sample_index, resp_index)
    resp_len = torch.tensor([len(sample.resp) for sample in samples], dtype=torch.float32)
    group_of = {}
    sample_group = torch.tensor([group_of.setdefault(s.group_id, len(group_of)) for s in samples], dtype=torch.long)
    loss_norm = cfg.loss_norm or algorithm.loss_norm
    steps = torch.cat([row.steps for row in rows]) if rows else _empty()
    step_group = _step_groups(sample_index, steps)
    weights = _weights(step_group if loss_norm == "step_mean" else unit, samples, loss_norm)
    num_units = int(unit.max()) + 1 if len(unit) else 0
    return TrainBatch(
        input_ids=tensors.input_ids, position_ids=tensors.position_ids, layout=tensors.layout,
        row_sample=torch.tensor([row.sample for row in rows], dtype=torch.long),
        rows=torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(n_tok, dtype=torch.long)),
        cols=predicting_columns(token_cols, traits.shift_logits, first=0), token_cols=token_cols,
        labels=gather("resp"), advantages=gather("adv"), old_logprobs=gather("logp") if exact else
        torch.full((len(token_cols),), math.nan), weights=weights / level if cfg.elbo_weight else weights,
        sample_index=sample_index, token_index=resp_index,
        steps=steps, unit=unit,
        sample_ids=[sample.sample_id for sample in samples], num_units=num_units,
        exact=exact, dropped=dropped, extra={"level": level, "resp_len": resp_len[sample_index],
                                             "batch_resp_len": resp_len.sum().expand(len(token_cols)).clone(),
                                             "group": sample_group[sample_index] if rows else _empty(),
                                             "batch_groups": torch.full((len(token_cols),), float(len(group_of))),
                                             "batch_samples": torch.full((len(token_cols),), float(len(samples))),
                                             "batch_units": torch.full((len(token_cols),), float(num_units))},
        counts={"units": float(num_units), "tokens": float(len(token_cols)), "samples": float(len(samples)),
                "steps": float(int(step_group.max()) + 1 if len(step_group) else 0),
                "longest": float(max((len(sample.resp) for sample in samples), default=0)),
                "resp_len": float(resp_len.sum()), "groups": float(len(group_of))},
        loss_norm=loss_norm, shared_cols=_shared_cols(rows))


def _step_groups(sample_index: Tensor, steps: Tensor) -> Tensor:
    """Per trained token, the index of its (sample, decoding step) pair among the batch's."""
    if not len(steps):
        return _empty()
    return torch.unique(sample_index * (int(steps.max()) + 1) + steps, return_inverse=True)[1]


def _shared_cols(rows: list[Row]) -> Tensor | None:
    """Each row's shareable leading columns, or None when no row has any."""
    shared = torch.tensor([row.shared_cols for row in rows], dtype=torch.long)
    return shared if bool(shared.any()) else None


def _empty() -> Tensor:
    return torch.zeros(0, dtype=torch.long)


def _global_units(rows: list[Row], samples: list[Sample]) -> Tensor:
    """Number units globally: sample by sample, local unit order (identical for packed and per-round)."""
    if not rows:
        return _empty()
    per_sample = torch.zeros(len(samples), dtype=torch.long)
    for row in rows:
        if len(row.unit):
            per_sample[row.sample] = max(int(per_sample[row.sample]), int(row.unit.max()) + 1)
    offsets = torch.cumsum(per_sample, 0) - per_sample
    return torch.cat([row.unit + offsets[row.sample] for row in rows])


def _per_sample_gather(samples: list[Sample], sample_index: Tensor, resp_index: Tensor):
    """Gather a per-response-token attribute of each trained token from its own sample."""

    def gather(name: str) -> Tensor:
        if not samples:
            return torch.zeros(0, dtype=torch.long if name == "resp" else torch.float32)
        flat = torch.cat([getattr(sample, name) for sample in samples])
        offsets = torch.tensor([0] + [len(sample.resp) for sample in samples[:-1]]).cumsum(0)
        return flat[offsets[sample_index] + resp_index]

    return gather


# TrainBatch.counts, in a fixed order
NORM_COUNTS = ("units", "tokens", "longest", "resp_len", "groups", "samples", "steps")


def normalised_over_processes(batch: TrainBatch, totals: Mapping[str, float], world: int) -> TrainBatch:
    """One process's shard of an optimiser step, its loss weighted as the whole step's batch would be.

    Each process builds the view of its own shard, normalised by the shard's counts (units, tokens, longest
    response...), so a token's weight would depend on which process it landed on. ``totals``: the counts over
    every process (the longest response: the longest of all). Weights and the batch-level normalisers become the
    whole batch's, times ``world``, since data parallelism averages the processes' gradients: the step is then
    the step of one process on the whole batch."""
    mine = batch.counts
    if batch.loss_norm == "padded_length":
        local, whole = mine["units"] * mine["longest"], totals["units"] * totals["longest"]
    elif batch.loss_norm == "token_mean":
        local, whole = mine["tokens"], totals["tokens"]
    elif batch.loss_norm == "step_mean":
        local, whole = mine["steps"], totals["steps"]
    else:  # row_mean, unit_sum: per-unit means or sums, averaged over units
        local, whole = mine["units"], totals["units"]
    scale = world * local / whole if whole else 0.0
    whole_batch = {"batch_resp_len": totals["resp_len"] / world, "batch_groups": totals["groups"] / world,
                   "batch_samples": totals["samples"] / world, "batch_units": totals["units"] / world}
    extra = {k: torch.full_like(v, whole_batch[k]) if k in whole_batch else v for k, v in batch.extra.items()}
    return replace(batch.with_weights(batch.weights * scale), extra=extra)


def _weights(unit: Tensor, samples: list[Sample], loss_norm: str) -> Tensor:
    """Per-token loss weights from the batch's units and responses only (layout independent)."""
    if unit.numel() == 0:
        return torch.zeros(0)
    n_units = int(unit.max()) + 1
    if loss_norm == "padded_length":
        l1max = max(len(sample.resp) for sample in samples)
        return torch.full((unit.numel(),), 1.0 / (n_units * l1max))
    if loss_norm == "unit_sum":
        return torch.full((unit.numel(),), 1.0 / n_units)
    if loss_norm in ("row_mean", "step_mean"):  # step_mean: ``unit`` numbers the (sample, step) pairs
        per_unit = torch.bincount(unit, minlength=n_units).float()
        return 1.0 / (n_units * per_unit[unit])
    return torch.full((unit.numel(),), 1.0 / unit.numel())
