"""PolicyTrainer: one RL step = views -> old log-probs -> clipped policy-gradient updates, for every family.

The optimisation loop is train/trainer.py's; this class adds the policy's hooks: old log-probs (the sampler's, or
recomputed under no_grad before any update), new log-probs of the trained tokens as outputs, and the algorithm's
loss (train/algorithms/; the clipped policy-gradient loss with its KL terms, train/loss.py), optionally against a
frozen reference model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sample.trajectory import Trajectory
from train.algorithms import algorithm
from train.batch import TrainBatch
from train.loss import LossOutput
from train.settings import LRSchedulerConfig, OptimizerParams, RLTrainingConfig
from train.trainer import Plan, Trainer

if TYPE_CHECKING:
    from models.registry import Adapter

__all__ = ["PolicyTrainer", "Plan"]


class PolicyTrainer(Trainer):
    """Trains ``adapter.model`` with the clipped policy-gradient loss on trajectories and their advantages."""

    def __init__(self, adapter: Adapter, cfg: RLTrainingConfig, optimizer: OptimizerParams | None = None,
                 lr_scheduler: LRSchedulerConfig | None = None, total_steps: int | None = None,
                 accelerator: Any = None, ref_model: Any = None):
        super().__init__(adapter, cfg, optimizer, lr_scheduler, total_steps, accelerator)
        self.algorithm = algorithm(cfg.method)  # training.method: its loss (the views read the method too)
        self.fresh_masks = self.algorithm.needs.fresh_masks
        self.whole_samples = self.algorithm.needs.whole_samples or cfg.ratio_level == "sequence"
        self.whole_groups = self.algorithm.needs.whole_groups
        self.ref_model = ref_model
        if self.algorithm.needs.reference_model == "required" and ref_model is None:
            raise ValueError(f"training.method {cfg.method!r} needs a frozen reference model (ref_model)")
        if ref_model is not None:  # frozen reference for the ref_beta KL (a full copy per process)
            self.ref_model = ref_model.to(self.accelerator.device).eval().requires_grad_(False)

    def build_views(self, trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                    epoch: int = 0) -> list[TrainBatch]:
        return super().build_views(trajectories, self.algorithm.sample_advantages(trajectories, advantages), epoch)

    def compute_old_logprobs(self, plan: Plan) -> dict[str, float]:
        """Fill old log-probs (sampler or recomputed under no_grad before any update); returns metrics."""
        if self.algorithm.needs.old_logprobs == "none":  # a ratio-free loss
            return {}
        need = self.cfg.old_logp == "recompute" or self.cfg.check_sampler_logp or any(
            not mb.exact for micro in plan for mb in micro)
        if not need:
            return {}
        diffs = []
        with torch.no_grad():
            self.model.eval()
            for micro in plan:
                for mb in micro:
                    new = self.forward_logprobs(self.model, mb).float().cpu()
                    if mb.exact and new.numel():
                        diffs.append(float((new - mb.old_logprobs).abs().max()))
                    if self.cfg.old_logp == "recompute" or not mb.exact:
                        mb.old_logprobs = new
        return {"sampler_logp_max_abs_diff": max(diffs)} if diffs else {}

    def model_outputs(self, mb: TrainBatch) -> Tensor:
        return self.forward_logprobs(self.model, mb)

    def loss(self, mb: TrainBatch, logp_new: Tensor) -> LossOutput:
        return self.algorithm.loss(logp_new, mb, self.cfg, self._ref_logprobs(mb))

    def _ref_logprobs(self, mb: TrainBatch) -> Tensor | None:
        if self.ref_model is None or not (self.cfg.ref_beta or self.algorithm.needs.reference_model == "required"):
            return None
        with torch.no_grad():
            return self.forward_logprobs(self.ref_model, mb).float()

