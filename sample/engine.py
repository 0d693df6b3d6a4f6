"""The sampling loop both samplers share: waiting queue, admission, one step at a time, retirement, trajectories.

As in nano-vllm's scheduler, the engine owns the queue of waiting sequences and admits as many as the batch has
room for (``max_active``) before every step; a finished sequence leaves at once and a waiting one takes its place
(continuous batching). A sampler supplies only what differs between block and full-attention decoding:

* ``check_prompt(index, prompt) -> budget``: response tokens allowed (a clear error when the prompt cannot fit),
* ``admit(sequences)``: put new sequences into the batch (prefill, canvas),
* ``step() -> list[Finished]``: one forward of every running sequence; the sequences that finished in it,
* ``running``: the sequences in the batch, ``stats``: its ``RolloutStats``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from sample.trajectory import Trajectory


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


class Sampler(Protocol):
    running: list[Any]
    stats: RolloutStats

    def check_prompt(self, index: int, prompt: list[int]) -> int: ...

    def admit(self, sequences: list[Sequence]) -> None: ...

    def step(self) -> list[Finished]: ...


def run_engine(sampler: Sampler, prompts: Seq[Seq[int]], max_active: int, tokenizer: Any = None,
               on_finish: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Sample every prompt with ``sampler``; trajectories in prompt order."""
    waiting = deque(Sequence(i, list(p), sampler.check_prompt(i, list(p))) for i, p in enumerate(prompts))
    results: list[Trajectory | None] = [None] * len(waiting)
    while waiting or sampler.running:
        free = max_active - len(sampler.running)
        if free > 0 and waiting:
            sampler.admit([waiting.popleft() for _ in range(min(free, len(waiting)))])
        for done in sampler.step():
            traj = trajectory(done, tokenizer)
            sampler.stats.generated_tokens += len(done.response)
            results[done.seq.index] = traj
            if on_finish is not None:
                on_finish(traj)
    return results  # type: ignore[return-value]


def trajectory(done: Finished, tokenizer: Any = None) -> Trajectory:
    text = tokenizer.decode(done.response, skip_special_tokens=False) if tokenizer is not None else ""
    return Trajectory(prompt_ids=done.seq.prompt, response_ids=done.response, step_map=done.steps,
                      logprobs=done.logprobs, finish_reason=done.reason, text=text, confidences=done.confidences,
                      tail_ids=list(done.tail_ids), tail_steps=list(done.tail_steps), block_size=done.block_size)
