"""The SFT job behind ``train/sft_<family>.py``: data -> samples -> SFTTrainer steps -> checkpoints.

Data (``dataset.optimization_data``): ``data/<name>.json|.jsonl``, a path to such a file, a ``datasets`` folder
saved with ``save_to_disk``, ``hub:<org>/<name>[:<split>]`` (a hub dataset, read through the ``datasets`` cache, so
it works offline once downloaded), or ``builtin:arithmetic``. Rows are ``{prompt, response[, step_map]}`` or chat
``{messages: [...]}`` (the last assistant message is the response). Prompts are rendered with the tokenizer's chat
template (a prompt that already starts with one of the tokenizer's special tokens, i.e. is rendered, is taken as
it is); the response is encoded as text and closed with the family's turn-end token; the loss covers response
tokens only. Rows whose prompt exceeds ``training.max_prompt_len``, or that are longer than the model's positions,
are reported and skipped by id (nothing shifts); responses longer than ``training.max_gen_length`` are cut there,
and the job says how many.

Run directory ``{output_dir}/{project}/``: ``config.yaml``, ``metrics.jsonl`` (one line per optimiser step),
``ckpt/<optimized_name>/`` (the final model, loadable by ``from_pretrained`` / ``load_model``) and ``ckpt/last/``
(policy weights + optimizer / RNG / data position, written every ``training.save_every`` steps; resume with
``experiment.start_from_scratch=false``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from core.files import RunDirError, RunLock, disk_full, disk_full_error, tree_bytes, write_atomic
from core.schema import replace
from data.builtin import builtin_sft_rows, sft_names
from data.formats import DataFormatError, read_raw_rows
from data.prompts import prompt_ids
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
from models.registry import family_spec, load_policy
from sample.trajectory import Trajectory
from train.sft_trainer import SFTTrainer, sft_sample
from train.trainer import accelerator_for

if TYPE_CHECKING:
    from models.registry import Adapter

# ------------------------------------------------------------------------------------------ data


def turn_end_id(adapter: Adapter) -> int:
    """The token closing an SFT response: the family's turn end (``<|im_end|>``, ``<|eot_id|>``, ``<|role_end|>``),
    or EOS when the tokenizer has no such token (the demo tokenizer under a LLaDA / LLaDA2 model): the sampler
    stops on either (``Adapter.stop_ids``)."""
    turn_end = family_spec(adapter.model_base).turn_end
    vocab = adapter.tokenizer.get_vocab()
    return int(vocab[turn_end]) if turn_end in vocab else int(adapter.eos_ids[0])


def step_bounds(n: int, per_process: int | None, world: int) -> list[tuple[int, int]]:
    """(start, end) of each optimiser step's samples in an epoch of ``n``: ``per_process`` for each of ``world``
    processes (None: the whole epoch in one step); a last step too small to give every process a sample joins the
    step before it (a process with nothing to train would stop the run)."""
    per = per_process * world if per_process else n
    bounds = [(i, min(i + per, n)) for i in range(0, n, per)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < world:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def builtin_rows(name: str, n: int, seed: int, difficulty: int) -> list[dict]:
    """SFT rows of a built-in task (``data/builtin.py``): the question as the prompt, its worked solution or boxed
    reference answer as the response (``difficulty`` applies to arithmetic; the puzzles draw their train split)."""
    if name not in sft_names():
        raise DataFormatError(f"unknown built-in SFT dataset {name!r} ({', '.join(sft_names())})")
    return builtin_sft_rows(name, n, seed, difficulty)


def read_rows(name: str, data_dir: str = "data") -> list[dict]:
    """Rows of an SFT dataset file, ``datasets`` folder or hub dataset (validated: prompt/response or messages)."""
    if name.startswith("hub:"):
        return _hub_rows(name)
    path = Path(name)
    if not path.exists():
        path = Path(data_dir) / (name if name.endswith((".json", ".jsonl")) else f"{name}.json")
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:  # pragma: no cover - datasets is a requirement
            raise DataFormatError(f"{path}: reading a datasets folder needs the datasets package") from None
        data = load_from_disk(str(path))
        if isinstance(data, dict):  # a DatasetDict (saved from load_dataset): its train split, or its only one
            splits = list(data)
            if "train" not in splits and len(splits) != 1:
                raise DataFormatError(f"{path}: a dataset of splits {splits} has no 'train' split; save the split "
                                      "to train on")
            data = data["train" if "train" in splits else splits[0]]
        rows = [dict(r) for r in data]
        if not rows:
            raise DataFormatError(f"{path}: the dataset has no rows")
        return [_check_row(r, str(path), i) for i, r in enumerate(rows)]
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {name!r} not found (looked for {path}); see data/README.md")
    if path.suffix not in (".json", ".jsonl"):
        raise DataFormatError(f"{path}: SFT data must be .json, .jsonl or a datasets folder")
    raw = read_raw_rows(path)
    if not raw:
        raise DataFormatError(f"{path}: the dataset has no rows")
    return [_check_row(r, str(path), i) for i, r in enumerate(raw)]


def _hub_rows(name: str) -> list[dict]:
    """Rows of ``hub:<org>/<name>[:<split>]`` from the ``datasets`` cache (downloaded there when online)."""
    repo, _, split = name[len("hub:"):].partition(":")
    if repo.count("/") != 1:
        raise DataFormatError(f"{name}: expected hub:<org>/<name>[:<split>]")
    from datasets import load_dataset

    from data.hub import cache_only, unreachable_hub

    # Without a network, datasets retries the hub for about half a minute before it reads its cache: a few seconds'
    # probe decides first, and an unreachable hub leaves the cache only.
    unreachable = unreachable_hub()
    try:
        with cache_only() if unreachable else nullcontext():
            rows = [dict(r) for r in load_dataset(repo, split=split or "train")]
    except Exception as exc:  # noqa: BLE001 - offline and not cached, unknown split, ...: one line with the cause
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if unreachable:
            cause = f"{unreachable}; from the datasets cache only: {cause}"
        raise DataFormatError(f"{name}: could not load the hub dataset ({cause}); download it once with network "
                              "access or use a local file") from None
    if not rows:
        raise DataFormatError(f"{name}: the dataset has no rows")
    return [_check_row(r, name, i) for i, r in enumerate(rows)]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")  # chat templates' roles


def _check_row(row: Any, where: str, i: int) -> dict:
    """The row, validated; chat contents given as lists of text parts (OpenAI's form) come back as strings."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: row {i}: expected an object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                             and "content" in m for m in msgs):
            raise DataFormatError(f"{where}: row {i}: field 'messages': expected a list of {{role, content}} with "
                                  "string roles")
        if unknown := next((m["role"] for m in msgs if m["role"] not in CHAT_ROLES), None):
            raise DataFormatError(f"{where}: row {i}: field 'messages': unknown role {unknown!r} (roles: "
                                  f"{', '.join(CHAT_ROLES)})")
        if msgs[-1]["role"] != "assistant":
            raise DataFormatError(f"{where}: row {i}: field 'messages': the last message must be the assistant's")
        if len(msgs) < 2:
            raise DataFormatError(f"{where}: row {i}: field 'messages': the assistant's message needs a message "
                                  "before it to answer (a prompt)")
        row = {**row, "messages": [{**m, "content": _content_text(m["content"], where, i, j)}
                                   for j, m in enumerate(msgs)]}
        if not row["messages"][-1]["content"].strip():
            raise DataFormatError(f"{where}: row {i}: field 'messages': the assistant's message is empty")
    else:
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataFormatError(f"{where}: row {i}: field '{key}': expected a non-empty string")
    steps = row.get("step_map")
    if steps is not None and (not isinstance(steps, list) or not all(type(s) is int and s >= 0 for s in steps)):
        raise DataFormatError(f"{where}: row {i}: field 'step_map': expected a list of non-negative integers")
    return row


def _content_text(content: Any, where: str, i: int, j: int) -> str:
    """A chat message's text: a string, or the text parts of a list of content parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise DataFormatError(f"{where}: row {i}: field 'messages': message {j}'s content must be a string or a list of "
                          f"{{type: text, text}} parts, got {type(content).__name__}")


def build_samples(rows: list[dict], adapter: Adapter, where: str) -> list[Trajectory]:
    """Token-level samples (prompt ids, response ids closed by the turn-end token, step map)."""
    end = turn_end_id(adapter)
    tok = adapter.tokenizer
    # a prompt rendered with a chat template already starts with one of its special tokens (<|im_start|>, BOS);
    # one that only mentions a special token's spelling is a plain question and gets the template
    specials = tuple(t for t in tok.all_special_tokens if t not in (tok.mask_token,))
    out = []
    for i, row in enumerate(rows):
        if "question" in row and "prompt" not in row and "messages" not in row:  # a built-in task's row: the
            # prompt the RL and eval jobs render (a row with its own prompt keeps it, whatever else it carries)
            prompt = prompt_ids(adapter, row, "math")
            text, steps = row["response"], None
        elif "messages" in row:
            prompt = adapter.encode_chat(row["messages"][:-1])
            text, steps = row["messages"][-1]["content"], row.get("step_map")
        else:
            templated = row["prompt"].startswith(specials)
            prompt = tok.encode(row["prompt"], add_special_tokens=False) if templated else \
                adapter.encode_chat([{"role": "user", "content": row["prompt"]}])
            text, steps = row["response"], row.get("step_map")
        closing = tok.convert_ids_to_tokens(end)
        if closing and text.rstrip().endswith(closing):  # closed in the text: the turn end itself, not its spelling
            text = text.rstrip()[:-len(closing)]
            if not text.strip():
                raise DataFormatError(f"{where}: row {i}: the response is only the turn end {closing!r}: nothing to "
                                      "train on")
        resp = adapter.encode_text(text)
        if steps is not None and min(steps, default=1) == 0:  # snapshot indices from 0 (Dream / LLaDA samplers)
            steps = [s + 1 for s in steps]
        if not resp or resp[-1] != end:  # close the turn; without a step of its own the turn end decodes last
            resp.append(end)
            if steps is not None and len(steps) == len(resp) - 1:
                steps = [*steps, max(steps, default=0) + 1]
        if steps is not None and len(steps) != len(resp):
            raise DataFormatError(f"{where}: row {i}: field 'step_map': {len(steps)} steps for {len(resp)} response "
                                  "tokens")
        out.append(sft_sample(prompt, resp, f"r{i}", steps))
    return out


# ------------------------------------------------------------------------------------------ the job

# Keys that may change when a run is resumed (the rest must match its config.yaml): how long it runs, how often it
# saves, where it lives. Its optimizer, schedule and data order were saved for the rest.
RESUMABLE_CHANGES = ("experiment.start_from_scratch", "experiment.overwrite", "experiment.output_dir",
                     "experiment.project", "training.max_steps", "training.num_train_epochs", "training.save_every")
# keys whose default became null, meaning these values (as runs saved before wrote them, and as null is read)
FORMER_DEFAULTS = {"dataset.builtin_size": 2000, "dataset.builtin_difficulty": 1}


class SFTJob:
    def __init__(self, cfg: Any, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        self.root = Path(cfg.experiment.output_dir) / cfg.experiment.project
        self.last = self.root / "ckpt" / "last"
        self.lock: RunLock | None = None

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def prepare(self) -> int:
        """Run directory, model, data, trainer; returns the first optimiser step to run (0-based)."""
        cfg, t = self.cfg, self.cfg.training
        cfg.system.apply()
        self.acc = accelerator_for(t)
        self.main = is_main(self.acc)
        if self.main:
            self.lock = RunLock(self.root)  # released by the OS when this process ends
        resume = self._check_run_dir()
        if self.main and not resume:
            ensure_demo_model(cfg.model)
        barrier(self.acc)
        self.adapter = load_policy(cfg.model, cfg.lora, self.last / "policy" if resume else None,  # LoRA: lora.py
                                   default_device())
        self.samples = self._samples()
        self.bounds = step_bounds(len(self.samples), t.samples_per_step, self.acc.num_processes)
        self.steps_per_epoch = len(self.bounds)
        self.total = t.max_steps or self.steps_per_epoch * t.num_train_epochs
        if cfg.optimizer.name != "adamw":
            raise RunDirError(f"optimizer.name {cfg.optimizer.name!r} is not supported")
        # the job deals the epochs and steps (one pass of the trainer per step: num_train_epochs is not its too)
        self.trainer = SFTTrainer(self.adapter, replace(t, samples_per_step=None, num_train_epochs=1),
                                  cfg.optimizer.params,
                                  cfg.lr_scheduler, total_steps=self.total, accelerator=self.acc)
        first = 0
        if resume:  # checked before the checkpoint is loaded (which notes a fresh optimizer on another world)
            first = self._resumed_step(json.loads((self.last / "trainer" / "loop.json").read_text()))
            load_checkpoint(self.trainer, self.last)
        else:  # every setup check passed: only now may an overwritten run go
            empty_run_dir(self.root, self.acc)
        if self.main:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / "config.yaml", config_text(cfg))
        barrier(self.acc)
        return first

    def _resumed_step(self, loop: dict) -> int:
        """The saved step, refused where continuing from it would train other rows or relabel the weights."""
        t, step, saved_world = self.cfg.training, int(loop["step"]), loop.get("num_processes")
        if step > self.total:
            raise RunDirError(f"{self.last} holds step {step}, past this run's last step {self.total} "
                              "(training.max_steps / num_train_epochs): raise it to continue, or start a new run")
        if t.samples_per_step and saved_world != self.acc.num_processes:  # a step's rows depend on the world size
            raise RunDirError(f"{self.last} was saved by {saved_world} process(es) and training.samples_per_step "
                              f"counts rows per process: resume with {saved_world} process(es) (now "
                              f"{self.acc.num_processes}), or the data order would skip or repeat rows")
        return step

    def _check_run_dir(self) -> bool:
        exp = self.cfg.experiment
        if not exp.start_from_scratch:
            if self.main:
                self._recover_last()
            barrier(self.acc)
            problem = checkpoint_problem(self.last)
            if problem is not None:
                raise RunDirError(f"nothing to resume in {self.root}: the checkpoint {self.last} cannot be resumed "
                                  f"({problem})")
            check_resumed_config(self.root, self.cfg, RESUMABLE_CHANGES, FORMER_DEFAULTS)
            return True
        check_fresh_run_dir(self.root, exp.overwrite)  # emptied after the setup
        return False

    def _samples(self) -> list[Trajectory]:
        d, t = self.cfg.dataset, self.cfg.training
        if d.optimization_data.startswith("builtin:"):
            size = d.builtin_size or FORMER_DEFAULTS["dataset.builtin_size"]
            difficulty = d.builtin_difficulty or FORMER_DEFAULTS["dataset.builtin_difficulty"]
            rows = builtin_rows(d.optimization_data, size, self.cfg.experiment.seed, difficulty)
        else:
            rows = read_rows(d.optimization_data)
        samples = build_samples(rows, self.adapter, d.optimization_data)
        for s in samples:  # the block size the views train with (None: the model's own)
            s.block_size = t.block_size
        too_long = [s.sample_id for s in samples if t.max_prompt_len and len(s.prompt_ids) > t.max_prompt_len]
        skipped = set(too_long)
        if too_long and self.main:
            print(f"note: {len(too_long)} of {len(samples)} rows have prompts over training.max_prompt_len "
                  f"({t.max_prompt_len}) and are skipped: {too_long[:5]}", flush=True)
        kept = [s for s in samples if s.sample_id not in skipped]
        cut = sum(t.max_gen_length is not None and len(s.response_ids) > t.max_gen_length for s in kept)
        if cut and self.main:  # the trainer cuts them (their turn end untrained): say so, never silently
            print(f"note: {cut} of {len(kept)} responses are longer than training.max_gen_length "
                  f"({t.max_gen_length}) and are cut there (the model never learns to end them)", flush=True)
        limit = self.adapter.position_limit  # past it the model would train at positions it was never built for
        trained_len = [len(s.prompt_ids) + min(len(s.response_ids), t.max_gen_length or len(s.response_ids))
                       for s in kept]
        beyond = [s.sample_id for s, n in zip(kept, trained_len) if limit is not None and n > limit]
        if beyond and self.main:
            print(f"note: {len(beyond)} of {len(kept)} rows are longer than the model's {limit} positions (prompt "
                  f"and response) and are skipped: {beyond[:5]}", flush=True)
        skip = set(beyond)
        kept = [s for s in kept if s.sample_id not in skip]
        if not kept:
            positions = f" and the model's {limit} positions" if limit is not None else ""
            raise DataFormatError(f"{d.optimization_data}: no row fits training.max_prompt_len{positions}")
        return kept

    def batch(self, step: int) -> list[Trajectory]:
        """The samples of optimiser step ``step``: epochs in a seeded order, cut into ``samples_per_step``."""
        t = self.cfg.training
        epoch, k = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.samples)))
        if t.shuffle:
            random.Random(f"sft-{t.seed}-{epoch}").shuffle(order)
        start, end = self.bounds[k]
        return [self.samples[i] for i in order[start:end]]

    def run(self, first: int) -> Path:
        t, out = self.cfg.training, self.root / "ckpt" / self.cfg.model.optimized_name
        bar = tqdm(total=self.total, initial=first, desc="sft", unit="step", disable=not (self.progress and self.main))
        history = self._history()[:first]
        for step in range(first, self.total):
            metrics = self.trainer.train_samples(self.batch(step))
            m = metrics[-1] if metrics else {}
            line = {"step": step + 1, "loss": m.get("loss", 0.0), "lr": m.get("lr", 0.0),
                    "nll": m.get("nll_sum", 0.0) / max(m.get("tokens", 0.0), 1.0), "tokens": m.get("tokens", 0.0)}
            history.append(line)
            bar.update(1)
            bar.set_postfix(nll=f"{line['nll']:.3f}")
            if t.save_every and (step + 1) % t.save_every == 0 and step + 1 < self.total:
                self._save(step + 1, history)
        bar.close()
        self._save(self.total, history)
        if self.main:
            with self._disk_full_as_error(out):
                if out.exists():
                    shutil.rmtree(out)
                # hard links: the final model is a folder of its own that takes no second copy of the weights
                shutil.copytree(self.last / "policy", out, copy_function=_link_or_copy)
        barrier(self.acc)
        return out

    def _history(self) -> list[dict]:
        path = self.root / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def _save(self, step: int, history: list[dict]) -> None:
        tmp = self.root / "ckpt" / "last.partial"
        with self._disk_full_as_error(tmp):
            if self.main and tmp.exists():
                shutil.rmtree(tmp)
            barrier(self.acc)
            save_checkpoint(self.trainer, tmp, {"step": step})
            if self.main:
                write_atomic(self.root / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
                # two renames, then the old copy goes: a kill at any point leaves a complete checkpoint that
                # resume finds (_recover_last)
                old = self.root / "ckpt" / "last.old"
                remove_checkpoint(old)
                if self.last.exists():
                    self.last.rename(old)
                tmp.rename(self.last)
                remove_checkpoint(old)
        barrier(self.acc)

    def _recover_last(self) -> None:
        """Put back ``ckpt/last`` when a kill came between the renames of :meth:`_save`: the newest complete of
        ``last.partial`` (the step being saved) and ``last.old`` (the one before) takes its place."""
        if is_complete(self.last):
            return
        for name in ("last.partial", "last.old"):
            candidate = self.root / "ckpt" / name
            if is_complete(candidate):
                remove_checkpoint(self.last)
                candidate.rename(self.last)
                return

    @contextmanager
    def _disk_full_as_error(self, where: Path):
        """A full disk while writing ``where``: remove the unfinished folder, one line naming it and the size."""
        try:
            yield
        except Exception as err:  # writers report a full disk as OSError, RuntimeError or SafetensorError
            if not disk_full(err, where):
                raise
            if self.main:  # the other ranks may still be writing their shards into it
                shutil.rmtree(where, ignore_errors=True)
            raise disk_full_error(where, tree_bytes(self.last) or None) from None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(src, dst)


def run_sft(cfg: Any, progress: bool = True) -> Path:
    """Train ``cfg.model`` with SFT; returns the folder of the final model."""
    job = SFTJob(cfg, progress)
    try:
        first = job.prepare()
        if job.main:
            print(f"sft: {len(job.samples)} samples, steps {first + 1}..{job.total}, run directory {job.root}",
                  flush=True)
        history = job.run(first)
    except KeyboardInterrupt as err:
        err.detail = (f"{job.last} holds the last saved step (training.save_every); continue with "
                      "experiment.start_from_scratch=false") if job.last.is_dir() else \
            f"no checkpoint was saved in {job.root}; start again with experiment.overwrite=true"
        raise
    finally:
        job.close()
    end_processes(job.acc)
    return history
