"""Job configuration: one YAML file plus ``key=value`` overrides, validated against a schema per job kind.

Usage (entry points)::

    cfg = load_config(sys.argv[1:], "rl")          # raises ConfigError (one line) on any user mistake
    cfg = load_config_or_exit("rl")                 # same, but prints the error and exits with status 2

Kinds: ``"rl"`` (rl.py, multinode_rl.py -> :class:`RLConfig`), ``"eval"`` (eval.py -> :class:`EvalConfig`),
``"sft"`` (train/sft_*.py -> :class:`SFTConfig`). Key names follow the reference configs (REFERENCE.md 14) so
its YAML files mostly load; the dataclasses below are the schema and document every key.

Semantics:
* overrides use ``OmegaConf.from_dotlist`` (values are YAML scalars: ``1e-5`` is a float, ``[0,1]`` a list,
  ``null`` is None) and are applied after the file, in order;
* ``${a.b}`` interpolations are kept in the returned config and resolve on access;
* values are type-checked and coerced (int -> float for float keys, numbers -> str for string keys);
* ``???`` (``MISSING``) marks required keys; ``experiment.project`` defaults to the config file's stem;
* the reference eval form (top-level ``model: <path>`` and ``model_base: <name>``) is accepted and rewritten
  to the nested form ``model.pretrained_model`` / ``model.model_base`` used everywhere here;
* placeholders documented as "null = <key>" become interpolations of that key, so consumers read real values;
* the returned ``DictConfig`` is in struct mode: reading or writing a key that is not in the schema raises.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import tempfile
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ConfigError", "load_config", "load_config_or_exit", "dump_config", "cfg_to_dict", "infer_kind",
    "eval_settings", "SCHEMAS", "RLConfig", "EvalConfig", "SFTConfig",
]

ModelBase = Literal["trado", "sdar", "dream", "llada", "mmada"]
DataType = Literal["math", "code", "option"]
Remasking = Literal["low_confidence_static", "low_confidence_dynamic", "sequential", "entropy_bounded"]
Target = Literal["confidence", "margin_confidence", "neg_entropy"]
CacheMode = Literal["none", "prefix", "dual"]


def bounded(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field whose (non-null) numeric value must lie in ``[lo, hi]``."""
    return field(default=default, metadata={"lo": lo, "hi": hi})


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class ExperimentConfig:
    """Job identity and output location (eval and SFT jobs use this part only)."""

    project: str = MISSING  # default: the config file's stem; outputs go to {output_dir}/{project}/
    output_dir: str = "runs"
    num_node: int = bounded(1, 1)
    node_index: int = bounded(0, 0)
    seed: int = 10086  # sampling / task-selection seed (the reference leaves rollouts unseeded)


@dataclass
class RLExperimentConfig(ExperimentConfig):
    """The RL loop: steps, checkpoints, resume, launcher."""

    function: Literal["train", "evaluation"] = "train"  # set per stage by the loop
    start_from_scratch: bool = True  # false = resume at current_epoch from {project}/ckpt
    total_step: int = bounded(80, 1)  # last RL step (inclusive)
    save_every: int = bounded(10, 1)  # also keep ckpt/epoch-{i}
    eval_every: int = bounded(10, 0)  # 0 = no in-loop evaluation
    current_epoch: int = bounded(1, 1)  # first RL step; 1 = start from model.pretrained_model
    train_value_every: int = bounded(1, 1)  # value-model pipeline only
    # accelerate_configs/{deepspeed_file}.yaml; null = a single process without DeepSpeed
    deepspeed_file: str | None = "1_node_8_gpus_deepspeed_zero3"


@dataclass
class ModelConfig:
    """Which checkpoint to load and how (eval jobs)."""

    pretrained_model: str = MISSING  # hub name or local directory
    model_base: ModelBase = MISSING  # selects the adapter in models/
    attn_backend: Literal["sdpa", "flex", "flash"] = "sdpa"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    block_size: int | None = bounded(None, 1)  # override the checkpoint's block size (block models)
    tokenizer: str | None = None  # null = the tokenizer saved with pretrained_model
    # CPU demos only: if pretrained_model does not exist, build a tiny RANDOM model of model_base there
    # (demo tokenizer, nothing downloaded). Never set this for real runs.
    init_tiny_if_missing: bool = False


