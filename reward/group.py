"""Group-normalised rewards (Gen-Verse/dLLM-RL reward/rl_reward.py, rl_code_reward.py), keyed by sample id so nothing
can shift (the reference's trainer could shift them).

Every sample carries its own ``sample_id`` and its prompt's ``group_id``. Advantages come from a named estimator
(``ESTIMATORS``, chosen by ``reward.advantage``):

* ``grpo``: per-group z-scores with the population std (GRPO, arXiv 2402.03300; the reference's; std 0 -> zeros);
* ``dr_grpo``: the reward minus the group mean, no std division (Dr. GRPO, arXiv 2503.20783: the std rescales
  easy and hard prompts unequally);
* ``rloo``: the reward minus the mean of the group's other rewards (REINFORCE leave-one-out, arXiv 2402.14740),
  i.e. n / (n - 1) times the centred reward.

Filters drop whole groups (accuracy band, all-equal scores) and record why. Dropping a sample later
(``GroupResult.drop``) removes it without renormalising anybody else.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["ScoredSample", "GroupResult", "group_advantages", "code_score", "code_group_advantages", "overlong_penalty"]

STD_EPS = 1e-8


@dataclass(frozen=True)
class ScoredSample:
    """One response: its id, its prompt's id, its raw score and (optionally) whether it is fully correct."""

    sample_id: str
    group_id: str
    score: float
    correct: bool | None = None


@dataclass
class GroupResult:
    """Advantages of kept samples, the kept ids (input order), dropped ids with reasons, and a summary."""

    advantages: dict[str, float]
    kept: list[str]
    dropped: dict[str, str] = field(default_factory=dict)
    group_accuracy: dict[str, float] = field(default_factory=dict)

    def drop(self, sample_ids: Iterable[str], reason: str) -> GroupResult:
        """A copy without ``sample_ids`` (e.g. prompt too long); other samples keep their advantages."""
        gone = set(sample_ids)
        unknown = gone - set(self.advantages) - set(self.dropped)
        if unknown:
            raise KeyError(f"unknown sample ids: {sorted(unknown)[:5]}")
        dropped = dict(self.dropped)
        dropped.update({sid: reason for sid in self.kept if sid in gone})
        return GroupResult(
            advantages={k: v for k, v in self.advantages.items() if k not in gone},
            kept=[sid for sid in self.kept if sid not in gone],
            dropped=dropped,
            group_accuracy=dict(self.group_accuracy),
        )

    @property
    def summary(self) -> dict:
        """Counts for logging: samples kept/dropped, dropped samples per reason, mean group accuracy."""
        accs = list(self.group_accuracy.values())
        return {
            "samples": len(self.kept) + len(self.dropped),
            "kept": len(self.kept),
            "dropped": len(self.dropped),
            "dropped_by_reason": dict(Counter(self.dropped.values())),
            "groups": len(accs),
            "mean_accuracy": sum(accs) / len(accs) if accs else 0.0,
        }


def _as_sample(record: ScoredSample | Mapping) -> ScoredSample:
    if isinstance(record, ScoredSample):
        return record
    try:
        return ScoredSample(str(record["sample_id"]), str(record["group_id"]), float(record["score"]),
                            record.get("correct"))
    except KeyError as exc:
        raise KeyError(f"reward record needs sample_id, group_id and score; missing {exc}") from None


def _group(records: Iterable[ScoredSample | Mapping]) -> tuple[list[ScoredSample], dict[str, list[ScoredSample]]]:
    samples = [_as_sample(r) for r in records]
    seen: set[str] = set()
    groups: dict[str, list[ScoredSample]] = {}
    for s in samples:
        if s.sample_id in seen:
            raise ValueError(f"duplicate sample_id {s.sample_id!r}")
        if not math.isfinite(s.score):
            raise ValueError(f"sample {s.sample_id!r} has non-finite score {s.score}")
        seen.add(s.sample_id)
        groups.setdefault(s.group_id, []).append(s)
    return samples, groups


def _zscores(scores: list[float]) -> tuple[list[float], bool]:
    """Population z-scores and whether the group is constant (std ~ 0 -> zeros)."""
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores))
    if std < STD_EPS:
        return [0.0] * len(scores), True
    return [(x - mean) / std for x in scores], False


