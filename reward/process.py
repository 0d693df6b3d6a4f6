"""Process reward: a judge LLM grades chunks of each response; the grades become per-token rewards placed by the
decoding order, which the value model turns into step-level advantages.

The pipeline of the TraceRL paper (arXiv 2509.06949; the reference Gen-Verse/dLLM-RL, sample/llm_process_reward.py
and reward/rl_process_reward.py), math tasks only:

1. A response of L tokens is cut into ``ceil(L / chunk_length)`` chunks. For chunk k the judge sees the question,
   the ground-truth answer, the whole response with its outcome (correct or not) and an excerpt, and answers with
   ``\\boxed{1}`` (correct) or ``\\boxed{-1}``; ``k_sample`` judgments per chunk. Anything else parses to 0 (counted).
2. A chunk's grade: the common value when all its judgments agree, else +1 / -1 by the response's outcome. Then,
   per task and chunk index, grades are z-scored across the task's responses that have that chunk (a lone value
   stays as it is; equal values become 0).
3. Token rewards are 0 except: a non-final chunk's grade goes to the tokens decoded last (largest step id) among
   the ``block_size`` tokens ending at the chunk's end; the final chunk's grade to the tokens of the response's
   largest step id.

The excerpt: the reference sends the whole prefix up to the chunk's end while its prompt asks to grade "a middle
part". ``excerpt: chunk`` (our default) sends the chunk alone, as the prompt says: with the prefix, every chunk
after an early mistake inherits it and is graded -1, so the grades stop saying which part went wrong.
``excerpt: prefix`` reproduces the reference. The excerpt is decoded from the sampled token ids themselves (the
reference re-tokenises the decoded text, which can shift chunk boundaries).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core.schema import Settings, bounded

log = logging.getLogger(__name__)

Judge = Callable[[list[list[dict]]], list[str]]  # chat conversations -> one completion each


@dataclass
class ProcessRewardConfig(Settings):
    """The ``process_reward`` section of RL configs (the reference's ``rollout.reward_model``); enabled by
    ``model.process_reward_model``."""

    chunk_length: int = bounded(200, 1)  # tokens per graded chunk (the reference's reward_chunk_length)
    k_sample: int = bounded(3, 1)  # judgments per chunk
    temperature: float = bounded(0.6, 0.0)
    top_p: float = bounded(0.95, 0.0, 1.0, lo_open=True)
    max_new_tokens: int = bounded(10000, 1)  # the judge's budget per judgment (max_generation_token)
    max_model_len: int = bounded(15000, 1)  # judge prompt + answer; longer prompts are refused with one line
    excerpt: Literal["chunk", "prefix"] = "chunk"  # see reward/process.py: "prefix" is the reference's behaviour
    # an OpenAI-compatible endpoint (vLLM, SGLang, serve.py) serving model.process_reward_model; null = a local
    # Hugging Face causal LM at that path, run in this process
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key (unset: no key)
    timeout: float = bounded(300.0, 0.0, lo_open=True)  # seconds per request
    retries: int = bounded(4, 0)  # a failing request is retried with exponential backoff, then the run stops
    # requests in flight (endpoint; may change on resume) / prompts per batch (local judge: fixed for a run, since
    # a batch's padding and seed change the answers)
    concurrency: int = bounded(16, 1)


# ------------------------------------------------------------------------------------------ prompt and parsing

_INSTRUCTIONS = (
    "Below are a math question, its ground-truth final answer, a complete solution written by a student "
    "(known to be {outcome}) and an excerpt taken from that solution. Grade only the excerpt: answer 1 if "
    "everything in it is correct, or -1 if it contains an error, an unjustified step or a contradiction. Use "
    "the question and the whole solution as context. The excerpt was cut at fixed token positions, so it may "
    "start or end mid-sentence: do not count that against it, and ignore wording issues that do not affect "
    "correctness.\n\n"
    "Question:\n{question}\n\n"
    "Ground-truth final answer:\n{answer}\n\n"
    "Complete solution ({outcome}):\n{solution}\n\n"
    "Excerpt to grade:\n{excerpt}\n\n"
    "Put your grade (1 or -1) in \\boxed{{}}."
)


def judge_messages(question: str, answer: str, solution: str, correct: bool, excerpt: str) -> list[dict]:
    """The chat the judge answers (rendered with the judge's own chat template)."""
    outcome = "correct" if correct else "incorrect"
    text = _INSTRUCTIONS.format(outcome=outcome, question=question, answer=answer, solution=solution,
                                excerpt=excerpt)
    return [{"role": "system", "content": "You are a careful grader of math solutions."},
            {"role": "user", "content": text}]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def parse_grade(text: str) -> float | None:
    """1.0 / -1.0 for ``\\boxed{1}`` / ``\\boxed{-1}`` (the last box), None for anything else."""
    box = last_boxed(text)
    box = box.strip() if box is not None else None
    return {"1": 1.0, "-1": -1.0}.get(box) if box is not None else None


# ------------------------------------------------------------------------------------------ chunks and grades


def chunk_ends(length: int, chunk_length: int) -> list[int]:
    """End positions (exclusive) of a response's chunks: ``ceil(length / chunk_length)`` of them, at least one."""
    n = max(1, math.ceil(length / chunk_length))
    return [min(length, (k + 1) * chunk_length) for k in range(n)]


def excerpt_span(k: int, length: int, chunk_length: int, mode: str) -> tuple[int, int]:
    """Token span [start, end) shown to the judge for chunk ``k``."""
    end = chunk_ends(length, chunk_length)[k]
    return (0 if mode == "prefix" else k * chunk_length), end


def chunk_grade(judgments: Sequence[float], correct: bool) -> float:
    """All judgments equal: that value; otherwise the response's outcome as +1 / -1."""
    return float(judgments[0]) if len(set(judgments)) == 1 else (1.0 if correct else -1.0)


def zscore(values: Sequence[float]) -> list[float]:
    """Population z-scores; a single value is kept, equal values become 0."""
    if len(values) == 1:
        return [float(values[0])]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [0.0] * len(values) if std == 0 else [(v - mean) / std for v in values]


def normalise_per_chunk(grades: dict[str, list[float]], groups: dict[str, list[str]]) -> dict[str, list[float]]:
    """Z-score chunk k's grades across the responses of a group that have a chunk k."""
    out = {sid: list(g) for sid, g in grades.items()}
    for members in groups.values():
        for k in range(max(len(grades[sid]) for sid in members)):
            having = [sid for sid in members if k < len(grades[sid])]
            for sid, z in zip(having, zscore([grades[sid][k] for sid in having]), strict=True):
                out[sid][k] = z
    return out


def place_token_rewards(step_map: Sequence[int], grades: Sequence[float], chunk_length: int,
                        block_size: int) -> list[float]:
    """Per-token rewards of one response from its chunk grades (see the module docstring, step 3)."""
    rewards = [0.0] * len(step_map)
    ends = chunk_ends(len(step_map), chunk_length)
    for k, (end, grade) in enumerate(zip(ends, grades, strict=True)):
        start = 0 if k == len(ends) - 1 else max(0, end - block_size)
        window = range(start, end) if k < len(ends) - 1 else range(len(step_map))
        if not window:
            continue
        last = max(step_map[i] for i in window)
        for i in window:
            if step_map[i] == last:
                rewards[i] = grade
    return rewards


# ------------------------------------------------------------------------------------------ the pipeline


@dataclass
class ProcessRewards:
    """Per-token rewards by sample id, and what the judge did."""

    token_rewards: dict[str, list[float]]
    chunk_grades: dict[str, list[float]] = field(default_factory=dict)  # after normalisation
    judgments: int = 0
    unparseable: int = 0

    def metrics(self) -> dict[str, float]:
        return {"judgments": float(self.judgments), "judge_unparseable": float(self.unparseable)}


def process_rewards(samples: Sequence[Any], tasks: Sequence[dict], decode: Callable[[list[int]], str],
                    judge: Judge, cfg: ProcessRewardConfig, block_size: int) -> ProcessRewards:
    """Grade every sample's chunks with ``judge`` and place the grades on its tokens.

    ``samples``: trajectories (``sample_id``, ``group_id``, ``task_index``, ``response_ids``, ``step_map``,
    ``correct``); ``tasks[task_index]`` holds ``question`` and ``ground_truth_answer``; ``decode`` turns token
    ids into text (special tokens skipped).
    """
    chats, owners = [], []
    for s in samples:
        task, ids = tasks[s.task_index], list(s.response_ids)
        solution = decode(ids)
        for k in range(len(chunk_ends(len(ids), cfg.chunk_length))):
            start, end = excerpt_span(k, len(ids), cfg.chunk_length, cfg.excerpt)
            chat = judge_messages(task["question"], str(task["ground_truth_answer"]), solution, bool(s.correct),
                                  decode(ids[start:end]))
            chats += [chat] * cfg.k_sample
            owners += [(s.sample_id, k)] * cfg.k_sample
    answers = judge(chats) if chats else []
    if len(answers) != len(chats):
        raise RuntimeError(f"the judge returned {len(answers)} answers for {len(chats)} prompts")
    parsed = [parse_grade(a) for a in answers]
    unparseable = sum(p is None for p in parsed)
    if unparseable:
        log.warning("process reward: %d of %d judgments had no \\boxed{1} / \\boxed{-1} (counted as 0)",
                    unparseable, len(parsed))
    votes: dict[tuple[str, int], list[float]] = {}
    for owner, p in zip(owners, parsed, strict=True):
        votes.setdefault(owner, []).append(0.0 if p is None else p)
    by_id = {s.sample_id: s for s in samples}
    grades = {s.sample_id: [] for s in samples}
    for (sid, _chunk), v in sorted(votes.items()):  # chunk order within a sample
        grades[sid].append(chunk_grade(v, bool(by_id[sid].correct)))
    groups: dict[str, list[str]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s.sample_id)
    grades = normalise_per_chunk(grades, groups)
    token_rewards = {sid: place_token_rewards(by_id[sid].step_map, g, cfg.chunk_length, block_size)
                     for sid, g in grades.items()}
    return ProcessRewards(token_rewards, grades, len(parsed), unparseable)