@dataclass
class TrainModelConfig(ModelConfig):
    """Model keys of training jobs (SFT)."""

    optimized_name: str = "optimized"  # rolling checkpoint {output_dir}/{project}/ckpt/{optimized_name}


@dataclass
class RLModelConfig(TrainModelConfig):
    """Model keys of RL jobs; setting value_base_model enables the value-model pipeline (REFERENCE 9)."""

    value_base_model: str | None = None
    optimized_value_name: str = "optimized_value"


@dataclass
class RLDatasetConfig:
    """RL training data (``data/{train_dataset}.json`` or a built-in task ``builtin:<name>``)."""

    train_dataset: str = MISSING
    optimization_data: str = "rl_data"  # name of the rollout-to-trainer file
    data_type: DataType = "math"


@dataclass
class EvalDatasetConfig:
    """Evaluation data."""

    eval_dataset: str = MISSING
    data_type: DataType = "math"


@dataclass
class SFTDatasetConfig:
    """SFT data: ``data/{optimization_data}.json`` rows ``{prompt, response[, step_map]}``."""

    optimization_data: str = MISSING


@dataclass
class RolloutConfig:
    """Sampling settings; block-model keys first, then the full-attention (Dream/LLaDA/MMaDA) keys."""

    tensor_parallel_size: int = bounded(1, 1)
    max_active: int = bounded(256, 1)  # sequences in flight per sampler
    num_task_per_step: int = bounded(64, 1)  # prompts per RL step (split over nodes)
    num_response_per_task: int = bounded(16, 1)  # group size k
    temperature: float = bounded(1.0, 0.0)
    top_p: float = bounded(1.0, 0.0, 1.0)
    top_k: int = bounded(0, 0)  # 0 = off
    max_token: int = bounded(2000, 1)  # max completion tokens; also the truncation-penalty threshold
    stop_token_list: list[str] = field(default_factory=list)  # extra single-token stop words
    start_with_think: bool = False
    block_size: int = bounded(4, 1)
    denoising_steps_per_block: int = bounded(4, 1)
    remasking_strategy: Remasking = "low_confidence_dynamic"
    dynamic_threshold: float = bounded(0.9, 0.0, 1.0)
    eb_threshold: float = bounded(0.35, 0.0)  # entropy_bounded only
    steps: int | None = bounded(None, 1)  # total denoising steps; null = max_gen_length
    max_gen_length: int | None = bounded(None, 1)  # generation canvas; null = max_token
    further_horizon: int = bounded(32, 0)  # window beyond the block seen in cached steps
    use_cache: bool = True  # reference switch; true = prefix cache unless `cache` says otherwise
    cache: CacheMode | None = None  # null = "prefix" if use_cache else "none"
    target: Target = "confidence"
    alg_temp: float = bounded(0.0, 0.0)  # > 0: sample transfer positions from softmax(conf / alg_temp)
    pad_target_penalty: float = bounded(1.0, 0.0)  # divides the confidence of pad candidates
    batch_size: int = bounded(2, 1)  # prompts per forward (full-attention sampler)


@dataclass
class EvalRolloutConfig(RolloutConfig):
    """Rollout keys of eval jobs (REFERENCE 14.4)."""

    num_response_per_task: int = bounded(3, 1)
    output_unmasking_history: bool = True  # write the trace-viewer page (trajectories always keep step maps)


@dataclass
class ExecuteConfig:
    """Sandboxed code execution for code tasks."""

    num_chunk: int = bounded(128, 1)  # worker processes
    time_limit: float = bounded(1.0, 0.0)  # seconds per test when the task has no test_time_limit
    time_slack: float = bounded(2.0, 0.0)  # extra seconds per job (interpreter start-up)
    memory_limit_mb: int = bounded(2048, 0)  # 0 = unlimited (the reference sets none, REFERENCE 16.9)


@dataclass
class RewardConfig:
    """Reward shaping and group filtering (REFERENCE 5.2)."""

    truncation_margin: int = bounded(5, 0)  # length >= max_token - margin counts as wrong
    acc_low: float = bounded(0.2, 0.0, 1.0)  # math groups with accuracy outside [acc_low, acc_high] dropped
    acc_high: float = bounded(0.8, 0.0, 1.0)
    filter_all_equal: bool = True  # drop groups whose rewards are all equal (zero advantage)


