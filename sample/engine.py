"""The sampling loop both samplers share: waiting queue, admission, one step at a time, retirement, trajectories.

As in nano-vllm's scheduler, the engine owns the queue of waiting sequences and admits as many as the batch has
room for (``max_active``) before every step; a finished sequence leaves at once and a waiting one takes its place
(continuous batching). A sampler supplies only what differs between block and full-attention decoding:

* ``check_prompt(index, prompt) -> budget``: response tokens allowed (a clear error when the prompt cannot fit),
* ``admit(sequences)``: put new sequences into the batch (prefill, canvas),
* ``step() -> list[Finished]``: one forward of every running sequence; the sequences that finished in it,
* ``running``: the sequences in the batch, ``stats``: its ``RolloutStats``,
* ``drop(rows)``: remove running sequences (by their row in ``running``) without a result (a cancelled request),
* ``committed() -> {index: response ids}``: each running sequence's final response prefix (for streaming).

:class:`Engine` holds the waiting queue; ``run_engine`` (``generate``) adds every prompt up front and steps until
all are done, a server (jobs/serve_engine.py) adds and cancels sequences between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from core.errors import UserError
from sample.trajectory import Trajectory


class PromptTooLongError(UserError, ValueError):
    """A prompt leaves no room for a response below the model's position limit."""


@dataclass
class RolloutStats:
    """Throughput counters of one sampling run (filled by the sampler, wall time by ``generate``)."""

    forwards: int = 0  # model forward calls of any kind (prefill, denoising, cache refresh)
    denoise_forwards: int = 0  # forwards in which at least one sequence denoised
    generated_tokens: int = 0  # response tokens of finished sequences (tails excluded)
    wall_time: float = 0.0  # seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second,
                "tokens_per_forward": self.tokens_per_forward}


@dataclass
class Sequence:
    """One prompt in flight: its place in the prompt order, its tokens and its response budget."""

    index: int
    prompt: list[int]
    budget: int


@dataclass
class Finished:
    """What a sampler reports of a sequence that finished: the response and how it was decoded."""

    seq: Sequence
    response: list[int]
    steps: list[int]
    logprobs: list[float]
    confidences: list[float]
    reason: str  # eos | stop | length
    block_size: int
    tail_ids: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    rewrites: list[int] = field(default_factory=list)  # token editing: writes replaced per token ([] = none)
    cached_logprobs: bool = False  # the log-probs came from a cache that approximates the context (Trajectory)


class Sampler(Protocol):
    running: list[Any]
    stats: RolloutStats

    def check_prompt(self, index: int, prompt: list[int]) -> int: ...

    def admit(self, sequences: list[Sequence]) -> None: ...  # all or nothing: raising, it leaves the batch as it was

    def step(self) -> list[Finished]: ...

    def drop(self, rows: list[int]) -> None: ...

    def committed(self) -> dict[int, list[int]]: ...


class Engine:
    """A sampler's batch plus its waiting queue: sequences join the queue at any time, are admitted before a step
    while the batch has room (``max_active``), and leave when finished or cancelled. Not thread-safe: one thread
    calls every method (a server's driver thread)."""

    def __init__(self, sampler: Sampler, max_active: int):
        self.sampler, self.max_active = sampler, max_active
        self.waiting: deque[Sequence] = deque()
        # the sequences whose admission raised in the last step (back at the head of ``waiting``; the running
        # batch is as it was): a server fails their requests only
        self.failed_admission: list[Sequence] = []

    @property
    def busy(self) -> bool:
        """Sequences wait or run."""
        return bool(self.waiting or self.sampler.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, index: int) -> bool:
        """Remove the sequence ``index`` (waiting or running); False when it is not here (already finished)."""
        for seq in self.waiting:
            if seq.index == index:
                self.waiting.remove(seq)
                return True
        rows = [i for i, r in enumerate(self.sampler.running) if r.seq.index == index]
        if rows:
            self.sampler.drop(rows)
        return bool(rows)

    def step(self) -> list[Finished]:
        """Admit waiting sequences while there is room, run one step; the sequences that finished in it."""
        free = self.max_active - len(self.sampler.running)
        self.failed_admission = []
        if free > 0 and self.waiting:
            admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            try:
                self.sampler.admit(admitted)
            except BaseException:  # back in the queue: whoever handles the failure still finds them (a server
                self.waiting.extendleft(reversed(admitted))  # fails their requests instead of leaving them hanging)
                self.failed_admission = admitted
                raise
        if not self.sampler.running:
            return []
        finished = self.sampler.step()
        self.sampler.stats.generated_tokens += sum(len(done.response) for done in finished)
        return finished


