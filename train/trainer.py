"""Trainer: the optimisation core every objective shares (policy, value, SFT): hooks over one loop.

One ``train_step(trajectories, targets)`` = views -> micro-batches -> old outputs -> optimiser steps. Subclasses
override only the hooks they change (the policy, value and SFT trainers do):
* ``build_views(trajectories, targets)`` -> one TrainBatch per optimiser step (this process's shard),
* ``compute_old_logprobs(plan)`` -> per-token quantities needed before any update (default: none),
* ``model_outputs(micro_batch)`` -> what the loss consumes,
* ``loss(micro_batch, outputs)`` -> LossOutput,
* ``after_step(metrics)`` -> called after every optimiser step (logging, checkpoints).

Optimisation (fixing the reference's double division and per-process LR stepping, Gen-Verse/dLLM-RL
train/rl_trado.py): loss weights are normalised over each optimiser step's batch by the view, so micro-batch losses
add up and gradient accumulation divides exactly once (accelerate / DeepSpeed divide by their accumulation count;
the trainer undoes it); the LR schedule is advanced once per ``train_step`` (an RL step: its optimiser steps share
one rate, as verl's actor does, so a decaying schedule ends on the run's last step however many samples the filters
drop) and honours ``min_lr_scale``; rows are shuffled with a seed. Works single-process without a launcher, and
under DDP or DeepSpeed ZeRO-2/3 through ``train.accelerator.build_accelerator`` (every process runs the same number
of forwards: short shards are padded with zero-weight micro-batches).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from core.errors import UserError
from core.schema import replace as replace_settings
from models.layers import head_weight
from sample.trajectory import Trajectory
from train.batch import TrainBatch
from train.logprobs import gathered_logprobs
from train.loss import LOSS_KEYS, LossOutput, finalize_metrics, sum_metrics
from train.schedules import LRSchedule
from train.settings import LRSchedulerConfig, OptimizerParams, TrainerSettings
from train.shared_prefix import shared_prefix_hidden, shared_prefix_plan
from train.views import NORM_COUNTS, ModelTraits, build_view, normalised_over_processes

if TYPE_CHECKING:
    from models.registry import Adapter

log = logging.getLogger(__name__)


class NonFiniteError(UserError):
    """Training met a NaN or Inf (loss, gradient norm or weights): it stops before anything is saved."""

Plan = list[list[TrainBatch]]  # optimiser steps -> micro-batches


def shard_steps(trajectories: Sequence[Trajectory], rank: int, world: int, samples_per_step: int | None,
                whole_groups: bool, generator: torch.Generator | None) -> list[list[Trajectory]]:
    """This process's trajectories, cut into its optimiser steps (the same number on every process).

    The unit dealt out is a sample, or with ``whole_groups`` a prompt group (``group_id``): a loss over pairs of a
    group's responses (VRPO) loses every pair whose two responses land on different processes or steps. Units are
    shuffled with ``generator`` (None: in order) and dealt round robin; each step takes units while it has room for
    ``samples_per_step`` samples (default: all of the process's share), a group whole even where it overflows.
    """
    units: list[list[Trajectory]] = [[t] for t in trajectories]
    if whole_groups:
        by_group: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            by_group.setdefault(t.group_id, []).append(t)
        units = list(by_group.values())
    order = torch.randperm(len(units), generator=generator) if generator is not None else torch.arange(len(units))
    mine = [units[i] for i in order[rank::world].tolist()]
    per_process = math.ceil(len(trajectories) / world)
    per_step = samples_per_step or per_process
    steps: list[list[Trajectory]] = [[] for _ in range(math.ceil(per_process / per_step))]
    k = 0
    for unit in mine:
        if steps[k] and len(steps[k]) + len(unit) > per_step and k + 1 < len(steps):
            k += 1
        steps[k].extend(unit)
    return steps


class Trainer:
    """Trains ``adapter.model`` on trajectories; the objective comes from the hooks (see module docstring)."""

    def __init__(self, adapter: Adapter, cfg: TrainerSettings, optimizer: OptimizerParams | None = None,
                 lr_scheduler: LRSchedulerConfig | None = None, total_steps: int | None = None,
                 accelerator: Any = None):
        """``cfg``: the trainer settings plus the view settings (a training config section); ``total_steps``:
        ``train_step`` calls over the whole run, skipped ones included (needed by decaying LR schedules)."""
        self.adapter, self.cfg = adapter, cfg
        opt = optimizer or OptimizerParams()
        sched = lr_scheduler or LRSchedulerConfig()
        self.traits = ModelTraits.from_adapter(adapter)
        self.accelerator = accelerator or accelerator_for(cfg)
        if cfg.enable_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        model = adapter.model
        if cfg.gradient_checkpointing_enable:
            _enable_checkpointing(model)
        trained = [p for p in model.parameters() if p.requires_grad]
        optim = _adamw(trained, opt, self.accelerator)
        # AdamW's first update moves a weight by up to lr / (1 - beta1): past the weights' dtype torch's loop refuses
        # it (at any later step too) and its fused kernel writes inf, so a rate above this stops the step before any
        # weight is touched, whichever kernel runs
        self.max_lr = min((torch.finfo(p.dtype).max for p in trained), default=math.inf) * max(1.0 - opt.beta1, 1e-12)
        self.model, self.optimizer = self.accelerator.prepare(model, optim)
        # block models only (a full-attention row's prompt sees its response); a router's aux loss is the last
        # forward's (models/moe.py): a shared prefix's forward would go uncounted
        self.share_prompts = (cfg.share_prompts and self.traits.attention == "block"
                              and not _router_aux_loss_coef(model))
        self.schedule = LRSchedule(self.optimizer, sched.scheduler, total_steps, sched.params.warmup_steps,
                                   sched.params.min_lr_scale)
        self.rl_step = 0
        self.dropped: list[tuple[str, str]] = []
        self.fresh_masks = False  # every inner iteration (num_train_epochs) builds its own rows
        self.whole_samples = False  # micro-batches hold whole samples (losses that combine a sample's tokens)
        self.whole_groups = False  # micro-batches hold whole prompt groups (losses over pairs of responses)

    # ------------------------------------------------------------ the RL step

    def train_step(self, trajectories: Sequence[Trajectory],
                   advantages: Mapping[str, float | Sequence[float]]) -> list[dict[str, float]]:
        """Train on one RL step's trajectories; returns the metrics of every optimiser step."""
        self.rl_step += 1
        plans = [self._plan(trajectories, advantages, 0)]
        for epoch in range(1, self.cfg.num_train_epochs):  # fresh masks: every inner iteration has its own rows
            plans.append(self._plan(trajectories, advantages, epoch) if self.fresh_masks else plans[0])
        old_metrics: dict[str, float] = {}
        for plan in plans[:len(plans) if self.fresh_masks else 1]:  # every old quantity before any update
            old_metrics.update(self.compute_old_logprobs(plan))
        out = []
        for plan in plans:
            for micro in plan:
                if not micro:  # every sample of this step was dropped (all processes agree, see _equalize)
                    continue
                metrics = {**self.optimizer_step(micro), **old_metrics, "rl_step": float(self.rl_step),
                           "dropped": float(len(self.dropped))}
                self.after_step(metrics)
                out.append(metrics)
        self.schedule.step()
        return out

    def skip_step(self) -> None:
        """A step with nothing to train on: the step-keyed random draws and the LR schedule move on as if trained."""
        self.rl_step += 1
        self.schedule.step()

    def _plan(self, trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
              epoch: int) -> Plan:
        batches = self.build_views(trajectories, advantages, epoch)
        return self._equalize([self.micro_batches(b, i + 1000 * epoch) for i, b in enumerate(batches)])

    # ------------------------------------------------------------ hooks

    def build_views(self, trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                    epoch: int = 0) -> list[TrainBatch]:
        """Shuffle, shard over processes, cut into optimiser-step groups and build each group's view (``epoch``:
        the inner iteration, whose masks are its own when the algorithm draws fresh ones)."""
        acc = self.accelerator
        if not trajectories:
            raise ValueError("train_step got no trajectories")
        generator = self._generator(0) if self.cfg.shuffle else None
        steps = shard_steps(trajectories, acc.process_index, acc.num_processes, self.cfg.samples_per_step,
                            self.whole_groups, generator)
        view_cfg = replace_settings(self.cfg, seed=self.cfg.seed + 7919 * self.rl_step + acc.process_index
                                    + 104_729 * epoch)
        batches = [build_view(step, advantages, view_cfg, self.traits) for step in steps]
        self.dropped = [d for b in batches for d in b.dropped]
        if acc.num_processes > 1 and not any(b.num_rows for b in batches):
            # none of this process's samples gives a row (fewer kept samples than processes, or all dropped): it
            # trains a zero-weight copy of another's, so that the collective forwards and reductions stay in step
            batches[0] = self._filler_view(trajectories, advantages, view_cfg) or batches[0]
        batches = self._normalised_over_processes(batches)
        if self.dropped:
            log.warning("dropped %d trajectories: %s", len(self.dropped), self.dropped[:5])
        return batches

    def _filler_view(self, trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                     cfg: Any) -> TrainBatch | None:
        """A zero-weight view (counted as nothing) of the step's first sample, or prompt group, that gives rows."""
        for first in trajectories:
            unit = [t for t in trajectories if t.group_id == first.group_id] if self.whole_groups else [first]
            view = build_view(unit, advantages, cfg, self.traits)
            if view.num_rows:
                return view.as_filler()
        return None

    def _normalised_over_processes(self, batches: list[TrainBatch]) -> list[TrainBatch]:
        """Every process's optimiser-step batches weighted as the whole step's batch (``normalised_over_processes``:
        each view was normalised by its own shard's counts). Every process has the same number of steps."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return batches
        local = torch.tensor([[b.counts[k] for k in NORM_COUNTS] for b in batches], dtype=torch.float64,
                             device=acc.device)
        every = acc.gather(local[None]).cpu()  # [processes, steps, counts]
        totals = every.sum(0)
        longest = NORM_COUNTS.index("longest")
        totals[:, longest] = every[:, :, longest].max(0).values
        return [normalised_over_processes(b, dict(zip(NORM_COUNTS, t.tolist())), acc.num_processes)
                for b, t in zip(batches, totals, strict=True)]

    def compute_old_logprobs(self, plan: Plan) -> dict[str, float]:
        """Per-token quantities the loss needs from the model before any update (none by default)."""
        return {}

    def model_outputs(self, mb: TrainBatch) -> Tensor:
        raise NotImplementedError

    def loss(self, mb: TrainBatch, outputs: Tensor) -> LossOutput:
        raise NotImplementedError

    def after_step(self, metrics: dict[str, float]) -> None:
        """Called after every optimiser step (override for logging / checkpoints)."""

    # ------------------------------------------------------------ forward

    def forward_logprobs(self, model: Any, mb: TrainBatch) -> Tensor:
        """fp32 log-probs of the micro-batch's trained tokens (gathered, chunked LM head); rows of one prompt share
        its prefix's forward where that pays (``training.share_prompts``, train/shared_prefix.py)."""
        sharing = shared_prefix_plan(mb) if self.share_prompts else None
        mb = mb.to(self.accelerator.device)
        unwrapped = self.accelerator.unwrap_model(model) if model is self.model else model
        with self.accelerator.autocast():
            if sharing is None:
                out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, layout=mb.layout, logits_to_keep=1)
                hidden, cols = out.hidden_states[-1], mb.cols
            else:
                sharing = sharing.to(self.accelerator.device)
                num_layers = len(unwrapped.new_cache().keys)
                hidden, cols = shared_prefix_hidden(model, sharing, num_layers), sharing.cols
            return gathered_logprobs(unwrapped.lm_logits, hidden, mb.rows, cols, mb.labels,
                                     self.cfg.logits_chunk_size, head_weight(unwrapped))

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """No-grad log-probs of every trained token of ``batch`` (for checks and evaluation; one process: its
        micro-batches are not equalised or agreed on across processes)."""
        with torch.no_grad():
            self.model.eval()
            parts = [self.forward_logprobs(self.model, mb).float().cpu()
                     for mb in self._row_chunks(batch)]
        return _reassemble(batch, parts, self.cfg.batch_size_lm)

    # ------------------------------------------------------------ optimisation

    def micro_batches(self, batch: TrainBatch, step: int, shuffle: bool | None = None) -> list[TrainBatch]:
        """Split a step's rows into micro-batches of ``batch_size_lm`` rows, a prompt's rows adjacent and the prompts
        in a seeded random order (``grouped_order``); with ``whole_samples`` a micro-batch takes samples (all their
        rows) while it has room, at least one sample (prompt groups when the algorithm needs whole groups)."""
        shuffle = self.cfg.shuffle if shuffle is None else shuffle
        size = self.cfg.batch_size_lm
        generator = self._generator(step + 1) if shuffle else None
        row_group = torch.zeros(batch.num_rows, dtype=torch.long).index_put_((batch.rows,), batch.extra["group"])
        if not self.whole_samples and not self.whole_groups:
            order = grouped_order(row_group, generator)
            return [batch.select_rows(order[i:i + size]) for i in range(0, batch.num_rows, size)]
        row_key = row_group if self.whole_groups else batch.row_sample
        keys, first_row, _ = _first_appearance(row_key)
        keys = keys[grouped_order(row_group[first_row], generator)]
        groups: list[list[Tensor]] = []
        for key in keys.tolist():
            rows = (row_key == key).nonzero().squeeze(1)
            if not groups or sum(len(r) for r in groups[-1]) + len(rows) > size:
                groups.append([])
            groups[-1].append(rows)
        return [batch.select_rows(torch.cat(group)) for group in groups]

    def _row_chunks(self, batch: TrainBatch) -> list[TrainBatch]:
        """Consecutive chunks of ``batch_size_lm`` rows (for no-grad log-probs, where no loss combines rows)."""
        size = self.cfg.batch_size_lm
        return [batch.select_rows(torch.arange(i, min(i + size, batch.num_rows))) for i in range(0, batch.num_rows,
                                                                                                  size)]

    def optimizer_step(self, micro: list[TrainBatch]) -> dict[str, float]:
        """Accumulate gradients over the micro-batches, clip, step once at the schedule's current rate."""
        acc = self.accelerator
        lr = self.schedule.apply()
        if lr > self.max_lr:
            raise NonFiniteError(f"training step {self.rl_step}: the optimizer update at learning rate {lr:g} "
                                 "overflows the weights' dtype (optimizer.params.learning_rate); nothing of this "
                                 "step was saved")
        self.model.train()
        parts = []
        # the policy losses of the micro-batches add up to the step's (weights normalised over the whole step);
        # a router's aux loss is a per-forward mean, so the step takes the mean over its micro-batches
        forwards = sum(not mb.filler for mb in micro) or 1
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            acc.gradient_state._set_sync_gradients(last)
            ctx = nullcontext() if last or _is_deepspeed(acc) else acc.no_sync(self.model)
            with ctx:
                out = self.loss(mb, self.model_outputs(mb))
                total = (out.loss + self._router_aux_loss() / forwards) * self._accumulation_divisor()
                # a filler only keeps the collectives in step: its zero weights do not silence every loss (VRPO's
                # pairs, a router's aux loss), so its whole contribution is zeroed here
                acc.backward(total * 0.0 if mb.filler else total)
            parts.append(out.metrics)
        metrics = finalize_metrics(self._global_sums(parts, micro))
        self._stop_if_not_finite("loss", metrics.get("loss", 0.0))
        grad_norm = None
        if self.cfg.max_grad_norm:
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            if grad_norm is not None and not _loss_scaled(acc):  # fp16 loss scaling skips overflowing steps itself
                self._stop_if_not_finite("gradient norm", float(grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        acc.gradient_state._set_sync_gradients(True)
        self._stop_if_not_finite("largest weight", self._weights_norm())
        metrics.update(lr=lr, micro_batches=float(len(micro)))
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    def _router_aux_loss(self) -> Tensor | float:
        """A mixture-of-experts model's load-balancing loss of the forward just run, times the config's
        ``router_aux_loss_coef`` (models/moe.py; on when the config says ``output_router_logits``); 0 otherwise."""
        model = self.accelerator.unwrap_model(self.model)
        coef = _router_aux_loss_coef(model)
        for name in ("backbone", "model"):
            aux = getattr(getattr(model, name, None), "router_aux_loss", None)
            if coef and aux is not None:
                loss = aux()
                return coef * loss if loss is not None else 0.0
        return 0.0

    def _stop_if_not_finite(self, quantity: str, value: float) -> None:
        """Raise (every process alike: the values are global) at the first NaN / Inf, before it is saved."""
        if not math.isfinite(value):
            raise NonFiniteError(
                f"training step {self.rl_step}: the {quantity} is {value}; the likely cause is a learning rate too "
                "high for this model (optimizer.params.learning_rate) or a dtype that overflows (model.dtype, "
                "training.mixed_precision); nothing of this step was saved")

    def _weights_norm(self) -> float:
        """A norm over every local trained weight: one host sync, not finite as soon as one weight is not. Frozen
        weights cannot change (and a QLoRA base's are packed 4-bit integers). Under ZeRO-3 a process sees only its
        partitions (empty here): the loss and gradient-norm checks cover it."""
        params = [p.detach() for p in self.model.parameters() if p.requires_grad and p.numel()]
        if not params:
            return 0.0
        return float(torch.stack(torch._foreach_norm(params, float("inf"))).max())

    def _global_sums(self, parts: list[dict[str, float]], micro: list[TrainBatch]) -> dict[str, float]:
        """Metric sums over every process's real micro-batches (fillers excluded); losses averaged over processes,
        matching the averaged gradient."""
        keys = sorted(parts[0])
        total = sum_metrics([p for p, mb in zip(parts, micro) if not mb.filler], keys)
        acc = self.accelerator
        if acc.num_processes == 1:
            return total
        # float64 on every process (a process that trained only fillers has integer zeros)
        values = torch.tensor([float(total[k]) for k in keys], dtype=torch.float64, device=acc.device)
        reduced = acc.reduce(values, reduction="sum").tolist()
        total = dict(zip(keys, reduced))
        for k in LOSS_KEYS:
            if k in total:
                total[k] /= acc.num_processes
        return total

    def _accumulation_divisor(self) -> float:
        """What accelerate / DeepSpeed divide the loss by; multiplied back so accumulation divides only once."""
        acc = self.accelerator
        if _is_deepspeed(acc):
            return float(acc.deepspeed_engine_wrapped.engine.gradient_accumulation_steps())
        return float(acc.gradient_accumulation_steps)

    def _equalize(self, plan: Plan) -> Plan:
        """Give every process the same number of micro-batches per step (ZeRO-3 forwards are collective)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return plan
        filler = next((mb for micro in plan for mb in micro), None)
        counts = torch.tensor([len(m) for m in plan] + [filler is not None], device=acc.device)
        every = acc.gather(counts[None])
        empty = [rank for rank, has_rows in enumerate(every[:, -1].tolist()) if not has_rows]
        if empty:  # every process raises (the others would wait in the next collective for the empty ones)
            raise ValueError(f"training step {self.rl_step}: process(es) {empty} got no training rows (every sample "
                             f"dealt to them was dropped or had nothing to train; see the dropped-trajectories "
                             f"warning); sample more responses per step or use fewer processes")
        most = every[:, :-1].max(0).values.tolist()
        zero = filler.as_filler()
        return self._agree_on_sharing([micro + [zero] * (int(n) - len(micro)) for micro, n in zip(plan, most)])

    def _agree_on_sharing(self, plan: Plan) -> Plan:
        """Micro-batches share prompts only where every process's does: a shared micro-batch runs two forwards,
        and ZeRO-3's forwards are collective (one gather per step, after ``_equalize``)."""
        if not self.share_prompts:
            return plan
        mine = torch.tensor([shared_prefix_plan(mb) is not None for micro in plan for mb in micro],
                            device=self.accelerator.device)
        everyone = self.accelerator.gather(mine[None]).all(0).tolist()
        agreed = iter(everyone)
        return [[mb if next(agreed) else replace(mb, shared_cols=None) for mb in micro] for micro in plan]

    def _generator(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.rl_step * 1009 + salt)


def grouped_order(group: Tensor, generator: torch.Generator | None) -> Tensor:
    """A permutation of ``group``'s indices that keeps each prompt group's items adjacent (in their own order), the
    groups in a seeded random order (``generator``) or in order of first appearance.

    The micro-batches of one optimiser step add their gradients, so their order and make-up change no update. What
    they change is cost: a micro-batch holding the rows of fewer prompts computes fewer shared prompt prefixes
    (train/shared_prefix.py). Shuffled rows put ~4 prompts in each 16-row micro-batch of the real-weights recipe;
    grouped, one or two: a training step 1.3x faster (``python -m bench.shared_prompts``)."""
    if not len(group):
        return torch.zeros(0, dtype=torch.long)
    _, first, inverse = _first_appearance(group)
    drawn = torch.randperm(len(first), generator=generator) if generator is not None else torch.arange(len(first))
    # groups in the order drawn (a group's position is the inverse permutation's entry): with one item per group
    # that is the draw itself, the rows' plain shuffle
    return torch.argsort(torch.argsort(drawn)[inverse], stable=True)


def _first_appearance(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(distinct values, index of each one's first occurrence, each item's distinct-value index), the distinct
    values in order of first appearance."""
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(unique),), len(values), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(values)), "amin")
    order = torch.argsort(first)
    return unique[order], first[order], torch.argsort(order)[inverse]  # argsort of a permutation: its inverse


def _reassemble(batch: TrainBatch, parts: list[Tensor], size: int) -> Tensor:
    """Put per-micro-batch values back in the batch's token order (micro-batches are consecutive rows)."""
    out = torch.empty(batch.num_tokens)
    for i, part in enumerate(parts):
        sel = (batch.rows >= i * size) & (batch.rows < (i + 1) * size)
        out[sel] = part
    return out


def _router_aux_loss_coef(model: Any) -> float:
    """The model's ``router_aux_loss_coef`` when its config asks for the router logits, else 0."""
    config = getattr(model, "config", None)
    return getattr(config, "router_aux_loss_coef", 0.0) if getattr(config, "output_router_logits", False) else 0.0


def _enable_checkpointing(model: Any) -> None:
    """Recompute decoder layers in the backward pass (transformers 5 renamed the entry point)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _loss_scaled(acc: Any) -> bool:
    """fp16 with a loss scaler (accelerate's or DeepSpeed's): an inf gradient norm is a skipped step, not an error."""
    return getattr(acc, "scaler", None) is not None or getattr(acc, "mixed_precision", "no") == "fp16"


def _adamw(params: list[torch.nn.Parameter], opt: OptimizerParams, acc: Any) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel for the parameters' device (CPU, CUDA): one pass over each tensor
    instead of a dozen (``python -m bench.optimizer``: 7x faster on a 135M-parameter model on CPU). DeepSpeed
    swaps the optimiser's parameters for its own partitions, so under it torch's default stays."""
    fused = (getattr(acc, "distributed_type", None) != "DEEPSPEED"
             and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params))
    return torch.optim.AdamW(params, lr=opt.learning_rate, betas=(opt.beta1, opt.beta2), eps=opt.epsilon,
                             weight_decay=opt.weight_decay, fused=fused)


def _is_deepspeed(acc: Any) -> bool:
    return getattr(acc, "deepspeed_engine_wrapped", None) is not None


def accelerator_for(cfg: TrainerSettings) -> Any:
    """An Accelerator for this launch with the training settings' precision, accumulation, micro-batch and
    gradient clipping."""
    from train.accelerator import build_accelerator

    acc = build_accelerator(mixed_precision=cfg.mixed_precision,
                            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                            micro_batch_size=cfg.batch_size_lm, max_grad_norm=cfg.max_grad_norm)
    if cfg.gradient_accumulation_steps != 1 and acc.distributed_type != "DEEPSPEED" and acc.is_main_process:
        # the reference's files set it for DeepSpeed; here every optimiser step accumulates all its micro-batches
        print(f"note: training.gradient_accumulation_steps {cfg.gradient_accumulation_steps} has no effect without "
              "DeepSpeed: an optimiser step accumulates the micro-batches of all its samples (samples_per_step rows "
              "in forwards of batch_size_lm)", flush=True)
    return acc