@dataclass
class TrainingConfig:
    """Trainer keys shared by SFT and RL (REFERENCE 14.1 / 14.3)."""

    gradient_checkpointing_enable: bool = True
    gradient_accumulation_steps: int = bounded(32, 1)
    batch_size_lm: int = bounded(1, 1)  # per-GPU micro-batch (rows)
    mixed_precision: Literal["no", "fp16", "bf16"] = "bf16"
    enable_tf32: bool = True
    seed: int = 10086
    num_train_epochs: int = bounded(1, 1)
    max_grad_norm: float = bounded(1.0, 0.0)  # 0 = no clipping
    block_size: int = bounded(4, 1)  # training block size b
    shrink: int = bounded(1, 1)  # merge groups of `shrink` consecutive step ids (REFERENCE 6.2)
    post_num: int = bounded(0, 0)  # trained pad/EOS tokens per row
    max_gen_length: int = bounded(2000, 1)  # response truncation (tokens)
    max_prompt_len: int = bounded(784, 1)  # longer prompts are dropped together with their rewards
    lower_p: float = bounded(0.1, 0.0, 1.0)  # random / coupled masking ratio range
    upper_p: float = bounded(0.9, 0.0, 1.0)
    mask_times_per_sample: int = bounded(35, 1)  # full-attention random masking rows per sample
    # Ours. per_sequence: one ratio t ~ U(lower_p, upper_p) per row; per_position: the reference's draw
    # (a ratio per position, marginally Bernoulli((lower_p + upper_p) / 2), REFERENCE 8.1 / 10.1).
    random_mask_mode: Literal["per_sequence", "per_position"] = "per_sequence"
    packed: bool = True  # all TraceRL rounds of a sample in one packed sequence
    # padded_length: 1 / L1 per row (reference block models); row_mean: mean over the row's trained tokens
    # (reference Dream/LLaDA); token_mean: mean over all trained tokens of the batch.
    loss_norm: Literal["padded_length", "row_mean", "token_mean"] = "padded_length"
    logits_chunk_size: int = bounded(1024, 1)  # positions per LM-head chunk
    shuffle: bool = False  # reference: rows in file order


@dataclass
class RLTrainingConfig(TrainingConfig):
    """RL trainer keys (REFERENCE 6.8, 9)."""

    method: Literal["TraceRL", "random_masking", "coupled"] = "TraceRL"
    eps: float = bounded(0.2, 0.0)  # PPO clip (also the value clip)
    beta: float = bounded(0.01, 0.0)  # KL to the old (rollout-step) policy
    use_kl_estimator_k3: bool = True
    ref_beta: float = bounded(0.0, 0.0)  # ours: KL to a frozen reference model (0 = no reference model)
    old_logp: Literal["sampler", "recompute"] = "recompute"  # ours: sampler = log-probs recorded at rollout
    gam: float = bounded(1.0, 0.0, 1.0)  # value pipeline: discount over denoising steps
    lam: float = bounded(1.0, 0.0, 1.0)  # value pipeline: GAE lambda


@dataclass
class SFTTrainingConfig(TrainingConfig):
    """SFT trainer keys (REFERENCE 10, 14.3)."""

    gradient_accumulation_steps: int = bounded(16, 1)
    method: Literal["semi-ar", "trace", "ar", "random_masking"] = "semi-ar"


@dataclass
class OptimizerParams:
    """AdamW hyper-parameters."""

    learning_rate: float = bounded(1e-6, 0.0)
    scale_lr: bool = False  # accepted for reference configs; unused
    beta1: float = bounded(0.9, 0.0, 1.0)
    beta2: float = bounded(0.999, 0.0, 1.0)
    weight_decay: float = bounded(0.0, 0.0)
    epsilon: float = bounded(1e-8, 0.0)
    policy_learning_rate: float | None = bounded(None, 0.0)  # value pipeline; null = learning_rate
    value_learning_rate: float | None = bounded(None, 0.0)  # value model; null = 5e-6 (reference default)


@dataclass
class OptimizerConfig:
    """Optimizer (AdamW only)."""

    name: Literal["adamw"] = "adamw"
    params: OptimizerParams = field(default_factory=OptimizerParams)


