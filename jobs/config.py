"""Job configs: the section tree of each job kind, and the entry points' loading functions.

Usage (entry points)::

    cfg = load_config(sys.argv[1:], "eval")         # raises ConfigError (one line) on any user mistake
    cfg = load_config_or_exit("eval")                # same, but prints the error and exits with status 2

Kinds: ``"rl"`` (rl.py -> :class:`RLConfig`), ``"eval"`` (eval.py -> :class:`EvalConfig`), ``"sft"``
(train/sft_*.py -> :class:`SFTConfig`), ``"serve"`` (serve.py -> :class:`ServeConfig`).
A section is the runtime settings class of the code that consumes it,
declared once: ``rollout`` is the sampler's ``SamplingParams`` (sample/params.py) plus the job's own keys,
``training`` / ``optimizer`` / ``lr_scheduler`` are the trainer's classes (train/settings.py), ``execute`` is the
sandbox's ``SandboxConfig`` (reward/sandbox.py). The job-level sections (experiment, model, dataset, reward,
evaluation, wandb, system) live here. Reading, renamed reference keys and errors: core/loader.py.
"""

from __future__ import annotations

import difflib
import io
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.allocator import keep_freed_memory, user_chose_malloc_settings
from core.loader import ConfigError, load, note, required
from core.schema import SettingError, Settings, bounded, check_fields, config_fields, to_dict
from data.builtin import BUILTIN, builtin_kind
from models.kinds import ATTENTION_OF
from models.lora import LoraSettings
from reward.process import ProcessRewardConfig
from reward.sandbox import SandboxConfig
from sample.params import SamplingParams, Strategy
from train.algorithms import (
    CHECKED_KEYS,
    advantage_refusal,
    default_advantage,
    family_refusal,
    ignored_setting_refusal,
    rl_refusal,
    unread_view_notes,
    value_model_refusal,
)
from train.settings import (
    SFT_METHODS,
    LRSchedulerConfig,
    OptimizerConfig,
    RLOptimizerConfig,
    RLTrainingConfig,
    SFTTrainingConfig,
)

__all__ = ["ConfigError", "load_config", "load_config_or_exit", "job_kind", "SCHEMAS",
           "RLConfig", "EvalConfig", "SFTConfig", "ServeConfig", "DEMO_MODEL_DIRS", "is_demo_model_dir"]

ModelBase = Literal[tuple(ATTENTION_OF)]  # every model_base of the family table (models/kinds.py: torch-free)
DataType = Literal["math", "code", "option"]
# The only paths where a demo config may build its starting model (model.init_tiny_if_missing): tiny random models,
# and the demo SFT's output (the RL demo's starting point).
DEMO_MODEL_DIRS = ("runs/demo/tiny_sdar", "runs/demo/tiny_dream", "runs/demo/tiny_llada",
                   "runs/sft_demo/ckpt/optimized", "runs/sft_countdown/ckpt/optimized")


