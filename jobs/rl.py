"""The RL loop behind ``rl.py``: sample, reward, train and evaluate in one process, one copy of the weights.

Per step i: a seeded draw of ``rollout.num_task_per_step`` tasks; every process samples whole prompt groups (its
share of the tasks) with the model it trains; rewards (math answers, or code through the sandbox), group
z-scored advantages and filters; the policy update; evaluation every ``eval_every`` steps; a checkpoint every
``save_every`` steps and at the end.

Run directory ``{output_dir}/{project}/``::

    config.yaml            the run's config (a resumed run must keep it, up to the step counts)
    step_0/                evaluation of the starting model (when eval_every > 0)
    step_<i>/              rollouts.jsonl (trajectories with scores and advantages), metrics.json,
                           eval/ (results.jsonl, trajectories, trace page), ckpt/ (policy/ = HF weights,
                           trainer/ = optimizer, RNG, schedule)
    metrics.jsonl          one line per complete step (rebuilt from the step directories)
    curves.png             reward, accuracy, evaluation accuracy, length, tokens per forward over the steps
    ckpt/<optimized_name>  link to the newest policy checkpoint

A step directory is written as ``step_<i>.partial`` and renamed when complete, so a killed run (SIGKILL
included) leaves only complete steps and partial ones. Resuming (``experiment.start_from_scratch=false``)
restarts from the newest complete step whose checkpoint reads back (an unreadable one is skipped with a notice);
later steps are removed and redone, and ``metrics.jsonl``, ``curves.png`` and the ``ckpt/`` links are derived
again from the complete steps, so resuming a finished run repairs whatever a kill left behind. A run directory
with no complete checkpoint (killed during the step-0 evaluation) resumes from the starting model. Every random
draw is keyed by (seed, step), so the resumed run reproduces the uninterrupted one. The directory is locked
(``.lock``) while a process runs it; it may be moved or renamed between runs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType

from core.files import RunDirError, RunLock, disk_full, disk_full_error, tree_bytes, write_atomic
from core.schema import replace as replace_settings
from jobs.checkpoint import (
    check_fresh_run_dir,
    check_resumed_config,
    checkpoint_problem,
    empty_run_dir,
    is_complete,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from jobs.config import config_text
from jobs.demo import ensure_demo_model
from jobs.dist import barrier, default_device, end_processes, is_main
from jobs.evaluate import evaluate, pass_at_k, sample_scored
from jobs.rollout import check_for_model, check_prompts_fit, load_tasks, prompt_lengths, prompt_room
from jobs.trackers import check_trackers, start_trackers
from models.lora import wrapped_model
from models.registry import DTYPES, family_spec, load_model, load_policy
from models.value import load_value_model, value_model_from_policy
from reward.group import ScoredSample, group_advantages, overlong_penalty
from sample.generate import sampling_dtype
from sample.trajectory import Trajectory, tokens_per_step, write_jsonl
from train.accelerator import gather_objects
from train.algorithms import algorithm
from train.policy_trainer import PolicyTrainer
from train.trainer import accelerator_for
from train.value_trainer import ValueTrainer, value_advantages

STEP_PREFIX, PARTIAL = "step_", ".partial"
# Keys that may change when a run is resumed (the rest must match the run's config.yaml).
# A run's identity is not its path: the directory may be moved (output_dir) or renamed (project) between runs.
RESUMABLE_CHANGES = ("experiment.total_step", "experiment.start_from_scratch", "experiment.overwrite",
                     "experiment.eval_every", "experiment.save_every", "experiment.keep_checkpoints",
                     "experiment.max_idle_steps", "experiment.output_dir", "experiment.project", "wandb.enabled",
                     "wandb.entity", "wandb.resume", "tensorboard.enabled", "tensorboard.log_dir",
                     # where the judge is served and how it is called (not what it grades)
                     "process_reward.base_url", "process_reward.api_key_env", "process_reward.timeout",
                     "process_reward.retries", "process_reward.concurrency")


def resumable_changes(cfg: Any) -> tuple[str, ...]:
    """The keys that may change on resume: ``RESUMABLE_CHANGES``, less ``process_reward.concurrency`` for a judge
    run in this process, whose batches are ``concurrency`` prompts (a batch's padding and seed change answers)."""
    local_judge = cfg.model.process_reward_model and not cfg.process_reward.base_url
    return tuple(k for k in RESUMABLE_CHANGES if not (local_judge and k == "process_reward.concurrency"))


# ------------------------------------------------------------------------------------------ run directory


class RunDir:
    """Step directories of one run (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root

    def step(self, i: int) -> Path:
        return self.root / f"{STEP_PREFIX}{i}"

    def complete_steps(self) -> list[int]:
        out = []
        for p in self.root.glob(f"{STEP_PREFIX}*"):
            suffix = p.name[len(STEP_PREFIX):]
            if suffix.isdigit() and (p / "metrics.json").is_file():
                out.append(int(suffix))
        return sorted(out)

    def checkpoints(self) -> list[int]:
        """Complete steps holding a complete checkpoint, oldest first."""
        return [i for i in self.complete_steps() if is_complete(self.step(i) / "ckpt")]

    def last_checkpoint(self) -> int | None:
        return max(self.checkpoints(), default=None)

    def resumable_checkpoint(self) -> int | None:
        """The newest checkpoint that reads back; each unreadable newer one is named in a one-line notice."""
        for i in reversed(self.checkpoints()):
            problem = checkpoint_problem(self.step(i) / "ckpt")
            if problem is None:
                return i
            print(f"note: the checkpoint of step {i} cannot be resumed ({problem}); falling back to the step "
                  "before it", flush=True)
        return None

    def prune_checkpoints(self, keep: int) -> None:
        """Keep the ``keep`` newest checkpoints (0: all), once the newest reads back; older steps keep their
        rollouts, metrics and evaluation."""
        saved = self.checkpoints()
        if keep and saved and checkpoint_problem(self.step(saved[-1]) / "ckpt") is None:
            for i in self.checkpoints()[:-keep]:
                remove_checkpoint(self.step(i) / "ckpt")

    def discard_after(self, i: int) -> None:
        """Remove every step after ``i`` (complete or partial): they are redone."""
        for p in self.root.glob(f"{STEP_PREFIX}*"):
            n = p.name[len(STEP_PREFIX):].removesuffix(PARTIAL)
            if n.isdigit() and (int(n) > i or p.name.endswith(PARTIAL)):
                remove_checkpoint(p / "ckpt")
                shutil.rmtree(p)

    @contextmanager
    def staging(self, i: int, main: bool) -> Iterator[Path]:
        """Write step ``i`` into ``step_i.partial``; rename it when the block completes. A full disk removes the
        partial step and becomes one line naming the directory and the bytes a step takes."""
        partial = self.root / f"{STEP_PREFIX}{i}{PARTIAL}"
        try:
            if main:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            yield partial
            if main:
                os.replace(partial, self.step(i))
        except Exception as err:  # writers report a full disk as OSError, RuntimeError or SafetensorError
            if not disk_full(err, partial):
                raise
            if main:  # the other ranks may still be writing their shards into it
                shutil.rmtree(partial, ignore_errors=True)
            saved = self.checkpoints()
            raise disk_full_error(partial, tree_bytes(self.step(saved[-1]) / "ckpt") if saved else None) from None

    def metrics(self) -> list[dict]:
        return [json.loads((self.step(i) / "metrics.json").read_text()) for i in self.complete_steps()]


# ------------------------------------------------------------------------------------------ step


def draw_tasks(n_tasks: int, k: int, seed: int, step: int, round_: int = 0,
               exclude: frozenset[int] = frozenset()) -> list[int]:
    """The task indices of RL step ``step``: ``k`` distinct tasks (all of them if fewer), seeded by (seed, step);
    ``round_`` > 0: a dynamic-sampling redraw among the tasks not in ``exclude``."""
    rng = random.Random(f"rl-tasks-{seed}-{step}" + (f"-round{round_}" if round_ else ""))
    pool = [i for i in range(n_tasks) if i not in exclude] if exclude else range(n_tasks)
    return sorted(rng.sample(pool, min(k, len(pool))))


def sampling_weights(trainer: PolicyTrainer):
    """Context giving the sampler whole weights (ZeRO-3 partitions them; DDP and single process need nothing)."""
    params = [p for p in trainer.adapter.model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


class RLJob:
    """State and stages of one RL run."""

    def __init__(self, cfg: Any, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        self.root = Path(cfg.experiment.output_dir) / cfg.experiment.project
        self.run = RunDir(self.root)
        self.timers: dict[str, float] = {}
        self.lock: RunLock | None = None
        self.tracker: Any = None

    def close(self) -> None:
        """End the tracker and release the run directory (the OS does it too if the process dies)."""
        if self.tracker is not None:
            self.tracker.finish()
        if self.lock is not None:
            self.lock.release()

    def interrupted_detail(self) -> str:
        """What an interrupted run leaves behind, and how to continue it: a resume continues from the last
        checkpoint (steps logged after it are run again)."""
        done, saved = self.run.complete_steps(), self.run.last_checkpoint()
        resume = "continue with experiment.start_from_scratch=false"
        if saved is not None:
            again = f"; steps {saved + 1}..{done[-1]} are run again" if done[-1] > saved else ""
            return f"the last checkpoint in {self.root} is step {saved}{again}; {resume}"
        if done:
            return (f"steps up to {done[-1]} are logged in {self.root} but none is checkpointed (experiment."
                    f"save_every={self.cfg.experiment.save_every}): a resume starts again from step 1; {resume}")
        return f"no step completed in {self.root}; start it again with experiment.start_from_scratch=false"

    # ------------------------------------------------------------ setup

    def prepare(self) -> int:
        """Check the run directory, build the model and trainer; returns the first step to run."""
        cfg = self.cfg
        cfg.system.apply()
        self.acc = self._accelerator()
        self.main = is_main(self.acc)
        if self.main:
            self.lock = RunLock(self.root)
        resume_from = self._check_run_dir()
        if resume_from is None:
            if self.main:
                ensure_demo_model(cfg.model)
            barrier(self.acc)
        resume_dir = None if resume_from is None else self._policy_dir(resume_from)
        self.adapter = load_policy(cfg.model, cfg.lora, resume_dir, default_device())  # LoRA: models/lora.py
        check_for_model("rollout", cfg.rollout, self.adapter)
        for params in cfg.evaluation.runs():
            check_for_model("evaluation", params, self.adapter)
        self.tasks = load_tasks(cfg.dataset.train_dataset, cfg.dataset.data_type, seed=cfg.experiment.seed,
                                n_builtin=cfg.dataset.builtin_size)
        self.drawable = self._drawable_tasks()
        self.eval_tasks = []
        if cfg.experiment.eval_every:
            self.eval_tasks = load_tasks(cfg.evaluation.eval_dataset, cfg.evaluation.data_type,
                                         seed=cfg.experiment.seed + 1, n_builtin=cfg.evaluation.builtin_size)
            check_prompts_fit("evaluation", self.adapter, self.eval_tasks, cfg.evaluation.data_type,
                              cfg.evaluation.runs(), cfg.evaluation.eval_dataset)
        if cfg.optimizer.name != "adamw":  # the only optimizer (the reference's configs name it)
            raise RunDirError(f"optimizer.name {cfg.optimizer.name!r} is not supported")
        ref = None
        # a frozen copy of the starting policy: for the reference KL, or the algorithm's own loss (VRPO)
        if cfg.training.ref_beta > 0 or algorithm(cfg.training.method).needs.reference_model == "required":
            ref = load_model(_with_path(cfg.model, cfg.model.pretrained_model), device=default_device()).model
        params = cfg.optimizer.params
        policy_params = replace_settings(params, learning_rate=params.policy_learning_rate or params.learning_rate)
        self.trainer = PolicyTrainer(self.adapter, self._training_settings(), policy_params, cfg.lr_scheduler,
                                     total_steps=self._schedule_steps(), accelerator=self.acc, ref_model=ref)
        self.value = self._value_trainer(resume_from) if cfg.model.value_base_model else None
        self.judge = None
        if cfg.model.process_reward_model:
            from reward.judges import build_judge

            self.judge = build_judge(cfg.model.process_reward_model, cfg.process_reward, seed=cfg.experiment.seed)
        check_trackers(cfg)
        if cfg.experiment.start_from_scratch:  # every setup check passed: only now may an overwritten run go
            empty_run_dir(self.root, self.acc)
        first = 1 if resume_from is None else resume_from + 1
        self.tracker = start_trackers(cfg, self.root, first) if self.main else None
        if resume_from is not None:
            self._load_trainer(self.run.step(resume_from) / "ckpt")
            if self.value is not None:
                load_checkpoint(self.value, self.run.step(resume_from) / "ckpt" / "value",
                                accelerator_state=self._value_has_own_state())
        if self.main:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / "config.yaml", config_text(cfg))
        barrier(self.acc)
        return first

    def _accelerator(self) -> Any:
        """An Accelerator for this launch with the training section's precision, accumulation and micro-batch."""
        return accelerator_for(self.cfg.training)

    def _training_settings(self) -> Any:
        """``cfg.training``, with old log-probs recomputed where the rollouts and the training forward compute in
        different precisions: the sampler's log-probs would differ from the trainer's by rounding, not by policy
        change, and the first update's ratio would be that noise."""
        t = self.cfg.training
        weights = next(self.adapter.model.parameters()).dtype
        trainer = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.acc.mixed_precision), weights)
        if self.acc.distributed_type == DistributedType.DEEPSPEED:
            weights = trainer  # DeepSpeed keeps the weights in its precision: the rollouts compute in it too
        sampler = sampling_dtype(self.adapter, self.cfg.rollout) or weights
        if t.old_logp != "sampler" or sampler == trainer:
            return t
        if self.main:
            print(f"note: rollouts compute in {str(sampler).removeprefix('torch.')} and training in "
                  f"{str(trainer).removeprefix('torch.')}; old log-probs are recomputed (training.old_logp=recompute; "
                  "set rollout.compute_dtype and training.mixed_precision alike to use the sampler's)", flush=True)
        return replace_settings(t, old_logp="recompute")

    def _value_trainer(self, resume_from: int | None) -> ValueTrainer:
        """The value model: initialised from ``model.value_base_model`` (zero head), or its checkpoint."""
        cfg = self.cfg
        saved = None if resume_from is None else self.run.step(resume_from) / "ckpt" / "value" / "policy"
        if saved is not None and not cfg.lora.enabled:
            model = load_value_model(saved, dtype=DTYPES[cfg.model.dtype])  # as a fresh run's (model.dtype)
        else:  # LoRA: the backbone (from value_base_model) through adapters, the head trained whole
            base = load_model(_with_path(cfg.model, cfg.model.value_base_model), device="cpu").model
            model = value_model_from_policy(base)
            del base
            if cfg.lora.enabled:
                lora = replace_settings(cfg.lora, load_in_4bit=False)  # the value backbone is never quantised
                spec = family_spec(cfg.model.model_base)
                model = wrapped_model(model, lora, spec.lora_targets, saved, also_save=("value_head",),
                                      family_parameters=spec.lora_parameters)
        model = model.to(next(self.adapter.model.parameters()).device)
        adapter = dataclasses.replace(self.adapter, model=model)
        params = replace_settings(cfg.optimizer.params, learning_rate=cfg.optimizer.params.value_learning_rate)
        steps = self._schedule_steps(every=cfg.experiment.train_value_every)
        # An Accelerator drives one DeepSpeed engine (its backward and step go to the engine it prepared last):
        # under DeepSpeed the value model gets an Accelerator of its own, with the same launch state and config.
        acc = self._accelerator() if self.acc.distributed_type == DistributedType.DEEPSPEED else self.acc
        return ValueTrainer(adapter, cfg.training, params, cfg.lr_scheduler, total_steps=steps, accelerator=acc)

    def _check_run_dir(self) -> int | None:
        """None for a fresh run (the directory must be empty unless overwrite); else the step to resume from."""
        exp = self.cfg.experiment
        if exp.start_from_scratch:
            check_fresh_run_dir(self.root, exp.overwrite)  # emptied after the setup
            return None
        if not (self.root / "config.yaml").is_file():
            raise RunDirError(f"nothing to resume in {self.root}: it holds no run (start a new run with "
                              "experiment.start_from_scratch=true)")
        check_resumed_config(self.root, self.cfg, resumable_changes(self.cfg))
        last = self.run.resumable_checkpoint() if self.main else None
        last = gather_objects(self.acc, [last])[0]  # rank 0's choice (it alone verified the files)
        if last is None and self.run.checkpoints():  # never throw a run away because its checkpoints do not read
            raise RunDirError(f"cannot resume {self.root}: no checkpoint reads back (steps "
                              f"{', '.join(map(str, self.run.checkpoints()))}; see the notes above); repair or "
                              "remove them, or start again with experiment.overwrite=true")
        if last is None and self.main:
            print(f"note: {self.root} holds no complete checkpoint yet; the run starts again from "
                  "model.pretrained_model", flush=True)
        if self.main:
            self.run.discard_after(-1 if last is None else last)
        barrier(self.acc)
        return last

    def _drawable_tasks(self) -> list[int]:
        """Dataset rows a step may draw: those whose prompt fits ``training.max_prompt_len`` (a longer prompt's
        samples would be dropped by training) and the model's positions with the rollout's response room (a longer
        one would stop the run at the step that draws it, and again on resume), and enough of them for
        ``rollout.num_task_per_step``."""
        cfg = self.cfg
        name, k = cfg.dataset.train_dataset, cfg.rollout.num_task_per_step
        limits = [(n, said) for n, said in (
            (cfg.training.max_prompt_len, f"training.max_prompt_len={cfg.training.max_prompt_len}"),
            prompt_room("rollout", self.adapter, cfg.rollout)) if n is not None]
        rows = range(len(self.tasks))
        if limits:
            limit, said = min(limits, key=lambda item: item[0])
            lengths = prompt_lengths(self.adapter, self.tasks, cfg.dataset.data_type, cfg.rollout.start_with_think)
            rows = [i for i in rows if lengths[i] <= limit]
            if not rows:
                raise RunDirError(f"no prompt of {name} fits {said}; the shortest has {min(lengths)} tokens")
            if len(rows) < len(self.tasks) and self.main:
                print(f"note: {len(self.tasks) - len(rows)} of {len(self.tasks)} tasks of {name} have prompts over "
                      f"{said} and are never drawn", flush=True)
        if len(rows) < k:
            raise RunDirError(f"{name} has {len(rows)} usable tasks, fewer than rollout.num_task_per_step={k}: "
                              "lower num_task_per_step or use a bigger dataset")
        return list(rows)

    def _schedule_steps(self, every: int = 1) -> int:
        """The LR schedule's length for a model trained every ``every`` RL steps (the value model:
        ``train_value_every``): one per training RL step, however many optimiser steps each holds (samples_per_step,
        num_train_epochs: they share the step's rate; the filters decide at run time how many there are)."""
        return max(self.cfg.experiment.total_step // every, 1)  # trained at the steps divisible by every

    # ------------------------------------------------------------ the loop

    def run_steps(self, first: int) -> list[dict]:
        cfg = self.cfg
        if not cfg.experiment.start_from_scratch:  # a resumed run: its outputs may lag behind its steps (a kill
            self._finalise()  # after a step's rename) or list steps it discarded (no checkpoint: from step 1 again)
        if first == 1 and cfg.experiment.eval_every:
            with self.run.staging(0, self.main) as d:
                metrics = {"step": 0, **self._evaluate(d)}
                self._write_metrics(d, metrics)
            self._after_step(metrics)
        idle = self._idle_steps_before(first)
        for step in range(first, cfg.experiment.total_step + 1):
            with self.run.staging(step, self.main) as d:
                metrics = self.one_step(step, d)
            self._after_step(metrics)
            idle = idle + 1 if metrics["optimizer_steps"] == 0 else 0
            if cfg.experiment.max_idle_steps and idle >= cfg.experiment.max_idle_steps:
                raise RunDirError(f"{idle} steps in a row (steps {step - idle + 1}..{step}) made no optimizer "
                                  f"update: {_idle_cause(metrics)}; stopping (experiment.max_idle_steps="
                                  f"{cfg.experiment.max_idle_steps})")
        return self.run.metrics() if self.main else []

    def _idle_steps_before(self, first: int) -> int:
        """Steps in a row without an optimizer update just before ``first`` (a resumed run keeps counting)."""
        idle = 0
        if first > 1 and self.main:
            for metrics in reversed([m for m in self.run.metrics() if m["step"] < first]):
                if metrics.get("optimizer_steps", 1) != 0 or metrics["step"] == 0:
                    break
                idle += 1
        return gather_objects(self.acc, [idle])[0]  # rank 0 read the step files

    def one_step(self, step: int, out: Path) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        self.step, self.timers = step, {}
        trajs, stats = self._timed("sample", lambda: self._sample(step))
        advantages, summary = self._timed("advantage", lambda: self._advantages(trajs))
        if cfg.rollout.dynamic_sampling_rounds:
            trajs, stats, advantages, summary = self._fill_batch(step, trajs, stats, advantages, summary)
        kept = [t for t in trajs if t.sample_id in advantages]
        train_metrics: list[dict] = []
        value_metrics: dict = {}
        if kept:
            policy_adv: dict = advantages
            if self.value is not None:  # value-guided TraceRL: per-token step-level GAE advantages
                rewards: dict = advantages  # the group-normalised outcome, on each sample's last step
                if self.judge is not None:
                    process = self._timed("judge", lambda: self._process_rewards(kept))
                    rewards, summary = process.token_rewards, {**summary, **process.metrics()}
                policy_adv, returns = self._timed("values", lambda: self._gae(kept, rewards))
                if step % cfg.experiment.train_value_every == 0:
                    value_metrics = _value_summary(self._timed("train_value",
                                                               lambda: self.value.train_step(kept, returns)))
            train_metrics = self._timed("train", lambda: self.trainer.train_step(kept, policy_adv))
            # what training actually used: the views drop samples too (an over-long prompt, an empty response)
            summary["kept"] -= len(gather_objects(self.acc, self.trainer.dropped))
        else:  # keep the step-keyed random draws and the LR schedules aligned with the step number
            self.trainer.skip_step()
            if self.value is not None and step % cfg.experiment.train_value_every == 0:
                self.value.skip_step()
        metrics = {"step": step, **_rollout_metrics(trajs, stats), **summary, **_train_summary(train_metrics),
                   **value_metrics}
        if cfg.experiment.eval_every and (step % cfg.experiment.eval_every == 0 or step == cfg.experiment.total_step):
            metrics.update(self._timed("eval", lambda: self._evaluate(out)))
        if step % cfg.experiment.save_every == 0 or step == cfg.experiment.total_step:
            self._timed("save", lambda: self._save(out / "ckpt"))
        metrics["seconds"] = {**self.timers, "total": time.perf_counter() - t0}
        if self.main:
            for traj in trajs:
                traj.meta["advantage"] = advantages.get(traj.sample_id)
            write_jsonl(trajs, out / "rollouts.jsonl")
            self._write_metrics(out, metrics)
        return metrics

    def _process_rewards(self, kept: list[Trajectory]):
        """Per-token process rewards of the kept samples; the judge's prompts are shared out over the ranks."""
        from reward.process import process_rewards

        def judge(chats: list) -> list[str]:
            rank, world = self.acc.process_index, self.acc.num_processes
            mine = list(range(rank, len(chats), world))
            seed = (self.cfg.experiment.seed * 1_000_003 + self.step) * 1009 + rank  # fresh draws every step
            answers = gather_objects(self.acc, list(zip(mine, self.judge([chats[i] for i in mine], seed=seed),
                                                        strict=True)))
            return [a for _, a in sorted(answers)]

        tok = self.adapter.tokenizer
        return process_rewards(kept, self.tasks, lambda ids: tok.decode(ids, skip_special_tokens=True), judge,
                               self.cfg.process_reward,
                               self.cfg.rollout.block_for(self.adapter.attention, self.adapter.block_size))

    def _gae(self, kept: list[Trajectory], rewards: dict) -> tuple[dict, dict]:
        values = self.value.token_values(kept)
        t = self.cfg.training
        return value_advantages(kept, rewards, values, t.gam, t.lam)

    def _timed(self, name: str, fn):
        start = time.perf_counter()
        out = fn()
        self.timers[name] = self.timers.get(name, 0.0) + time.perf_counter() - start
        return out

    def _fill_batch(self, step: int, trajs: list[Trajectory], stats: dict, advantages: dict, summary: dict):
        """DAPO's dynamic sampling: redraw new tasks while fewer than ``num_task_per_step`` groups were kept; the
        first groups kept in each redraw (task order) fill the batch, the rest are recorded as dropped."""
        cfg, want = self.cfg, self.cfg.rollout.num_task_per_step
        kept_groups = {t.group_id for t in trajs if t.sample_id in advantages}
        dropped_by = dict(summary["dropped_by"])
        rounds = 0
        while len(kept_groups) < want and rounds < cfg.rollout.dynamic_sampling_rounds:
            rounds += 1
            used = {t.task_index for t in trajs}
            exclude = frozenset(i for i, task in enumerate(self.drawable) if task in used)
            if len(exclude) == len(self.drawable):
                break  # every task was drawn this step
            more, more_stats = self._sample(step, rounds, exclude)
            more_adv, more_summary = self._advantages(more)
            for reason, n in more_summary["dropped_by"].items():
                dropped_by[reason] = dropped_by.get(reason, 0) + n
            for gid in sorted({t.group_id for t in more if t.sample_id in more_adv}, key=int):
                ids = [t.sample_id for t in more if t.group_id == gid and t.sample_id in more_adv]  # scored ones
                if len(kept_groups) < want:
                    kept_groups.add(gid)
                    advantages.update({sid: more_adv[sid] for sid in ids})
                else:
                    dropped_by["batch_full"] = dropped_by.get("batch_full", 0) + len(ids)
            trajs = trajs + more
            stats = _merged_stats(stats, more_stats)
        kept = sum(t.sample_id in advantages for t in trajs)
        summary = {**summary, "kept": kept, "dropped": len(trajs) - kept, "dropped_by": dropped_by,
                   "resample_rounds": rounds}
        return trajs, stats, advantages, summary

    def _sample(self, step: int, round_: int = 0,
                exclude: frozenset[int] = frozenset()) -> tuple[list[Trajectory], dict]:
        cfg = self.cfg
        chosen = [self.drawable[i] for i in draw_tasks(len(self.drawable), cfg.rollout.num_task_per_step,
                                                        cfg.experiment.seed, step, round_, exclude)]
        subset = [self.tasks[i] for i in chosen]
        with sampling_weights(self.trainer):
            trajs, stats = sample_scored(self.adapter, subset, cfg.dataset.data_type, cfg.rollout, cfg.execute,
                                         seed=cfg.experiment.seed * 100_003 + step + 7919 * round_,
                                         accelerator=self.acc,
                                         progress=self.progress, max_tokens=cfg.rollout.max_tokens,
                                         truncation_margin=cfg.reward.truncation_margin)
        for t in trajs:  # ids name the dataset row, not the position in this step's subset
            t.task_index = chosen[t.task_index]
            t.group_id, t.sample_id = str(t.task_index), f"{t.task_index}-{t.sample_id.rpartition('-')[2]}"
        return trajs, stats

    def _advantages(self, trajs: list[Trajectory]) -> tuple[dict[str, float], dict]:
        r = self.cfg.reward
        band = (r.acc_low, r.acc_high) if self.cfg.dataset.data_type != "code" else None
        shaping = [overlong_penalty(len(t.response_ids), self.cfg.rollout.max_tokens, r.overlong_buffer,
                                    r.overlong_penalty) for t in trajs]
        # a program the sandbox failed to run has no verdict: it leaves its group before the baseline is taken
        scored = [(t, p) for t, p in zip(trajs, shaping, strict=True) if "sandbox_error" not in t.meta]
        result = group_advantages([ScoredSample(t.sample_id, t.group_id, t.score + p, t.correct) for t, p in scored],
                                  acc_band=band, drop_all_equal=r.filter_all_equal, estimator=r.advantage)
        s, unscored = result.summary, len(trajs) - len(scored)
        out = {"kept": s["kept"], "dropped": s["dropped"] + unscored,
               "dropped_by": {**s["dropped_by_reason"], **({"sandbox_error": unscored} if unscored else {})}}
        if r.overlong_buffer:
            out["overlong_penalty_mean"] = sum(shaping) / max(len(shaping), 1)
        return result.advantages, out

    def _evaluate(self, out: Path) -> dict:
        cfg = self.cfg
        ev = cfg.evaluation
        with sampling_weights(self.trainer):
            results = evaluate(self.adapter, self.eval_tasks, ev.data_type, ev, cfg.execute, cfg.experiment.seed,
                               out / "eval", ev.eval_dataset, accelerator=self.acc, progress=self.progress)
        if self.main:
            write_atomic(out / "eval" / "results.jsonl", "".join(json.dumps(r) + "\n" for r in results))
        return {"eval_acc": results[0]["acc"], "eval": [{**r["setting"], "acc": r["acc"],
                                                          "avg_length": r["avg_length"],
                                                          "tokens_per_step": r["tokens_per_step"]}
                                                         for r in results]}

    # ------------------------------------------------------------ checkpoints

    def _policy_dir(self, step: int) -> Path:
        return self.run.step(step) / "ckpt" / "policy"

    def _value_has_own_state(self) -> bool:
        """Whether the value model has an Accelerator of its own (DeepSpeed); else the policy's checkpoint holds its
        optimizer and RNG state with the policy's."""
        return self.value.accelerator is not self.trainer.accelerator

    def _save(self, ckpt: Path) -> None:
        if self.value is not None:
            save_checkpoint(self.value, ckpt / "value", accelerator_state=self._value_has_own_state())
        save_checkpoint(self.trainer, ckpt)

    def _load_trainer(self, ckpt: Path) -> None:
        load_checkpoint(self.trainer, ckpt)

    # ------------------------------------------------------------ outputs

    def _write_metrics(self, out: Path, metrics: dict) -> None:
        if self.main:
            write_atomic(out / "metrics.json", json.dumps(metrics))

    def _after_step(self, metrics: dict) -> None:
        barrier(self.acc)
        if not self.main:
            return
        self._finalise()
        if self.tracker is not None:
            self.tracker.log(metrics, step=metrics["step"])
        print(format_line(metrics, self.cfg.experiment.total_step), flush=True)

    def _finalise(self) -> None:
        """Derive the run's outputs from its complete steps (idempotent): ``metrics.jsonl``, ``curves.png``, the
        ``ckpt/`` links to the newest checkpoint, and the pruning of old checkpoints."""
        if not self.main:
            return
        try:
            history = self.run.metrics()
            write_atomic(self.root / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in history))
            _plot_curves(history, self.root / "curves.png")
            last = self.run.last_checkpoint()
            if last is None:  # a restarted run: no checkpoint yet, no link to a discarded one
                for name in (self.cfg.model.optimized_name, self.cfg.model.optimized_value_name):
                    (self.root / "ckpt" / name).unlink(missing_ok=True)
            else:
                _link(self.root / "ckpt" / self.cfg.model.optimized_name, self._policy_dir(last))
                if self.value is not None:
                    _link(self.root / "ckpt" / self.cfg.model.optimized_value_name,
                          self.run.step(last) / "ckpt" / "value" / "policy")
            self.run.prune_checkpoints(self.cfg.experiment.keep_checkpoints)
        except Exception as err:
            if not disk_full(err, self.root):
                raise
            raise disk_full_error(self.root, None, removed=False) from None