@dataclass
class LRSchedulerParams:
    """Learning-rate schedule parameters."""

    warmup_steps: int = bounded(0, 0)
    # A real floor: the LR never drops below min_lr_scale * lr, so 1.0 keeps it constant. The reference
    # ignores it for cosine (decay to 0, advanced num_processes times per step: REFERENCE 15, 16.18).
    min_lr_scale: float = bounded(1.0, 0.0, 1.0)
    learning_rate: float | None = None  # accepted for reference configs (the optimizer LR); unused


@dataclass
class LRSchedulerConfig:
    """Learning-rate schedule, rebuilt for every RL step."""

    scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "cosine"
    params: LRSchedulerParams = field(default_factory=LRSchedulerParams)


@dataclass
class EvaluationConfig:
    """In-loop evaluation of RL jobs; overrides the rollout keys in eval mode.

    ``remasking_strategy``, ``top_k`` and ``block_size`` may be lists: paired element-wise (scalars are
    broadcast), one evaluation per pair (see :func:`eval_settings`). Keys left null follow the ``rollout`` key
    of the same name (an interpolation); all keys set here are honoured (the reference ignores
    evaluation.max_gen_length / alg_temp for Dream/LLaDA, REFERENCE 16.18).
    """

    eval_dataset: str = "MATH500"
    data_type: DataType = "math"
    tensor_parallel_size: int = bounded(1, 1)
    max_active: int = bounded(16, 1)
    num_response_per_task: int = bounded(3, 1)
    temperature: float = bounded(1.0, 0.0)
    max_token: int = bounded(2000, 1)
    block_size: int | list[int] | None = bounded(None, 1)  # reference rl_trado.yaml: 4
    denoising_steps_per_block: int = bounded(4, 1)
    top_p: float = bounded(1.0, 0.0, 1.0)
    top_k: int | list[int] | None = bounded(None, 0)  # reference rl_trado.yaml: [0, 1]
    remasking_strategy: Remasking | list[Remasking] | None = None  # rl_trado.yaml: [dynamic, static]
    dynamic_threshold: float = bounded(0.9, 0.0, 1.0)
    start_with_think: bool | None = None  # null = rollout's (what the reference effectively does)
    stop_token_list: list[str] | None = None
    eb_threshold: float | None = bounded(None, 0.0)
    steps: int | None = bounded(None, 1)
    max_gen_length: int | None = bounded(None, 1)
    further_horizon: int | None = bounded(None, 0)
    use_cache: bool | None = None
    cache: CacheMode | None = None
    target: Target | None = None
    alg_temp: float | None = bounded(None, 0.0)
    pad_target_penalty: float | None = bounded(None, 0.0)
    batch_size: int | None = bounded(None, 1)


@dataclass
class WandbConfig:
    """Optional Weights & Biases logging (metrics always go to JSON lines)."""

    enabled: bool = False
    entity: str | None = None
    resume: str = "auto"


@dataclass
class SystemConfig:
    """Multi-node environment (REFERENCE 12): shared directory and environment of every node."""

    base_dir: str | None = None  # working directory shared by all nodes
    env_name: str | None = None  # conda environment activated on every node
    envs_dir: str | None = None
    HTTP_PROXY: str | None = None
    HF_HOME: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for every node


# --------------------------------------------------------------------------------------------- job kinds