def _centred(scores: list[float]) -> tuple[list[float], bool]:
    """Rewards minus the group mean (Dr. GRPO)."""
    mean = sum(scores) / len(scores)
    constant = max(scores) - min(scores) < STD_EPS
    return ([0.0] * len(scores) if constant else [x - mean for x in scores]), constant


def _leave_one_out(scores: list[float]) -> tuple[list[float], bool]:
    """Each reward minus the mean of the others (RLOO); a group of one has no baseline: zero."""
    n, total = len(scores), sum(scores)
    constant = max(scores) - min(scores) < STD_EPS
    if constant or n < 2:
        return [0.0] * n, True
    return [x - (total - x) / (n - 1) for x in scores], False


ESTIMATORS = {"grpo": _zscores, "dr_grpo": _centred, "rloo": _leave_one_out}


def _accuracy(group: list[ScoredSample]) -> float:
    """Fraction correct: the ``correct`` flags when given, else the mean score (scores in [0, 1])."""
    if all(s.correct is not None for s in group):
        return sum(bool(s.correct) for s in group) / len(group)
    return sum(s.score for s in group) / len(group)


def _drop_reason(acc: float, constant: bool, acc_band: tuple[float, float] | None, drop_all_equal: bool) -> str | None:
    if acc_band is not None and acc < acc_band[0]:
        return "accuracy_below_band"
    if acc_band is not None and acc > acc_band[1]:
        return "accuracy_above_band"
    if drop_all_equal and constant:
        return "all_equal"
    return None


def group_advantages(
    records: Iterable[ScoredSample | Mapping],
    acc_band: tuple[float, float] | None = (0.2, 0.8),
    drop_all_equal: bool = True,
    estimator: str = "grpo",
) -> GroupResult:
    """Per-group advantages from ``estimator`` (``ESTIMATORS``); groups outside ``acc_band`` (inclusive) or
    constant are dropped.

    Defaults follow the reference math reward (keep 0.2 <= accuracy <= 0.8, z-scores). ``acc_band=None`` disables
    the band; ``drop_all_equal`` drops groups whose advantages would all be zero.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")
    samples, groups = _group(records)
    advantages: dict[str, float] = {}
    dropped: dict[str, str] = {}
    accuracy: dict[str, float] = {}
    for gid, group in groups.items():
        z, constant = ESTIMATORS[estimator]([s.score for s in group])
        accuracy[gid] = _accuracy(group)
        reason = _drop_reason(accuracy[gid], constant, acc_band, drop_all_equal)
        for s, adv in zip(group, z):
            if reason is None:
                advantages[s.sample_id] = adv
            else:
                dropped[s.sample_id] = reason
    kept = [s.sample_id for s in samples if s.sample_id in advantages]
    return GroupResult(advantages=advantages, kept=kept, dropped=dropped, group_accuracy=accuracy)


def code_score(passed: int, total: int, mode: str = "fraction") -> float:
    """Raw code reward: pass fraction (default) or the number of passed tests (the reference's choice)."""
    if mode == "fraction":
        return passed / total if total else 0.0
    if mode == "count":
        return float(passed)
    raise ValueError(f"code score mode must be 'fraction' or 'count', got {mode!r}")


def code_group_advantages(records: Iterable[Mapping], mode: str = "fraction") -> GroupResult:
    """Reference code reward: z-scores of per-sample code scores, dropping groups whose rewards are all zero.

    Each record has ``sample_id``, ``group_id``, ``passed`` and ``total``; accuracy counts samples passing all
    tests. No accuracy band (as in the reference).
    """
    scored = [
        ScoredSample(str(r["sample_id"]), str(r["group_id"]), code_score(int(r["passed"]), int(r["total"]), mode),
                     correct=int(r["total"]) > 0 and int(r["passed"]) == int(r["total"]))
        for r in records
    ]
    return group_advantages(scored, acc_band=None, drop_all_equal=True)


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476): 0 up to ``max_tokens - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_tokens`` (and ``-factor`` beyond); ``buffer`` 0 turns it off."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return -factor * min(1.0, (length - (max_tokens - buffer)) / buffer)