def run_rl(cfg: Any, progress: bool = True) -> list[dict]:
    """rl.py: run (or resume) the RL loop; returns the metrics of every complete step (main process)."""
    job = RLJob(cfg, progress)
    try:
        first = job.prepare()
        total = cfg.experiment.total_step
        if job.main:
            todo = f"steps {first}..{total}" if first <= total else f"all {total} steps done; outputs checked"
            print(f"run directory: {job.root}  ({todo}, {job.acc.num_processes} process(es), "
                  f"{describe_sandbox(cfg)})", flush=True)
        history = job.run_steps(first)
    except KeyboardInterrupt as err:
        err.detail = job.interrupted_detail()
        raise
    finally:
        job.close()
    end_processes(job.acc)
    evals = [m for m in history if "eval_acc" in m]
    if job.main and len(evals) >= 2:
        a, b = evals[0], evals[-1]
        print(f"held-out accuracy ({cfg.evaluation.eval_dataset}): step {a['step']} {a['eval_acc']:.3f} -> step "
              f"{b['step']} {b['eval_acc']:.3f} ({100 * (b['eval_acc'] - a['eval_acc']):+.1f} points); "
              f"curves: {job.root / 'curves.png'}", flush=True)
    return history


def describe_sandbox(cfg: Any) -> str:
    if cfg.dataset.data_type != "code" and cfg.evaluation.data_type != "code":
        return "no code execution"
    from reward import sandbox

    describe = getattr(sandbox, "describe_sandbox", None)
    return describe() if describe else f"sandbox: {sandbox.sandbox_capabilities()}"