@dataclass
class RLConfig:
    """Schema of rl.py / multinode_rl.py configs (REFERENCE 14.1, 14.2, 14.5, 14.6)."""

    experiment: RLExperimentConfig = field(default_factory=RLExperimentConfig)
    model: RLModelConfig = field(default_factory=RLModelConfig)
    dataset: RLDatasetConfig = field(default_factory=RLDatasetConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    execute: ExecuteConfig = field(default_factory=ExecuteConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    training: RLTrainingConfig = field(default_factory=RLTrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    system: SystemConfig = field(default_factory=SystemConfig)


@dataclass
class EvalConfig:
    """Schema of eval.py / multinode_eval.py configs (REFERENCE 14.4, nested model form)."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: EvalDatasetConfig = field(default_factory=EvalDatasetConfig)
    rollout: EvalRolloutConfig = field(default_factory=EvalRolloutConfig)
    execute: ExecuteConfig = field(default_factory=ExecuteConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    system: SystemConfig = field(default_factory=SystemConfig)


@dataclass
class SFTConfig:
    """Schema of train/sft_*.py configs (REFERENCE 14.3); the accelerate config is a launch argument."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: TrainModelConfig = field(default_factory=TrainModelConfig)
    dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    training: SFTTrainingConfig = field(default_factory=SFTTrainingConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(params=OptimizerParams(learning_rate=1e-5)))
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    system: SystemConfig = field(default_factory=SystemConfig)


SCHEMAS: dict[str, type] = {"rl": RLConfig, "eval": EvalConfig, "sft": SFTConfig}

# Reference keys we deliberately do not implement: a clear message instead of "unknown key".
_UNSUPPORTED = {
    "model.process_reward_model": "the process-reward (RLHF) pipeline of the reference is not implemented",
    "rollout.reward_model": "the process-reward (RLHF) pipeline of the reference is not implemented",
}
_VALUE_LR_DEFAULT = 5e-6
_USAGE = "usage: <script> config=path/to/job.yaml [key.sub=value ...]"


# ------------------------------------------------------------------------------------------------ errors


class ConfigError(ValueError):
    """A user-facing configuration error; the message is one line naming the key and the file."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None):
        super().__init__(" ".join(message.splitlines()))
        self.key = key
        self.source = source


class _Mismatch(Exception):
    """A value does not fit a type; `specific` when the value had the right shape (better to report)."""

    def __init__(self, detail: str, specific: bool = False):
        super().__init__(detail)
        self.detail = detail
        self.specific = specific


# ------------------------------------------------------------------------------------------------ schema


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """Field name -> (resolved type, metadata) of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(cls)}


@functools.cache
def _all_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of a schema, sections included."""
    keys: list[str] = []
    for name, (tp, _) in _fields(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, f"{prefix}{name}."))
    return tuple(keys)


def _closest_key(key: str, root: type) -> str:
    """The valid key most similar to `key`: a sibling, else the same name elsewhere, else the best overall."""
    parent, _, leaf = key.rpartition(".")
    keys = _all_keys(root)
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if match:
        return siblings[match[0]]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    return difflib.get_close_matches(key, keys, n=1, cutoff=0.0)[0]


def _describe(tp: Any) -> str:
    """Human name of a schema type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of {" + ", ".join(map(str, args)) + "}"
    if origin is list:
        return "a list of " + _describe(args[0]).removeprefix("an ").removeprefix("a ")
    if origin is dict:
        return f"a mapping of {_describe(args[1])}"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


_TYPE_NAMES = {int: "an int", float: "a number", str: "a string", bool: "a bool", type(None): "null"}


def _accepts_mapping(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_mapping(a) for a in typing.get_args(tp))
    return tp is Any or origin is dict


_BOOL_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


def _coerce_literal(value: Any, allowed: tuple[Any, ...]) -> Any:
    if isinstance(value, bool):  # YAML reads `no` / `off` as false
        value = next((w for w in _BOOL_WORDS[value] if w in allowed), value)
    if value in allowed and not isinstance(value, bool):
        return value
    detail = "must be one of {" + ", ".join(map(str, allowed)) + f"}}, got {value!r}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1, cutoff=0.5)
        detail += f" (closest: {close[0]!r})" if close else ""
    return _raise(detail, specific=isinstance(value, str))


def _raise(detail: str, specific: bool = False) -> Any:
    raise _Mismatch(detail, specific)


def _coerce_union(value: Any, args: tuple[Any, ...], tp: Any) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arm)
        except _Mismatch as err:
            errors.append(err)
    specific = [e for e in errors if e.specific]
    if specific:
        raise specific[0]
    return _raise(f"expects {_describe(tp)}, got {value!r}")


def _coerce_scalar(value: Any, tp: Any) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and number and isinstance(value, int):
        return value
    if tp is float and number:
        return float(value)
    if tp is str and (isinstance(value, str) or number):
        return str(value)
    return _raise(f"expects {_describe(tp)}, got {value!r} ({type(value).__name__})")


def _coerce(value: Any, tp: Any) -> Any:
    """Check `value` against schema type `tp`; return it converted (int -> float, number -> str)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, tp)
    if origin is Literal:
        return _coerce_literal(value, args)
    if origin is list:
        if not isinstance(value, list):
            return _raise(f"expects {_describe(tp)}, got {value!r}")
        try:
            return [_coerce(v, args[0]) for v in value]
        except _Mismatch as err:
            raise _Mismatch(f"list element {err.detail}", specific=True) from None
    if origin is dict:
        if not isinstance(value, dict):
            return _raise(f"expects {_describe(tp)}, got {value!r}")
        return {str(k): _coerce(v, args[1]) for k, v in value.items()}
    return _coerce_scalar(value, tp)


def _check_bounds(value: Any, meta: Any, key: str, src: str) -> None:
    lo, hi = meta.get("lo"), meta.get("hi")
    for v in value if isinstance(value, list) else [value]:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
            raise ConfigError(f"{src}: key '{key}' must be {bound}, got {v!r}", key, src)


# ------------------------------------------------------------------------------------- reading sources


def _split_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Separate ``config=path`` from the ``key=value`` overrides."""
    path: str | None = None
    overrides: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"argument {arg!r} is not of the form key=value ({_USAGE})", key=arg)
        if key.strip() != "config":
            overrides.append(arg)
        elif path is not None:
            raise ConfigError(f"config= given twice ({path!r} and {value!r})", key="config")
        else:
            path = value.strip()
    if not path:
        raise ConfigError(f"missing 'config=<file.yaml>' argument ({_USAGE})", key="config")
    return path, overrides