def append_rows(sampler: Any, rows: dict[str, Tensor]) -> None:
    """Append new rows to each per-row tensor attribute of ``sampler`` (``rows``: attribute name -> its rows); all
    or none of them (every concatenation is made before any attribute changes)."""
    grown = {name: torch.cat([getattr(sampler, name), new]) for name, new in rows.items()}
    for name, value in grown.items():
        setattr(sampler, name, value)


def first_rows(sampler: Any, names: Seq[str], rows: int) -> None:
    """Cut each per-row tensor attribute in ``names`` back to its first ``rows`` rows (a failed admission's undo)."""
    for name in names:
        setattr(sampler, name, getattr(sampler, name)[:rows])


def on_device(values: Any, device: torch.device | str, dtype: torch.dtype = torch.long) -> Tensor:
    """``values`` (numbers, or nested lists of them) as a tensor on ``device``, without making the host wait: a copy
    to a GPU from ordinary (pageable) host memory blocks until the device has drained its queue, one from pinned
    memory is queued like a kernel. On an H100 such copies (row indices, new rows) were most of a decode step's
    host syncs."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def keep_rows(sampler: Any, names: Seq[str], gone: Seq[int]) -> Tensor:
    """Remove the rows ``gone`` (indices into ``sampler.running``) from ``running`` and from each per-row tensor
    attribute in ``names``; the kept rows' index (on the sampler's device, for its cache)."""
    dropped = set(gone)
    kept = [i for i in range(len(sampler.running)) if i not in dropped]
    index = on_device(kept, sampler.device)
    sampler.running = [sampler.running[i] for i in kept]
    for name in names:
        setattr(sampler, name, getattr(sampler, name)[index])
    return index


def run_engine(sampler: Sampler, prompts: Seq[Seq[int]], max_active: int, tokenizer: Any = None,
               on_finish: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Sample every prompt with ``sampler``; trajectories in prompt order."""
    engine = Engine(sampler, max_active)
    for i, p in enumerate(prompts):
        engine.add(Sequence(i, list(p), sampler.check_prompt(i, list(p))))
    results: list[Trajectory | None] = [None] * len(engine.waiting)
    while engine.busy:
        for done in engine.step():
            traj = trajectory(done, tokenizer)
            results[done.seq.index] = traj
            if on_finish is not None:
                on_finish(traj)
    return results  # type: ignore[return-value]


def trajectory(done: Finished, tokenizer: Any = None) -> Trajectory:
    # the text leaves out the token that stopped the row (EOS, turn end, a stop id), as OpenAI's text leaves out
    # its stop sequence: rewards read the answer, and "The answer is 1/2<|im_end|>" is not "1/2"
    stopped = done.reason in ("eos", "stop") and bool(done.response)
    shown = done.response[:-1] if stopped else done.response
    text = tokenizer.decode(shown, skip_special_tokens=False) if tokenizer is not None else ""
    return Trajectory(prompt_ids=done.seq.prompt, response_ids=done.response, step_map=done.steps,
                      logprobs=done.logprobs, finish_reason=done.reason, text=text, confidences=done.confidences,
                      tail_ids=list(done.tail_ids), tail_steps=list(done.tail_steps), block_size=done.block_size,
                      rewrites=list(done.rewrites), cached_logprobs=done.cached_logprobs)