def is_demo_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is one of DEMO_MODEL_DIRS (as a config writes it, a trailing slash allowed)."""
    return Path(path).as_posix().rstrip("/") in DEMO_MODEL_DIRS


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class ExperimentConfig(Settings):
    """Job identity and output location."""

    PATH_FIELDS = ("output_dir",)

    project: str = required()  # default: the config file's stem; outputs go to {output_dir}/{project}/
    output_dir: str = "runs"
    seed: int = 10086  # task selection and sampling seed (the reference leaves rollouts unseeded)
    num_node: int = bounded(1, 1)  # nodes of the launch; multinode_*.py checks it against the environment
    overwrite: bool = False  # reuse a non-empty output directory (its previous results are replaced)
    # accelerate_configs/{deepspeed_file}.yaml: the script relaunches itself under accelerate with it (multinode_*.py
    # use it on every node); null = one process (multinode_*.py: ZeRO-3 for num_node nodes)
    deepspeed_file: str | None = None

    def validate(self) -> None:
        super().validate()
        parts = self.project.replace("\\", "/").split("/")
        if self.project.startswith(("/", "~")) or any(part in ("", ".", "..") for part in parts):
            raise SettingError("project", f"project {self.project!r} must name a folder inside output_dir "
                               "(no empty, '.' or '..' part, not absolute): an overwrite would empty what it names")


@dataclass
class RLExperimentConfig(ExperimentConfig):
    """The RL loop: steps, checkpoints, resume, launcher."""

    train_value_every: int = bounded(1, 1)  # value model: train it every N steps (advantages use it every step)
    start_from_scratch: bool = True  # false = resume from the run directory's last complete step
    total_step: int = bounded(80, 1)  # RL steps in the whole run
    save_every: int = bounded(10, 1)  # checkpoint every N steps (and at the end)
    eval_every: int = bounded(10, 0)  # 0 = no in-loop evaluation
    keep_checkpoints: int = bounded(0, 0)  # keep the N newest step checkpoints (older steps keep their logs); 0 = all
    max_idle_steps: int = bounded(5, 0)  # stop after N steps in a row with no optimizer update; 0 = never stop


# folders of ckpt/ the SFT job keeps its resumable checkpoint in (jobs/sft.py): no final model may take their name
RESERVED_CKPT_NAMES = ("last", "last.partial", "last.old")


@dataclass
class ModelConfig(Settings):
    """Which checkpoint to load and how."""

    PATH_FIELDS = ("pretrained_model", "tokenizer")

    pretrained_model: str = required()  # a local checkpoint folder (nothing is downloaded at run time)
    model_base: ModelBase = required()  # selects the adapter in models/
    attn_backend: Literal["sdpa", "flex", "flash"] = "sdpa"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    tokenizer: str | None = None  # null = the tokenizer saved with pretrained_model
    # CPU demos only: when pretrained_model is one of the demo paths (DEMO_MODEL_DIRS) and does not exist, build
    # a tiny model of model_base there (demo tokenizer, nothing downloaded). Any other path must exist.
    init_tiny_if_missing: bool = False


@dataclass
class EvalModelConfig(ModelConfig):
    PATH_FIELDS = (*ModelConfig.PATH_FIELDS, "adapter")
    adapter: str | None = None  # a LoRA adapter folder (peft format) merged into pretrained_model at load


def _check_ckpt_name(key: str, name: str) -> None:
    """A rolling checkpoint's folder is a plain name under ckpt/ that none of the run's own folders use."""
    if name in RESERVED_CKPT_NAMES or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise SettingError(key, f"{key} {name!r} must be a plain folder name under ckpt/, not one of "
                           f"{', '.join(RESERVED_CKPT_NAMES)} (the run's own checkpoints)")


@dataclass
class TrainModelConfig(ModelConfig):
    optimized_name: str = "optimized"  # rolling checkpoint {output_dir}/{project}/ckpt/{optimized_name}

    def validate(self) -> None:
        super().validate()
        _check_ckpt_name("optimized_name", self.optimized_name)


@dataclass
class RLModelConfig(TrainModelConfig):
    PATH_FIELDS = (*ModelConfig.PATH_FIELDS, "value_base_model")
    # A policy checkpoint to initialise a value model from (zero head); setting it enables value-guided TraceRL.
    value_base_model: str | None = None
    optimized_value_name: str = "optimized_value"  # {output_dir}/{project}/ckpt/{optimized_value_name}
    # A judge LLM (a local folder, or the model name at process_reward.base_url); setting it enables the process
    # reward (math; needs value_base_model: the value model turns per-token rewards into advantages)
    process_reward_model: str | None = None

    def validate(self) -> None:
        super().validate()
        _check_ckpt_name("optimized_value_name", self.optimized_value_name)
        if self.optimized_value_name == self.optimized_name:
            raise SettingError("optimized_value_name", "optimized_value_name and optimized_name name the same "
                               f"folder ({self.optimized_name!r}): the policy and the value model need one each")


@dataclass
class EvalDatasetConfig(Settings):
    PATH_FIELDS = ("eval_dataset",)

    eval_dataset: str = required()  # data/{name}.json, a .json/.jsonl path, or a built-in (data/builtin.py)
    data_type: DataType = "math"
    builtin_size: int | None = bounded(None, 1)  # tasks drawn from a built-in dataset (null: 64)


@dataclass
class RLDatasetConfig(Settings):
    PATH_FIELDS = ("train_dataset",)

    train_dataset: str = required()
    data_type: DataType = "math"
    builtin_size: int | None = bounded(None, 1)  # tasks drawn from a built-in dataset (null: 64)


def model_positions(pretrained_model: str) -> int | None:
    """The checkpoint's position limit read from its config.json (cheap: no model is loaded), or None."""
    import json

    try:
        cfg = json.loads((Path(pretrained_model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    limit = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length")
    return int(limit) if isinstance(limit, int) else None


def check_block_sizes(model: Any, sections: dict[str, Any]) -> None:
    """A sampling block must fit the checkpoint's positions (checked at load when the checkpoint exists)."""
    limit = model_positions(model.pretrained_model)
    for key, section in sections.items():
        for params in section.runs() if hasattr(section, "runs") else [section]:
            if limit is not None and params.block_size is not None and params.block_size > limit:
                raise SettingError(f"{key}.block_size", f"block_size ({params.block_size}) exceeds the "
                                                        f"{limit} positions of {model.pretrained_model}")


def check_builtin_size(dataset: str, builtin_size: int | None, key: str) -> None:
    """``builtin_size`` (``key``) is for built-in datasets only: a file's rows are all used."""
    if builtin_size is not None and not dataset.startswith("builtin:"):
        raise SettingError(key, f"builtin_size applies to built-in datasets only, not to {dataset!r} (a file's rows "
                                "are all used): remove it or set it to null")


def check_builtin_type(dataset: str, data_type: str, key: str, name_key: str, builtin_size: int | None = None,
                       size_key: str = "") -> None:
    """A ``builtin:`` dataset must exist (``name_key``, the closest name suggested) and match the data type; a
    ``builtin_size`` (``size_key``) is for built-in datasets only (a file's rows are all used)."""
    if dataset.startswith("builtin:") and dataset not in BUILTIN:
        close = difflib.get_close_matches(dataset, list(BUILTIN), n=1, cutoff=0.5)
        hint = f"closest: {close[0]!r}" if close else f"built-in: {', '.join(BUILTIN)}"
        raise SettingError(name_key, f"unknown built-in dataset {dataset!r} ({hint})")
    check_builtin_size(dataset, builtin_size, size_key)
    kind = builtin_kind(dataset)
    if kind is not None and kind != data_type:
        raise SettingError(key, f"dataset {dataset!r} is a {kind} task but data_type is {data_type!r}")


@dataclass
class JobRollout(SamplingParams):
    """Sampler settings plus what the job does around them."""

    num_response_per_task: int = bounded(1, 1)  # responses per task (the RL group size)
    start_with_think: bool = False  # prompt ends with "<think>\n"


@dataclass
class RLRollout(JobRollout):
    num_task_per_step: int = bounded(64, 1)  # tasks drawn per RL step
    num_response_per_task: int = bounded(8, 1)  # the group size (>= 2, see validate)
    # DAPO's dynamic sampling (arXiv 2503.14476): while fewer than num_task_per_step groups survive the reward
    # filters, draw that many new tasks again, up to this many extra rounds per step (0 = off, the reference's)
    dynamic_sampling_rounds: int = bounded(0, 0)

    def validate(self) -> None:
        super().validate()
        if self.num_response_per_task < 2:  # rewards are z-scored within a task's group of responses
            raise SettingError("num_response_per_task", "num_response_per_task must be >= 2 for RL: advantages are "
                               "normalised within each task's group, so a group of one has advantage 0 and nothing "
                               "trains")


_PAIRED = ("remasking_strategy", "top_k", "block_size")


@dataclass
class EvalRollout(JobRollout):
    """Evaluation sampling: ``remasking_strategy``, ``top_k`` and ``block_size`` may be lists, paired element-wise
    (scalars broadcast); one evaluation per pair (:meth:`runs`)."""

    remasking_strategy: Strategy | list[Strategy] = "low_confidence_static"
    top_k: int | list[int] = bounded(0, 0)
    block_size: int | list[int] | None = bounded(None, 1)
    output_unmasking_history: bool = True  # write the trace-viewer page (trajectories always keep step maps)
    pass_k: list[int] = field(default_factory=list)  # also report pass@k (k <= num_response_per_task)

    def validate(self) -> None:
        check_fields(self)
        lengths = {k: len(v) for k in _PAIRED if isinstance(v := object.__getattribute__(self, k), list)}
        if len(set(lengths.values())) > 1:
            desc = ", ".join(f"{k} has {n}" for k, n in lengths.items())
            raise SettingError(next(iter(lengths)), f"paired lists differ in length ({desc})")
        if 0 in lengths.values():
            raise SettingError(next(iter(lengths)), "paired lists must not be empty")
        for k in self.pass_k:
            if not 1 <= k <= self.num_response_per_task:
                raise SettingError("pass_k", f"pass_k entry {k} must be in [1, num_response_per_task "
                                             f"({self.num_response_per_task})]")
        self.runs()  # every pair must be a valid sampler setting

    def runs(self) -> list[JobRollout]:
        """One scalar sampler setting per (strategy, top_k, block size) pair."""
        base = {name: object.__getattribute__(self, name) for name in config_fields(JobRollout)}
        paired = {k: base[k] for k in _PAIRED if isinstance(base[k], list)}
        n = len(next(iter(paired.values()))) if paired else 1
        return [JobRollout(**(base | {k: v[i] for k, v in paired.items()})) for i in range(n)]


@dataclass
class EvaluationConfig(EvalRollout):
    """In-loop evaluation of RL jobs; keys not set here follow ``rollout``."""

    PATH_FIELDS = ("eval_dataset",)
    eval_dataset: str = "builtin:arithmetic"
    data_type: DataType = "math"
    builtin_size: int | None = bounded(None, 1)  # built-in tasks drawn (null: 64), with seed experiment.seed + 1

    def validate(self) -> None:
        super().validate()
        check_builtin_type(self.eval_dataset, self.data_type, "eval_dataset", "eval_dataset", self.builtin_size,
                           "builtin_size")


@dataclass
class RewardConfig(Settings):
    """Reward shaping and group filtering of RL jobs."""

    truncation_margin: int = bounded(5, 0)  # length >= max_tokens - margin scores 0 (code too; the reference: math)
    acc_low: float = bounded(0.2, 0.0, 1.0)  # math groups with accuracy outside [acc_low, acc_high] are dropped
    acc_high: float = bounded(0.8, 0.0, 1.0)
    filter_all_equal: bool = True  # drop groups whose rewards are all equal (zero advantage)
    # how a group's rewards become advantages (reward/group.py ESTIMATORS): grpo = z-score (the reference's),
    # dr_grpo = minus the group mean, rloo = minus the mean of the other responses; null = the training method's own
    # (grpo for TraceRL, random masking and coupled)
    advantage: Literal["grpo", "dr_grpo", "rloo"] | None = None
    # DAPO's overlong shaping: responses longer than rollout.max_tokens - overlong_buffer lose up to
    # overlong_penalty reward, linearly (0 = off, the reference's)
    overlong_buffer: int = bounded(0, 0)
    overlong_penalty: float = bounded(1.0, 0.0)

    def validate(self) -> None:
        super().validate()
        if self.acc_low > self.acc_high:
            raise SettingError("acc_low", f"acc_low ({self.acc_low}) exceeds acc_high ({self.acc_high})")


@dataclass
class TensorboardConfig(Settings):
    """Optional TensorBoard event files with the step metrics (needs tensorboardX or tensorboard)."""

    PATH_FIELDS = ("log_dir",)
    enabled: bool = False
    log_dir: str | None = None  # default: {output_dir}/{project}/tensorboard


@dataclass
class WandbConfig(Settings):
    """Optional Weights & Biases logging (metrics always go to JSON lines)."""

    enabled: bool = False
    entity: str | None = None
    resume: Literal["allow", "must", "never", "auto"] = "auto"  # wandb.init's resume


@dataclass
class SystemConfig(Settings):
    """Process environment applied at start (cluster settings)."""

    PATH_FIELDS = ("base_dir", "HF_HOME")
    base_dir: str | None = None  # working directory (shared by all nodes); null = the current directory
    HTTP_PROXY: str | None = None
    HF_HOME: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables
    # glibc keeps freed buffers for reuse instead of returning them to the OS (faster CPU steps; the resident size
    # stays at its peak): core/allocator.py
    keep_freed_memory: bool = True

    def validate(self) -> None:
        if user_chose_malloc_settings({k: str(v) for k, v in self.env.items()}):
            note("system.env sets glibc's malloc thresholds (MALLOC_*_ or a glibc.malloc tunable): glibc reads them "
                 "when a process starts, so they reach the job's child processes only; set them where the job is "
                 "launched (or system.keep_freed_memory=false)")

    def resolve(self, path: str) -> Path:
        """``path`` as the job will read it once ``apply`` has moved into ``base_dir`` (before that, too)."""
        return Path(self.base_dir) / path if self.base_dir else Path(path)

    def apply(self) -> None:
        """Set the environment and working directory described here."""
        if self.keep_freed_memory:  # on the environment glibc read at this process's start, before system.env
            keep_freed_memory()
        extra = {"HTTP_PROXY": self.HTTP_PROXY, "HTTPS_PROXY": self.HTTP_PROXY, "HF_HOME": self.HF_HOME}
        for key, value in {**{k: v for k, v in extra.items() if v}, **self.env}.items():
            os.environ[key] = str(value)
        if self.base_dir:
            if not Path(self.base_dir).is_dir():
                raise ConfigError(f"key 'system.base_dir': {self.base_dir!r} is not a directory", "system.base_dir")
            os.chdir(self.base_dir)


# --------------------------------------------------------------------------------------------- job kinds


@dataclass
class EvalConfig(Settings):
    """eval.py."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    dataset: EvalDatasetConfig = field(default_factory=EvalDatasetConfig)
    rollout: EvalRollout = field(default_factory=lambda: EvalRollout(num_response_per_task=3))
    execute: SandboxConfig = field(default_factory=SandboxConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    def validate(self) -> None:
        super().validate()
        check_builtin_type(self.dataset.eval_dataset, self.dataset.data_type, "dataset.data_type",
                           "dataset.eval_dataset", self.dataset.builtin_size, "dataset.builtin_size")
        check_block_sizes(self.model, {"rollout": self.rollout})


@dataclass
class ServerConfig(Settings):
    """serve.py: where it listens and how much it accepts (sequences = prompts x n)."""

    host: str = "127.0.0.1"
    port: int = bounded(8000, 0, 65535)  # 0 = any free port (the address is printed at start)
    api_key: str | None = None  # when set, clients send "Authorization: Bearer <api_key>" (else 401)
    model_name: str | None = None  # the model id of /v1/models and of requests; null = the checkpoint folder's name
    max_batch: int = bounded(32, 1)  # sequences decoded together in one settings group (the engine's max_active)
    max_queue: int = bounded(256, 0)  # sequences allowed to wait beyond max_batch; a request past it gets 503
    max_prompt_tokens: int | None = bounded(None, 1)  # longer prompts get 400; null = what fits the model's positions


@dataclass
class ServeConfig(Settings):
    """serve.py: an OpenAI-compatible HTTP server; ``rollout`` holds the default sampling settings of requests."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)  # model.adapter: a LoRA adapter merged at load
    rollout: SamplingParams = field(default_factory=SamplingParams)
    server: ServerConfig = field(default_factory=ServerConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    def validate(self) -> None:
        super().validate()
        check_block_sizes(self.model, {"rollout": self.rollout})


@dataclass
class RLConfig(Settings):
    """rl.py."""

    experiment: RLExperimentConfig = field(default_factory=RLExperimentConfig)
    model: RLModelConfig = field(default_factory=RLModelConfig)
    dataset: RLDatasetConfig = field(default_factory=RLDatasetConfig)
    rollout: RLRollout = field(default_factory=RLRollout)
    execute: SandboxConfig = field(default_factory=SandboxConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    process_reward: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    training: RLTrainingConfig = field(default_factory=RLTrainingConfig)
    optimizer: RLOptimizerConfig = field(default_factory=RLOptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    system: SystemConfig = field(default_factory=SystemConfig)

    VALUE_MODEL_SETTINGS = ("optimizer.params.value_learning_rate", "experiment.train_value_every",
                            "model.optimized_value_name", "training.gam", "training.lam")

    def _value_model_setting(self) -> str | None:
        """The first value-model setting changed from its default (it would be ignored without a value model)."""
        def changed(key: str) -> bool:
            *path, name = key.split(".")
            owner = self
            for part in path:
                owner = object.__getattribute__(owner, part)
            return owner.changed(name)

        return next((key for key in self.VALUE_MODEL_SETTINGS if changed(key)), None)

    def validate(self) -> None:
        super().validate()
        check_builtin_type(self.dataset.train_dataset, self.dataset.data_type, "dataset.data_type",
                           "dataset.train_dataset", self.dataset.builtin_size, "dataset.builtin_size")
        check_block_sizes(self.model, {"rollout": self.rollout, "evaluation": self.evaluation})
        if self.reward.overlong_buffer > self.rollout.max_tokens:
            raise SettingError("reward.overlong_buffer", f"reward.overlong_buffer ({self.reward.overlong_buffer}) "
                               f"exceeds rollout.max_tokens ({self.rollout.max_tokens})")
        if rl_refusal(self.training.method):
            raise SettingError("training.method", rl_refusal(self.training.method))
        if family_refusal(self.training.method, self.model.model_base):
            raise SettingError("training.method", family_refusal(self.training.method, self.model.model_base))
        t = self.training
        if self.model.value_base_model and value_model_refusal(self.training.method):
            raise SettingError("training.method", value_model_refusal(self.training.method))
        refuse_ignored_settings(t, t.method)
        if self.reward.advantage is None:
            self.reward.advantage = default_advantage(self.training.method)
        if advantage_refusal(self.training.method, self.reward.advantage):
            raise SettingError("reward.advantage", advantage_refusal(self.training.method, self.reward.advantage))
        if self.model.process_reward_model:
            if not self.model.value_base_model:
                raise SettingError("model.process_reward_model", "the process reward needs the value model (set "
                                   "model.value_base_model): it turns per-token rewards into advantages")
            if self.dataset.data_type != "math":
                raise SettingError("model.process_reward_model", "the process reward grades math solutions; "
                                   f"dataset.data_type is {self.dataset.data_type!r}")
        if not self.model.value_base_model and (key := self._value_model_setting()):
            raise SettingError(key, "a value-model setting, and this run has no value model: set "
                               "model.value_base_model (TraceRL with a value model) or remove the key")


@dataclass
class SFTExperimentConfig(ExperimentConfig):
    start_from_scratch: bool = True  # false = resume from {output_dir}/{project}/ckpt/last


@dataclass
class SFTDatasetConfig(Settings):
    """SFT data: data/{name}.json|.jsonl, a path, a datasets folder, or builtin:arithmetic."""

    PATH_FIELDS = ("optimization_data",)
    optimization_data: str = required()
    builtin_size: int | None = bounded(None, 1)  # rows of a built-in dataset (null: 2000)
    builtin_difficulty: int | None = bounded(None, 1)  # data/tasks.py difficulty of builtin:arithmetic (null: 1)

    def validate(self) -> None:
        super().validate()
        check_builtin_size(self.optimization_data, self.builtin_size, "builtin_size")
        if self.builtin_difficulty is not None and self.optimization_data != "builtin:arithmetic":
            raise SettingError("builtin_difficulty", "builtin_difficulty applies to builtin:arithmetic only, not to "
                                                     f"{self.optimization_data!r}: remove it or set it to null")


@dataclass
class SFTConfig(Settings):
    """train/sft_*.py."""

    experiment: SFTExperimentConfig = field(default_factory=SFTExperimentConfig)
    model: TrainModelConfig = field(default_factory=TrainModelConfig)
    dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    training: SFTTrainingConfig = field(default_factory=SFTTrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    system: SystemConfig = field(default_factory=SystemConfig)

    def validate(self) -> None:
        super().validate()
        t, attention = self.training, ATTENTION_OF[self.model.model_base]
        semi_ar = t.view_method(attention) == "semi_ar"
        if attention == "full" and semi_ar and t.block_size is None:
            raise SettingError("training.block_size", f"semi-ar SFT of {self.model.model_base} (full attention) "
                               "trains one response block at a time and needs training.block_size (e.g. 32; the "
                               "reference's Dream / LLaDA recipes), or another training.method")
        if attention == "full" and not semi_ar and t.block_size is not None:
            raise SettingError("training.block_size", f"training.block_size {t.block_size} has no effect on "
                               f"{self.model.model_base} (full attention) with training.method {t.method!r}: only "
                               "semi-ar trains it block by block (set training.block_size=null)")
        if t.post_num:
            raise SettingError("training.post_num", "training.post_num trains pad tokens after an RL rollout's stop "
                               "token; SFT responses end at their turn end and have none: remove it")
        sft_readers = {}  # the SFT methods, each view under its first spelling
        for spelling, view in SFT_METHODS.items():
            sft_readers.setdefault(view, spelling)
        refuse_ignored_settings(t, t.view_method(attention), t.method,
                                {spelling: view for view, spelling in sft_readers.items()})


def refuse_ignored_settings(t: Any, method: str, shown: str = "", readers: dict[str, str] | None = None) -> None:
    """Refuse a ``training`` loss key set away from its default that ``method``'s loss never reads; note the view
    keys its rows never read (naming the ``readers`` that do, unread_view_notes)."""
    changed = {k: object.__getattribute__(t, k) for k in CHECKED_KEYS if k in t.__dataclass_fields__ and t.changed(k)}
    key, refusal = ignored_setting_refusal(method, changed)
    if refusal:
        raise SettingError(f"training.{key}", refusal)
    for line in unread_view_notes(method, changed, shown, readers):
        note(line)  # printed with the config file's name


SCHEMAS: dict[str, type] = {"rl": RLConfig, "eval": EvalConfig, "sft": SFTConfig, "serve": ServeConfig}
FOLLOWS = {"rl": {"evaluation": "rollout"}}

UNSUPPORTED: dict[str, dict[str, str]] = {
    "rl": {},
    "eval": {},
    "sft": {},
    "serve": {},
}


# Reference keys that configure something this framework does differently: accepted so the reference's files
# load, with a printed notice saying why they have no effect.
_TENSOR_PARALLEL = (1, "tensor parallelism is not supported (one model copy per process); use data-parallel "
                       "processes")
_COMMON_NO_EFFECT: dict[str, Any] = {
    "experiment.node_index": "each node's rank comes from its environment (see multinode_rl.py)",
    "rollout.tensor_parallel_size": _TENSOR_PARALLEL,
    "experiment.current_epoch": (1, "a run resumes from its directory's last complete step (set "
                                    "experiment.start_from_scratch=false)"),
    "evaluation.tensor_parallel_size": _TENSOR_PARALLEL,
    "optimizer.params.scale_lr": "the reference never reads it",
    "lr_scheduler.params.learning_rate": "the learning rate is optimizer.params.learning_rate",
    "system.env_name": "activate the environment before launching (no conda activation per node)",
    "system.envs_dir": "activate the environment before launching (no conda activation per node)",
}
NO_EFFECT: dict[str, dict[str, Any]] = {
    "rl": {**_COMMON_NO_EFFECT,
           "experiment.function": "rl.py runs every stage in one process",
           "dataset.optimization_data": "rollouts stay in memory and are written to the step directory",
           "training.block_size": "training views use the block size each trajectory was sampled with "
                                  "(rollout.block_size)"},
    "eval": dict(_COMMON_NO_EFFECT),
    "sft": dict(_COMMON_NO_EFFECT),
    "serve": dict(_COMMON_NO_EFFECT),
}


# ------------------------------------------------------------------------------------------ public API


def load_config(argv: Sequence[str], kind: str, stream: Any = None) -> Any:
    """Load ``config=<file>`` plus ``key=value`` overrides for job `kind` (rl | eval | sft | serve).

    Returns the job's section tree (e.g. :class:`EvalConfig`); raises :class:`ConfigError` on any user error.
    """
    if kind not in SCHEMAS:
        raise ConfigError(f"unknown job kind {kind!r} (expected one of {sorted(SCHEMAS)})", key="kind")
    try:
        return load(argv, SCHEMAS[kind], UNSUPPORTED[kind], FOLLOWS.get(kind), stream, NO_EFFECT[kind])
    except ConfigError as err:
        found = _kind_it_loads_as(argv, kind) if "unknown key" in str(err) else None
        if found is None:
            raise
        # the whole file is another kind's: its key is not mistyped, so no "closest valid key" suggestion
        src = f"{err.source}: " if err.source else ""
        raise ConfigError(f"{src}key '{err.key}' is not {ARTICLES[kind]} config's; this is {_entry(*found, argv)}",
                          err.key, err.source) from None


# train/sft_<family>.py and the model_base values each script trains
FAMILY_BASES = {"trado": ("trado",), "sdar": ("sdar", "trado", "sdar_moe"), "dream": ("dream",),
                "llada": ("llada", "llada_moe"), "mmada": ("mmada", "llada"), "llada2": ("llada2",)}


def script_family(model_base: str) -> str:
    """The ``train/sft_<family>.py`` script that trains ``model_base``: its own, else the first that accepts it
    (LLaDA-MoE's is sft_llada.py)."""
    return model_base if model_base in FAMILY_BASES else next(f for f, bases in FAMILY_BASES.items()
                                                              if model_base in bases)


ARTICLES = {"rl": "an RL", "eval": "an eval", "sft": "an SFT", "serve": "a serve"}


def _entry(kind: str, cfg: Any, argv: Sequence[str]) -> str:
    """``ARTICLES[kind]`` config and the command that runs it, e.g. "an RL config: python rl.py config=x.yaml"."""
    config = next((a.split("=", 1)[1] for a in argv if a.startswith("config=")), "...")
    if kind == "sft":
        script = f"train/sft_{script_family(cfg.model.model_base)}.py"
    else:
        script = {"rl": "rl.py", "eval": "eval.py", "serve": "serve.py"}[kind]
    return f"{ARTICLES[kind]} config: python {script} config={config}"


def _kind_it_loads_as(argv: Sequence[str], kind: str) -> tuple[str, Any] | None:
    """The other job kind whose schema loads ``argv`` as written (a config handed to the wrong script) and the
    config it loads, if any."""
    for other in SCHEMAS:
        if other == kind:
            continue
        try:
            cfg = load(argv, SCHEMAS[other], UNSUPPORTED[other], FOLLOWS.get(other), io.StringIO(), NO_EFFECT[other])
        except ConfigError:
            continue
        return other, cfg
    return None


def load_config_or_exit(kind: str, argv: Sequence[str] | None = None) -> Any:
    """:func:`load_config` for entry points: print the one-line error to stderr and exit 2 on failure."""
    try:
        return load_config(sys.argv[1:] if argv is None else argv, kind)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def config_text(cfg: Any) -> str:
    """The config as YAML (every key, resolved)."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def job_kind(path: str | os.PathLike[str]) -> str:
    """Job kind from a file name: rl_* / multinode_rl_* -> rl, *_eval / eval_* / multinode_eval_* -> eval, sft_* ->
    sft, serve_* / *_serve -> serve."""
    stem = Path(path).stem
    if stem.startswith(("rl_", "multinode_rl_")):
        return "rl"
    if stem.endswith("_eval") or stem.startswith(("eval_", "multinode_eval_")):
        return "eval"
    if stem.startswith("sft_"):
        return "sft"
    if stem.startswith("serve_") or stem.endswith("_serve"):
        return "serve"
    raise ConfigError(f"{path}: cannot infer the kind from the name (rl_*, multinode_rl_*, *_eval, eval_*, "
                      "multinode_eval_*, sft_*, serve_*, *_serve); name it (python -m tools.check_config --kind "
                      "rl|eval|sft|serve)", source=str(path))