def _load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping, without resolving interpolations."""
    if not Path(path).is_file():
        raise ConfigError(f"config={path}: file not found (cwd {os.getcwd()})", key="config", source=path)
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}", source=path) from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {str(err).splitlines()[0]}", source=path) from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections", source=path)
    return typing.cast(dict, OmegaConf.to_container(raw, resolve=False))


def _parse_override(item: str, path: str) -> dict[str, Any]:
    """One ``a.b=c`` override as a nested dict (value parsed as a YAML scalar)."""
    key = item.partition("=")[0].strip()
    src = f"{path} (override {item!r})"
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{src}: malformed key {key!r}", key, src)
    try:
        tree = OmegaConf.from_dotlist([item])
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{src}: cannot parse the value: {str(err).splitlines()[0]}", key, src) from None
    return typing.cast(dict, OmegaConf.to_container(tree, resolve=False))


def _normalise_reference_form(tree: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the reference eval form ``model: <path>`` + ``model_base: <name>`` to the nested form."""
    if isinstance(tree.get("model"), str):
        tree["model"] = {"pretrained_model": tree["model"]}
    if "model_base" in tree and (tree.get("model") is None or isinstance(tree.get("model"), dict)):
        tree["model"] = dict(tree.get("model") or {}, model_base=tree.pop("model_base"))
    return tree


def _check_tree(tree: dict[str, Any], cls: type, root: type, src: str, prefix: str = "") -> None:
    """Reject unknown keys and section/scalar shape errors in one source; empty sections become {}."""
    fields = _fields(cls)
    for name in list(tree):
        key, value = f"{prefix}{name}", tree[name]
        if str(name) not in fields:
            _unknown_key(key, root, src)
        tp = fields[str(name)][0]
        if dataclasses.is_dataclass(tp):
            if value is None:
                tree[name] = {}
            elif not isinstance(value, dict):
                raise ConfigError(f"{src}: key '{key}' is a section (a mapping), got {value!r}", key, src)
            else:
                _check_tree(value, tp, root, src, key + ".")
        elif isinstance(value, dict) and not _accepts_mapping(tp):
            raise ConfigError(f"{src}: key '{key}' expects {_describe(tp)}, got a mapping", key, src)


def _unknown_key(key: str, root: type, src: str) -> None:
    for bad, reason in _UNSUPPORTED.items():
        if key == bad or key.startswith(bad + "."):
            raise ConfigError(f"{src}: unsupported key '{key}': {reason}", key, src)
    closest = _closest_key(key, root)
    raise ConfigError(f"{src}: unknown key '{key}' (closest valid key: '{closest}')", key, src)


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, value in tree.items():
        key = f"{prefix}{name}"
        yield key
        if isinstance(value, dict):
            yield from _leaf_keys(value, key + ".")


# ------------------------------------------------------------------------------------------ validation


