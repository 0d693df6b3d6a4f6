"""SFTTrainer: the trainer core (train/trainer.py) with a negative log-likelihood loss (a view + a loss).

Samples are ``Trajectory`` records of (prompt, response[, step map]); the SFT methods are the training views of RL
(random masking over the block layout for ``semi-ar`` / ``random_masking``, the TraceRL rounds of a step map for
``trace``), every trained token weighted as the view normalises it. No old log-probabilities are needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from core.loader import ConfigError
from core.schema import replace
from models.common import AttentionLayout
from sample.trajectory import Trajectory
from train.algorithms import algorithm
from train.batch import TrainBatch
from train.loss import LossOutput
from train.settings import SFTTrainingConfig
from train.trainer import Trainer
from train.traits import ModelTraits

if TYPE_CHECKING:
    from models.registry import Adapter


ANNEAL_SALT = 500_000  # the annealing draws' generator salt, apart from those of the micro-batch order (step + 1)
ANNEAL_PROCESS_STRIDE = 10_007  # apart per process (more micro-batches per step than this: never in practice)


def sft_sample(prompt_ids: list[int], response_ids: list[int], sample_id: str, step_map: list[int] | None = None,
               ends_turn: bool = True) -> Trajectory:
    """A training sample as a trajectory record (no log-probs: nothing sampled it); without a step map the response
    decodes left to right."""
    steps = list(step_map) if step_map is not None else list(range(1, len(response_ids) + 1))
    return Trajectory(prompt_ids=list(prompt_ids), response_ids=list(response_ids), step_map=steps,
                      logprobs=[], finish_reason="stop" if ends_turn else "length",
                      sample_id=sample_id, group_id=sample_id)


def nll_loss(logp: Tensor, weights: Tensor) -> LossOutput:
    """-sum(w * log p) over the trained tokens (weights carry the normalisation)."""
    w = weights.to(logp.device, logp.dtype)
    loss = -(w * logp).sum()
    with torch.no_grad():
        stats = torch.stack([loss.detach(), torch.tensor(float(logp.numel()), device=logp.device),
                             (-logp.detach()).sum()]).float().tolist()
    return LossOutput(loss, {"loss": stats[0], "tokens": stats[1], "nll_sum": stats[2]})


class SFTTrainer(Trainer):
    """Outputs are the log-probs of the trained tokens, the loss is their NLL; everything else is the core's."""

    def __init__(self, adapter: Adapter, cfg: SFTTrainingConfig, *args: Any, **kwargs: Any):
        view = algorithm(cfg.view_method(adapter.attention))
        if refusal := view.refusal(ModelTraits.from_adapter(adapter)):
            raise ConfigError(f"key 'training.method': {cfg.method} SFT of {adapter.model_base}: {refusal}",
                              "training.method")  # at once, not at the first step's view
        if cfg.attention_annealing_steps and (adapter.attention != "full" or view.causal):
            raise ConfigError("key 'training.attention_annealing_steps': attention annealing takes a full-attention "
                              f"model from causal to full attention; {adapter.model_base} with method "
                              f"{cfg.method} has no full attention to reach", "training.attention_annealing_steps")
        super().__init__(adapter, replace(cfg, method=cfg.view_method(adapter.attention)), *args, **kwargs)

    def train_samples(self, samples: Sequence[Trajectory]) -> list[dict[str, float]]:
        """One optimiser step (or more, with ``samples_per_step``) on SFT samples."""
        return self.train_step(samples, {s.sample_id: 1.0 for s in samples})

    def build_views(self, trajectories: Sequence[Trajectory], advantages: Mapping[str, float | Sequence[float]],
                    epoch: int = 0) -> list[TrainBatch]:
        """The views, each under the step's annealed attention while ``attention_annealing_steps`` lasts."""
        batches = super().build_views(trajectories, advantages, epoch)
        ratio = self.rl_step / self.cfg.attention_annealing_steps if self.cfg.attention_annealing_steps else 1.0
        if ratio >= 1.0:
            return batches
        # the views it replaces are one full-attention block per row: ar's causal rows are refused in __init__;
        # each process draws its own keys (the same salt everywhere would show every process one pattern per step)
        salt = ANNEAL_SALT + ANNEAL_PROCESS_STRIDE * self.accelerator.process_index
        return [replace(b, layout=AttentionLayout.annealed(b.layout.valid, ratio, self._generator(salt + i)))
                for i, b in enumerate(batches)]

    def model_outputs(self, mb: TrainBatch) -> Tensor:
        return self.forward_logprobs(self.model, mb)

    def loss(self, mb: TrainBatch, logp_new: Tensor) -> LossOutput:
        return nll_loss(logp_new, mb.weights)
