"""Training settings, declared once: each class is both a section of the job config and what the trainer reads.

``ViewConfig`` (how trajectories become rows), ``LossConfig`` (the clipped policy-gradient loss) and
``TrainerSettings`` (optimisation loop) combine into the ``training`` section of RL configs
(:class:`RLTrainingConfig`); ``OptimizerConfig`` and ``LRSchedulerConfig`` are the ``optimizer`` and
``lr_scheduler`` sections. Key names follow the reference configs (``training.batch_size_lm`` ...). Torch-free, so
configs are validated before heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.schema import SettingError, Settings, bounded
from train.algorithms import REGISTRY, canonical_method, method_choices


@dataclass
class Seeded(Settings):
    seed: int = 0  # random masks, row shuffling, sampling draws of the training job


@dataclass
class ViewConfig(Seeded):
    """How trajectories become training rows (see train/views.py)."""

    # an algorithm of train/algorithms/: TraceRL | random_masking | coupled (RL and SFT); semi_ar | ar (SFT of
    # full-attention models)
    method: str = "tracerl"
    layout: Literal["packed", "per_round"] = "packed"  # block models only; full attention: one row per unit
    # packed rows hold at most this many tokens: a sample's rounds are spread over several packed rows (at least one
    # round each), which bounds the activation memory of a row; null = one row per sample. About prompt + 3 x
    # response puts rounds two by two: fewer tokens than per-round rows and a lower peak memory (bench/train.py)
    max_row_tokens: int | None = bounded(None, 1)
    shrink: int = bounded(1, 1)  # merge groups of `shrink` consecutive step ids into one round
    post_num: int = bounded(0, 0)  # trained pad tokens per response besides the stop token
    max_prompt_len: int | None = bounded(None, 1)  # longer prompts are dropped together with their rewards
    max_gen_length: int | None = bounded(None, 1)  # response truncation (tokens)
    # padded_length: 1 / L1 per row (reference block models); row_mean: mean over the row's trained tokens
    # (reference Dream/LLaDA); token_mean: mean over all trained tokens of the batch; unit_sum: a unit's tokens
    # summed, units averaged (wd1's sequence log-likelihood); step_mean: mean over the tokens of each decoding step
    # of a sample, steps averaged (CJ-GRPO; on full attention the same as row_mean).
    # null: the algorithm's own (padded_length for TraceRL, random masking and coupled; see train/algorithms/).
    loss_norm: Literal["padded_length", "row_mean", "token_mean", "unit_sum", "step_mean"] | None = None
    lower_p: float = bounded(0.1, 0.0, 1.0)  # random / coupled masking ratio range
    upper_p: float = bounded(0.9, 0.0, 1.0)
    # per_sequence: one ratio t ~ U(lower_p, upper_p) per row; per_position: the reference's draw (a ratio per
    # position, marginally Bernoulli((lower_p + upper_p) / 2)).
    random_mask_mode: Literal["per_sequence", "per_position"] = "per_sequence"
    mask_times_per_sample: int = bounded(1, 1)  # random/coupled draws per sample (reference Dream/LLaDA: 35)
    # probability of masking each prompt token of a training row (d1's estimator: 0.15); null: the algorithm's own
    prompt_mask_p: float | None = bounded(None, 0.0, 1.0)
    # weight each randomly masked token by 1/t, t its masking probability (the masked-diffusion ELBO, as in LLaDA's
    # SFT); the reference weights every token 1. Random-masking methods only.
    elbo_weight: bool = False

    def validate(self) -> None:
        super().validate()
        method = canonical_method(self.method)
        if method is None:
            raise SettingError("method", f"method must be one of {method_choices()}; got {self.method!r}")
        self.method = method
        if self.lower_p > self.upper_p:
            raise SettingError("lower_p", f"lower_p ({self.lower_p}) exceeds upper_p ({self.upper_p})")
        if self.elbo_weight and not REGISTRY[self.method].elbo_weight:
            raise SettingError("elbo_weight", f"elbo_weight weights randomly masked tokens by 1/t; method "
                                              f"{self.method!r} masks nothing at random or weighs tokens itself")
        if self.elbo_weight and (self.lower_p == 0.0 or (self.method == "coupled" and self.upper_p == 1.0)):
            raise SettingError("elbo_weight", "elbo_weight needs masking probabilities above 0 (lower_p > 0; "
                                              "for coupled also upper_p < 1)")


@dataclass
class LossConfig(Settings):
    """The clipped policy-gradient loss (train/loss.py)."""

    eps: float = bounded(0.2, 0.0)  # PPO clip
    eps_high: float | None = bounded(None, 0.0)  # asymmetric upper clip (null = eps)
    beta: float = bounded(0.0, 0.0)  # KL to the old (rollout-step) policy; the reference configs use 0.01
    ref_beta: float = bounded(0.0, 0.0)  # KL to a frozen reference model (0 = no reference model is loaded)
    use_kl_estimator_k3: bool = True
    # token: PPO's per-token ratio; sequence: GSPO's (arXiv 2507.18071) exp(mean log-ratio over a sample's trained
    # tokens) for every token of the sample (GSPO's own clip range is eps 3e-4, eps_high 4e-4)
    ratio_level: Literal["token", "sequence"] = "token"
    dual_clip: float = bounded(3.0, 0.0)  # BGPO: negative-advantage surrogate floored at dual_clip x A (0 = off)
    eubo_beta: float = bounded(1.5, 0.0, lo_open=True)  # SPG: the EUBO's beta (SPG: 1.5 math, 1.0 Sudoku)
    eubo_weight: float = bounded(0.5, 0.0, 1.0)  # SPG: EUBO share of the negative-advantage score (1 = pure EUBO)
    preference_beta: float = bounded(0.2, 0.0, lo_open=True)  # VRPO: the DPO beta on ELBO differences (DARE: 0.2)


@dataclass
class TrainerSettings(Seeded):
    """The optimisation loop shared by every trainer."""

    gradient_checkpointing_enable: bool = False
    # DeepSpeed's accumulation count (its loss division undone: divided exactly once); no effect without it (noted)
    gradient_accumulation_steps: int = bounded(1, 1)
    batch_size_lm: int = bounded(1, 1)  # rows per forward (per process)
    samples_per_step: int | None = bounded(None, 1)  # samples per optimiser step and process (null = all)
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    enable_tf32: bool = True  # TF32 matmuls on CUDA
    num_train_epochs: int = bounded(1, 1)  # passes over one RL step's rows
    max_grad_norm: float = bounded(1.0, 0.0)  # 0 = no clipping
    # samples dealt to optimiser steps and processes in a seeded random order (the reference keeps file order);
    # within a step, micro-batches keep a prompt's rows together either way (train/trainer.py grouped_order)
    shuffle: bool = True
    logits_chunk_size: int = bounded(128, 1)  # trained positions per LM-head chunk
    # block models: rows of one prompt in a micro-batch compute its complete prompt blocks once (two forwards: the
    # distinct prompts, then the rows reading them as a cache; exact up to rounding; train/shared_prefix.py)
    share_prompts: bool = True


@dataclass
class RLTrainingConfig(TrainerSettings, ViewConfig, LossConfig):
    """The ``training`` section of RL jobs."""

    # "sampler": the log-probs recorded at rollout (exact views only); "recompute": a no-grad forward before any
    # update (the reference's way; inexact views always recompute).
    old_logp: Literal["sampler", "recompute"] = "sampler"
    check_sampler_logp: bool = False  # also recompute in "sampler" mode, to log the max |difference|
    gam: float = bounded(1.0, 0.0, 1.0)  # value model: discount over denoising steps
    lam: float = bounded(1.0, 0.0, 1.0)  # value model: GAE lambda


@dataclass
class OptimizerParams(Settings):
    """AdamW hyper-parameters (``optimizer.params``)."""

    learning_rate: float = bounded(1e-6, 0.0, lo_open=True)  # 0 would train nothing while looking like training
    beta1: float = bounded(0.9, 0.0, 1.0)
    beta2: float = bounded(0.999, 0.0, 1.0)
    weight_decay: float = bounded(0.0, 0.0)
    epsilon: float = bounded(1e-8, 0.0)


@dataclass
class OptimizerConfig(Settings):
    """The ``optimizer`` section (AdamW only)."""

    name: Literal["adamw"] = "adamw"
    params: OptimizerParams = field(default_factory=OptimizerParams)


@dataclass
class RLOptimizerParams(OptimizerParams):
    """RL jobs with a value model train two models, each with its own learning rate."""

    policy_learning_rate: float | None = bounded(None, 0.0, lo_open=True)  # null = learning_rate
    value_learning_rate: float = bounded(5e-6, 0.0, lo_open=True)  # the value model's (reference default 5e-6)


@dataclass
class RLOptimizerConfig(OptimizerConfig):
    params: RLOptimizerParams = field(default_factory=RLOptimizerParams)


@dataclass
class LRSchedulerParams(Settings):
    warmup_steps: int = bounded(0, 0)
    # A real floor: the LR never drops below min_lr_scale * lr, so 1.0 keeps it constant.
    min_lr_scale: float = bounded(0.0, 0.0, 1.0)


@dataclass
class LRSchedulerConfig(Settings):
    """The ``lr_scheduler`` section: the schedule over the training steps of the whole run (RL: one per RL step, its
    optimiser steps at one rate; SFT: one per optimiser step). ``warmup_steps`` counts the same steps."""

    scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    params: LRSchedulerParams = field(default_factory=LRSchedulerParams)


SFT_METHODS = {"semi-ar": "semi_ar", "semi_ar": "semi_ar", "random_masking": "random_masking", "trace": "tracerl",
               "tracerl": "tracerl", "ar": "ar"}


@dataclass
class SFTTrainingConfig(TrainerSettings, ViewConfig):
    """The ``training`` section of SFT jobs: the trainer loop plus the view that noises the responses.

    ``method``: ``semi-ar`` (the reference's name: block models noise each block of the response with the clean
    earlier blocks visible, i.e. random masking over the block layout; full-attention models get one row per
    block, later blocks masked), ``random_masking`` (every family), ``trace`` (the TraceRL rounds of a given step
    map; rows without one decode left to right), ``ar`` (models adapted from AR models, Dream / DiffuCoder: causal
    next-token training).
    """

    method: str = "semi-ar"
    block_size: int | None = bounded(None, 1)  # block models: train on blocks of this size (null = the model's)
    samples_per_step: int | None = bounded(16, 1)  # samples per optimiser step and process
    save_every: int = bounded(0, 0)  # optimiser steps between checkpoints (0 = only at the end)
    max_steps: int = bounded(0, 0)  # stop after this many optimiser steps (0 = num_train_epochs passes)
    # full-attention models adapted from AR ones: attention mask annealing (DiffuLLaMA, arXiv 2410.17891) over the
    # first this many steps, causal plus each later key visible with probability step / attention_annealing_steps;
    # full attention after (0 = full attention from the start)
    attention_annealing_steps: int = bounded(0, 0)

    def validate(self) -> None:
        if self.method not in SFT_METHODS:
            raise SettingError("method", f"method must be one of {', '.join(SFT_METHODS)}, got {self.method!r}")
        method = self.method
        self.method = SFT_METHODS[method]  # the view the method uses
        super().validate()
        self.method = method

    def view_method(self, attention: str) -> str:
        """The view the method uses for a model of ``attention`` kind."""
        if SFT_METHODS[self.method] == "semi_ar" and attention == "block":
            return "random_masking"  # the block layout already keeps later blocks out of view
        return SFT_METHODS[self.method]