def _validate(cfg: DictConfig, cls: type, sources: dict[str, str], path: str, prefix: str = "") -> None:
    """Check presence, type and range of every schema key; coerce non-interpolated values in place."""
    for name, (tp, meta) in _fields(cls).items():
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            _validate(cfg[name], tp, sources, path, key + ".")
            continue
        src = sources.get(key, path)
        if OmegaConf.is_missing(cfg, name):
            raise ConfigError(f"{src}: missing required key '{key}' (set it in the file or pass {key}=...)",
                              key, src)
        value = _resolved(cfg, name, key, src)
        try:
            coerced = _coerce(value, tp)
        except _Mismatch as err:
            raise ConfigError(f"{src}: key '{key}' {err.detail}", key, src) from None
        _check_bounds(coerced, meta, key, src)
        if not OmegaConf.is_interpolation(cfg, name):
            cfg[name] = coerced


def _resolved(cfg: DictConfig, name: str, key: str, src: str) -> Any:
    """The value of `cfg[name]` with interpolations resolved, as plain Python."""
    try:
        value = cfg[name]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as err:
        raw = OmegaConf.to_container(cfg, resolve=False).get(name)  # type: ignore[union-attr]
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{src}: key '{key}': cannot resolve {raw!r}: {reason}", key, src) from None
    return value


def _is_null(section: DictConfig, name: str) -> bool:
    """True when `name` holds a literal null (not an interpolation, not ``???``)."""
    if OmegaConf.is_interpolation(section, name) or OmegaConf.is_missing(section, name):
        return False
    return section[name] is None


def _link_placeholders(cfg: DictConfig, kind: str) -> None:
    """Point "null = <other key>" placeholders at that key by interpolation (before validation)."""
    if "rollout" in cfg:
        for name, target in (("max_gen_length", "max_token"), ("steps", "max_gen_length")):
            if _is_null(cfg.rollout, name):
                cfg.rollout[name] = "${rollout." + target + "}"
    if kind != "rl":
        return
    ev, params = cfg.evaluation, cfg.optimizer.params
    names = [n for n in _fields(EvaluationConfig) if n in cfg.rollout and n not in ("use_cache", "cache")]
    if _is_null(ev, "use_cache") and _is_null(ev, "cache"):
        names += ["use_cache", "cache"]
    for name in names:
        if _is_null(ev, name):
            ev[name] = "${rollout." + name + "}"
    if _is_null(params, "policy_learning_rate"):
        params.policy_learning_rate = "${optimizer.params.learning_rate}"
    if _is_null(params, "value_learning_rate"):
        params.value_learning_rate = _VALUE_LR_DEFAULT


def _reconcile_cache(section: DictConfig, key: str, path: str) -> None:
    """Make use_cache / cache agree: cache null follows use_cache; use_cache null follows cache."""
    use, cache = section.use_cache, section.cache
    if use is None:
        use = cache != "none"
    if cache is None:
        cache = "prefix" if use else "none"
    elif not use and cache != "none":
        raise ConfigError(f"{path}: key '{key}.cache' is {cache!r} but {key}.use_cache is false "
                          f"(set {key}.cache=none or {key}.use_cache=true)", f"{key}.cache", path)
    for name, value in (("use_cache", cache != "none"), ("cache", cache)):
        if not OmegaConf.is_interpolation(section, name):
            section[name] = value


_PAIRED = ("remasking_strategy", "top_k", "block_size")  # evaluation keys that may be paired lists


def _check_pairs(ev: DictConfig, path: str) -> None:
    lengths = {k: len(ev[k]) for k in _PAIRED if isinstance(ev[k], ListConfig)}
    if len(set(lengths.values())) > 1:
        desc = ", ".join(f"evaluation.{k} has {n}" for k, n in lengths.items())
        raise ConfigError(f"{path}: paired evaluation lists differ in length ({desc})", "evaluation", path)
    if 0 in lengths.values():
        raise ConfigError(f"{path}: evaluation lists must not be empty", "evaluation", path)


def _check_ranges(cfg: DictConfig, path: str) -> None:
    if "training" in cfg and cfg.training.lower_p > cfg.training.upper_p:
        raise ConfigError(f"{path}: key 'training.lower_p' ({cfg.training.lower_p}) exceeds training.upper_p "
                          f"({cfg.training.upper_p})", "training.lower_p", path)
    if "reward" in cfg and cfg.reward.acc_low > cfg.reward.acc_high:
        raise ConfigError(f"{path}: key 'reward.acc_low' ({cfg.reward.acc_low}) exceeds reward.acc_high "
                          f"({cfg.reward.acc_high})", "reward.acc_low", path)


