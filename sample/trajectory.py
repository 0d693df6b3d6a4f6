"""The Trajectory: the one record that flows from sampling to rewards, training and the trace viewer.

Token ids are stored exactly as generated (never re-tokenised text), so training reproduces the sampler's states.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from core.files import replacing

FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class Trajectory:
    """One sampled response and how it was decoded.

    ``step_map[i]`` is the (1-based, per-sequence, global across blocks) denoising step at which response token
    ``i`` was unmasked; several tokens may share a step. ``logprobs[i]`` is the model's log-probability of that
    token (plain softmax of the logits, temperature 1, no top-k/p) in the exact context it was committed in, which
    is what the trainer recomputes. Tokens decoded inside the final block after the stop point are cut from the
    response; ``tail_ids``/``tail_steps`` keep them (never trained) so the training view can rebuild the final
    block's contexts exactly. For full-attention models the tail is the whole rest of the canvas after the cut;
    positions that were never decoded are stored as the mask id with step = the row's last step + 1 (masked in
    every training round).

    Token editing (LLaDA2.1): a token may be written more than once. ``step_map[i]``, ``logprobs[i]`` and
    ``confidences[i]`` are then those of its LAST write, and ``rewrites[i]`` counts the earlier writes it replaced
    (empty list: nothing was rewritten). Training views treat a rewritten token as masked until its last write, so
    the states they rebuild are not exactly the sampler's (which held the earlier token there): such a view is
    inexact and its old log-probs are recomputed.

    ``cached_logprobs``: the log-probs were computed against a cache that approximates the context (a full-attention
    model sampled with cache="prefix" / "dual", Fast-dLLM's), not in the exact context: a view of such a sample is
    inexact too, and its old log-probs are recomputed.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    step_map: list[int]
    logprobs: list[float]  # [] = not recorded (an SFT sample from data): training sees NaN old log-probs
    finish_reason: str = "length"
    text: str = ""  # the response decoded, without the final stop token (response_ids keep it)
    confidences: list[float] = field(default_factory=list)
    tail_ids: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    block_size: int | None = None  # block size used when sampling (None for full attention without blocks)
    sample_id: str = ""  # unique in a run: "{task_index}-{response}" for jobs/
    group_id: str = ""  # the sample's prompt group (responses to the same task share it)
    task_index: int = -1  # row of the dataset / step's task list this sample answers
    score: float | None = None  # set once by the reward: answer correctness or test pass fraction, in [0, 1]
    meta: dict = field(default_factory=dict)
    rewrites: list[int] = field(default_factory=list)  # token editing: earlier writes replaced, per token
    cached_logprobs: bool = False  # log-probs from an approximating cache (full attention, cache prefix / dual)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.step_map) != n or len(self.logprobs) not in (0, n):
            raise ValueError(
                f"trajectory {self.sample_id!r}: response has {n} tokens but step_map has {len(self.step_map)} "
                f"and logprobs {len(self.logprobs)}"
            )
        if self.confidences and len(self.confidences) != n:
            raise ValueError(f"trajectory {self.sample_id!r}: confidences length {len(self.confidences)} != {n}")
        if self.rewrites and len(self.rewrites) != n:
            raise ValueError(f"trajectory {self.sample_id!r}: rewrites length {len(self.rewrites)} != {n}")
        if len(self.tail_ids) != len(self.tail_steps):
            raise ValueError(f"trajectory {self.sample_id!r}: tail_ids and tail_steps differ in length")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"trajectory {self.sample_id!r}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}"
            )

    @property
    def correct(self) -> bool:
        """Fully correct: the right answer, or every test passed."""
        return self.score is not None and self.score >= 1.0


    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> Trajectory:
        known = {f.name for f in fields(cls)}
        unknown = set(row) - known
        if unknown:
            names = sorted(unknown)
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ValueError(f"unknown trajectory field(s) {names[:3]}{more}")
        return cls(**row)


def tokens_per_step(step_maps: Iterable[Sequence[int]]) -> float:
    """Mean over responses of response tokens / the denoising steps that wrote them (distinct values of the step
    map): the per-sequence parallelism of a dLLM decoder. Counting batched forwards instead
    (``RolloutStats.tokens_per_forward``) grows with the batch size."""
    ratios = [len(steps) / len(set(steps)) for steps in step_maps if len(steps)]
    return sum(ratios) / len(ratios) if ratios else 0.0


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> None:
    """Write one JSON object per line; written to a temp file and renamed so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with replacing(tmp, path):
        with tmp.open("w", encoding="utf-8") as f:
            for t in trajectories:
                f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")
        tmp.replace(path)


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    """Read trajectories; a malformed line is an error naming the file and line number."""
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_dict(json.loads(line))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad trajectory: {e}") from None