# ------------------------------------------------------------------------------------------ metrics


def _merged_stats(a: dict, b: dict) -> dict:
    """Sampling stats of two runs together."""
    out = {k: a[k] + b[k] for k in ("forwards", "denoise_forwards", "generated_tokens", "wall_time")}
    out["tokens_per_second"] = out["generated_tokens"] / out["wall_time"] if out["wall_time"] > 0 else 0.0
    out["tokens_per_forward"] = out["generated_tokens"] / out["forwards"] if out["forwards"] else 0.0
    return out


def _rollout_metrics(trajs: list[Trajectory], stats: dict) -> dict:
    n = max(len(trajs), 1)
    # reward, acc and pass@k are verdicts: a sample the sandbox failed to run has none and is left out of them
    scored = [t for t in trajs if "sandbox_error" not in t.meta]
    groups: dict[str, list[bool]] = {}
    for t in scored:
        groups.setdefault(t.group_id, []).append(t.correct)
    k = max((len(g) for g in groups.values()), default=1)
    sampled_logp = [lp for t in trajs for lp in t.logprobs]
    return {
        "reward": sum(t.score for t in scored) / max(len(scored), 1),
        "acc": sum(t.correct for t in scored) / max(len(scored), 1),
        f"pass@{k}": sum(pass_at_k(len(g), sum(g), len(g)) for g in groups.values()) / max(len(groups), 1),
        "response_length": sum(len(t.response_ids) for t in trajs) / n,
        "tokens_per_step": tokens_per_step(t.step_map for t in trajs),
        "tokens_per_forward": stats["tokens_per_forward"],  # per batched forward (grows with the batch)
        "tokens_per_second": stats["tokens_per_second"],
        # mean -log p of the sampled tokens: an estimate of the policy's entropy on its own samples
        "entropy": -sum(sampled_logp) / max(len(sampled_logp), 1),
        "samples": len(trajs),
    }