def _finalise(cfg: DictConfig, kind: str, path: str) -> None:
    """Cross-key checks and normalisation after validation."""
    if "rollout" in cfg:
        _reconcile_cache(cfg.rollout, "rollout", path)
    if kind == "rl":
        _reconcile_cache(cfg.evaluation, "evaluation", path)
        _check_pairs(cfg.evaluation, path)
    _check_ranges(cfg, path)


# ------------------------------------------------------------------------------------------ public API


def load_config(argv: Sequence[str], kind: str) -> DictConfig:
    """Load ``config=<file>`` plus ``key=value`` overrides and validate them for job `kind` (rl | eval | sft).

    Returns a struct-mode ``DictConfig`` (interpolations kept); raises :class:`ConfigError` on any user error.
    """
    if kind not in SCHEMAS:
        raise ConfigError(f"unknown job kind {kind!r} (expected one of {sorted(SCHEMAS)})", key="kind")
    schema = SCHEMAS[kind]
    path, overrides = _split_argv(argv)
    layers = [_normalise_reference_form(_load_yaml(path))]
    _check_tree(layers[0], schema, schema, path)
    sources = dict.fromkeys(_leaf_keys(layers[0]), path)
    for item in overrides:
        tree = _normalise_reference_form(_parse_override(item, path))
        src = f"{path} (override {item!r})"
        _check_tree(tree, schema, schema, src)
        sources.update(dict.fromkeys(_leaf_keys(tree), src))
        layers.append(tree)
    cfg = typing.cast(DictConfig, OmegaConf.merge(dataclasses.asdict(schema()), *layers))
    if OmegaConf.is_missing(cfg.experiment, "project"):
        cfg.experiment.project = Path(path).stem
    _link_placeholders(cfg, kind)
    _validate(cfg, schema, sources, path)
    _finalise(cfg, kind, path)
    OmegaConf.set_struct(cfg, True)
    return cfg


def load_config_or_exit(kind: str, argv: Sequence[str] | None = None) -> DictConfig:
    """:func:`load_config` for entry points: print the one-line error to stderr and exit 2 on failure."""
    try:
        return load_config(sys.argv[1:] if argv is None else argv, kind)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def cfg_to_dict(cfg: DictConfig, resolve: bool = True) -> dict[str, Any]:
    """A plain nested dict of `cfg` (interpolations resolved unless `resolve` is false)."""
    return typing.cast(dict, OmegaConf.to_container(cfg, resolve=resolve))


def dump_config(cfg: DictConfig, path: str | os.PathLike[str], resolve: bool = True) -> Path:
    """Write `cfg` as YAML to `path` atomically (temp file + rename); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.create(cfg_to_dict(cfg, resolve)))
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def eval_settings(evaluation: DictConfig) -> list[dict[str, Any]]:
    """Expand the paired list keys (remasking_strategy, top_k, block_size) into one flat dict per eval run."""
    base = typing.cast(dict, OmegaConf.to_container(evaluation, resolve=True))
    paired = {k: base[k] for k in _PAIRED if isinstance(base[k], list)}
    n = len(next(iter(paired.values()))) if paired else 1
    return [base | {k: v[i] for k, v in paired.items()} for i in range(n)]


def infer_kind(path: str | os.PathLike[str]) -> str:
    """Job kind from a file name: rl_* / multinode_rl_* -> rl, *_eval / eval_* -> eval, sft_* -> sft."""
    stem = Path(path).stem
    if stem.startswith(("rl_", "multinode_rl_")):
        return "rl"
    if stem.endswith("_eval") or stem.startswith(("eval_", "multinode_eval_")):
        return "eval"
    if stem.startswith("sft_"):
        return "sft"
    raise ConfigError(f"{path}: cannot infer the kind from the name (rl_*, *_eval, sft_*)", source=str(path))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m core.config FILE...``: validate config files (kind inferred from each name)."""
    status = 0
    for path in sys.argv[1:] if argv is None else argv:
        try:
            load_config([f"config={path}"], infer_kind(path))
            print(f"ok     {path}")
        except ConfigError as err:
            print(f"error  {err}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