def _train_summary(step_metrics: list[dict]) -> dict:
    if not step_metrics:
        return {"optimizer_steps": 0}
    last = step_metrics[-1]
    keys = ("loss", "policy_loss", "kl_loss", "approx_kl", "ref_kl", "clip_frac", "ratio_mean", "grad_norm", "lr")
    out = {k: sum(m[k] for m in step_metrics if k in m) / len(step_metrics) for k in keys if k in last}
    out["optimizer_steps"] = len(step_metrics)
    if "pairs" in last:  # pairwise losses (VRPO): preference pairs trained on, over the step's optimiser steps
        out["pairs"] = sum(m.get("pairs", 0.0) for m in step_metrics)
    if "sampler_logp_max_abs_diff" in last:
        out["sampler_logp_max_abs_diff"] = last["sampler_logp_max_abs_diff"]
    return out


def _value_summary(step_metrics: list[dict]) -> dict:
    if not step_metrics:
        return {}
    n = max(sum(m.get("tokens", 0.0) for m in step_metrics), 1.0)
    return {"value_loss": sum(m["loss"] for m in step_metrics) / len(step_metrics),
            "value_abs_err": sum(m.get("value_abs_err_sum", 0.0) for m in step_metrics) / n}


def format_line(m: dict, total: int) -> str:
    """The one line printed per step."""
    step = m["step"]
    parts = [f"step {step}/{total}"]
    if "reward" in m:
        parts += [f"reward {m['reward']:.3f}", f"acc {m['acc']:.3f}", f"len {m['response_length']:.1f}",
                  f"tok/step {m['tokens_per_step']:.2f}", f"kept {m['kept']}/{m['samples']}"]
        if m.get("optimizer_steps") == 0:
            parts.append("NO UPDATE")
        if m.get("dropped_by", {}).get("sandbox_error"):  # not a verdict on the programs: worth seeing every step
            parts.append(f"SANDBOX FAILED {m['dropped_by']['sandbox_error']}")
        if "approx_kl" in m:
            parts += [f"kl {m['approx_kl']:.4f}", f"clip {m['clip_frac']:.3f}"]
        if "ref_kl" in m:  # training.ref_beta: how far the policy has moved from the frozen reference
            parts.append(f"ref_kl {m['ref_kl']:.4f}")
        parts.append(f"ent {m['entropy']:.2f}")
        if "value_loss" in m:
            parts.append(f"vloss {m['value_loss']:.4f}")
    if "eval_acc" in m:
        parts.append(f"eval_acc {m['eval_acc']:.3f}")
    secs = m.get("seconds", {})
    if secs:
        parts.append("| " + " ".join(f"{k} {v:.1f}s" for k, v in secs.items()))
    return "  ".join(parts)


def _plot_curves(history: list[dict], path: Path) -> None:
    """A PNG of the main curves (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "reward"), ("acc", "train accuracy"), ("eval_acc", "eval accuracy"),
              ("response_length", "response length"), ("tokens_per_step", "tokens / denoising step"),
              ("approx_kl", "KL (old || new)")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        pts = [(m["step"], m[key]) for m in history if key in m]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80)
    plt.close(fig)
    write_atomic(path, png.getvalue())


# ------------------------------------------------------------------------------------------ helpers


def _with_path(model_cfg: Any, path: str) -> Any:
    from core.schema import replace

    return replace(model_cfg, pretrained_model=path)


def _link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (relative symlink)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(os.path.relpath(target, link.parent))
    os.replace(tmp, link)






def _idle_cause(metrics: dict) -> str:
    """The likely reason a step trained nothing."""
    if metrics.get("samples", 0) and not metrics.get("kept"):
        return ("every group was filtered (all responses scored alike or outside reward.acc_low..acc_high; "
                f"dropped by: {metrics.get('dropped_by')})")
    return "no sample reached training"
