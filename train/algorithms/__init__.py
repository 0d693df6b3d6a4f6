"""Training algorithms by name: ``training.method`` selects one (its module in this folder, named after it).

Each module defines ``ALGORITHM``, a :class:`train.algorithms.base.Algorithm`: how a trajectory becomes rows (the
view's units), the loss, what the algorithm needs (old log-probs, a reference model, inner iterations, Monte-Carlo
draws), and the families it refuses. This registry is torch-free, so configs are checked before heavy imports: it
holds each name, its aliases and whether it can serve the value model; the module is imported on first use.

Adding an algorithm = one new file here + one line in ``REGISTRY`` (docs/architecture.md, "Adding an algorithm").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from models.kinds import ATTENTION_OF


@dataclass(frozen=True)
class Entry:
    """What config loading needs to know of an algorithm, without importing it."""

    module: str  # the module (in train/algorithms/) that defines ALGORITHM
    aliases: tuple[str, ...] = ()  # other accepted spellings of ``training.method`` (case-insensitive)
    value_model: bool = False  # can train with the value model (model.value_base_model)
    display: str = ""  # the name error messages show (default: the registry name)
    advantages: tuple[str, ...] = ()  # the reward.advantage choices its paper's estimator allows (empty: any)
    rl: bool = True  # an RL method (False: SFT only)
    elbo_weight: bool = False  # accepts training.elbo_weight (its rows mask at random and its loss weighs tokens)
    attention: tuple[str, ...] = ("block", "full")  # the attention kinds it serves (models/kinds.py ATTENTION_OF)
    why: str = ""  # why it refuses the other kinds
    # training keys of the shared clipped loss (train/loss.py) its own loss does not read: ratio_level (a ratio per
    # sequence or none at all), loss_norm (it normalises by units, samples or groups itself), beta / ref_beta (no KL
    # term, or its own penalty), eps / eps_high (no clip); setting them is refused, never silently ignored
    ignores: tuple[str, ...] = ()
    own: tuple[str, ...] = ()  # keys only this method reads (OWN_KEYS): refused for every other method
    reads: tuple[str, ...] = ()  # the VIEW_KEYS its rows read (set away from the default, the others are noted)


_OWN_LOSS = ("ratio_level", "loss_norm")  # a sequence-level objective normalised in its own way
_NO_KL = ("beta", "ref_beta", "use_kl_estimator_k3")  # no KL term to the old policy or the reference
_NO_CLIP = ("eps", "eps_high")  # no clipped ratio

# view keys only some algorithms' rows read: the trace's step merging, the random-masking ratio range and mode,
# the Monte-Carlo draws per sample
VIEW_KEYS = ("shrink", "lower_p", "upper_p", "random_mask_mode", "mask_times_per_sample")
_TRACE = ("shrink",)
_RANDOM = ("lower_p", "upper_p", "random_mask_mode", "mask_times_per_sample")
_DRAWS = ("mask_times_per_sample",)

REGISTRY: dict[str, Entry] = {
    "tracerl": Entry("train.algorithms.tracerl", aliases=("trace_rl",), value_model=True, display="TraceRL",
                      reads=_TRACE),
    "random_masking": Entry("train.algorithms.random_masking", elbo_weight=True, reads=_RANDOM),
    "coupled": Entry("train.algorithms.coupled", elbo_weight=True, reads=_RANDOM),
    "cj_grpo": Entry("train.algorithms.cj_grpo", aliases=("cj-grpo",), display="CJ-GRPO", advantages=("dr_grpo",),
                     reads=_TRACE),
    "diffu_grpo": Entry("train.algorithms.diffu_grpo", aliases=("d1", "diffu-grpo"), display="diffu-GRPO",
                        advantages=("dr_grpo",), elbo_weight=True),
    "wd1": Entry("train.algorithms.wd1", advantages=("dr_grpo",), ignores=("ratio_level", *_NO_KL, *_NO_CLIP)),
    "coupled_grpo": Entry("train.algorithms.coupled_grpo", aliases=("coupled-grpo",), display="coupled-GRPO",
                          advantages=("rloo", "dr_grpo"), ignores=("ratio_level",),
                          reads=("lower_p", "upper_p", "mask_times_per_sample")),
    "spg": Entry("train.algorithms.spg", display="SPG", advantages=("dr_grpo",),
                 ignores=(*_OWN_LOSS, *_NO_KL, *_NO_CLIP), own=("eubo_beta", "eubo_weight"), reads=_DRAWS),
    "bgpo": Entry("train.algorithms.bgpo", display="BGPO", ignores=(*_OWN_LOSS, *_NO_KL), own=("dual_clip",),
                   reads=_DRAWS),
    # ESPO's reference penalty is quadratic (no KL estimator); EBPO's is k3 or k1 of the ELBOs
    "espo": Entry("train.algorithms.espo", display="ESPO", advantages=("rloo", "dr_grpo"),
                  ignores=(*_OWN_LOSS, "beta", "use_kl_estimator_k3"), reads=_DRAWS),
    # VRPO's reference enters its DPO margin, always (no ref_beta weight)
    "vrpo": Entry("train.algorithms.vrpo", display="VRPO", ignores=(*_OWN_LOSS, *_NO_KL, *_NO_CLIP),
                  own=("preference_beta",), reads=_DRAWS),
    "ebpo": Entry("train.algorithms.ebpo", display="EBPO", attention=("block",),
                  why="it noises every block on its own in one block-causal forward (use espo or bgpo)",
                  ignores=(*_OWN_LOSS, "beta"), reads=_DRAWS),
    "semi_ar": Entry("train.algorithms.semi_ar", rl=False, elbo_weight=True, reads=_RANDOM),
    "ar": Entry("train.algorithms.ar", rl=False),
}

OWN_KEYS = {key: name for name, entry in REGISTRY.items() for key in entry.own}
# the training keys whose setting a method may not read (jobs/config.py refuses them when set away from the default)
CHECKED_KEYS = ("ratio_level", "loss_norm", "beta", "ref_beta", "use_kl_estimator_k3", "eps", "eps_high",
                *OWN_KEYS, *VIEW_KEYS)
METHODS = tuple(REGISTRY)
RL_METHODS = tuple(name for name, entry in REGISTRY.items() if entry.rl)
_BY_SPELLING = {spelling: name for name, entry in REGISTRY.items() for spelling in (name, *entry.aliases)}


def canonical_method(method: object) -> str | None:
    """The registry name of a ``training.method`` value (any case, any alias), or None when unknown."""
    return _BY_SPELLING.get(str(method).lower())


def method_choices() -> str:
    """The accepted names, as error messages list them."""
    return ", ".join(entry.display or name for name, entry in REGISTRY.items())


def value_model_refusal(method: str) -> str:
    """One line saying why ``method`` cannot train with the value model ("" when it can)."""
    if REGISTRY[method].value_model:
        return ""
    return (f"training.method {method!r} cannot train with the value model (model.value_base_model): a token's value "
            "is read at the state before its decoding step, which only TraceRL's rows reproduce")


def rl_refusal(method: str) -> str:
    """One line saying why ``method`` cannot be an RL job's training method ("" when it can)."""
    if REGISTRY[method].rl:
        return ""
    return (f"training.method {method!r} is an SFT method; RL methods: "
            f"{', '.join(REGISTRY[name].display or name for name in RL_METHODS)}")


def family_refusal(method: str, model_base: str) -> str:
    """One line saying why ``method`` cannot train a ``model_base`` model ("" when it can)."""
    entry, attention = REGISTRY[method], ATTENTION_OF.get(model_base)
    if attention is None or attention in entry.attention:
        return ""
    return f"training.method {method!r} cannot train {model_base!r}, a {attention}-attention model: {entry.why}"


def attention_refusal(method: str, attention: str) -> str:
    """The same refusal for a model known by its attention kind only (a training view's traits)."""
    entry = REGISTRY[method]
    return "" if attention in entry.attention else (
        f"training.method {method!r} cannot train {attention}-attention models: {entry.why}")


def default_advantage(method: str) -> str:
    """The reward.advantage an algorithm uses when the config leaves it unset: its paper's, else GRPO's z-score."""
    allowed = REGISTRY[method].advantages
    return allowed[0] if allowed else "grpo"


def ignored_setting_refusal(method: str, settings: dict[str, object]) -> tuple[str, str]:
    """(key, one line) for the first of ``settings`` (training key -> its value when set away from the default)
    that ``method``'s loss does not read, or ("", "")."""
    entry = REGISTRY[method]
    for key, value in settings.items():
        if key in entry.ignores:
            return key, (f"training.{key} {value!r} has no effect with training.method "
                         f"{entry.display or method!r}: its loss does not read it (its paper's objective sets it)")
        if key in OWN_KEYS and key not in entry.own:
            owner = REGISTRY[OWN_KEYS[key]]
            return key, (f"training.{key} {value!r} has no effect with training.method "
                         f"{entry.display or method!r}: only {owner.display or OWN_KEYS[key]}'s loss reads it")
    return "", ""


def unread_view_notes(method: str, settings: dict[str, object], shown: str = "",
                      readers: dict[str, str] | None = None) -> list[str]:
    """Notes for the VIEW_KEYS of ``settings`` (set away from the default) that ``method``'s rows never read: a
    notice, not a refusal, since the reference's files set them for whichever method a run switches to.
    ``readers``: the methods the job accepts (as it spells them -> their registry name; default: the RL methods),
    of which a note names those that read the key."""
    entry = REGISTRY[method]
    name = shown or entry.display or method  # ``shown``: the method as the config spells it
    if readers is None:
        readers = {REGISTRY[n].display or n: n for n in RL_METHODS}
    return [f"training.{key} {value!r} has no effect with training.method {name!r}: its rows do not read it "
            f"(read by {', '.join(s for s, n in readers.items() if key in REGISTRY[n].reads)})"
            for key, value in settings.items() if key in VIEW_KEYS and key not in entry.reads]


def advantage_refusal(method: str, advantage: str) -> str:
    """One line saying why ``method`` refuses the group baseline ``advantage`` ("" when it accepts it)."""
    allowed = REGISTRY[method].advantages
    if not allowed or advantage in allowed:
        return ""
    return (f"reward.advantage {advantage!r} contradicts training.method {method!r}, whose estimator uses "
            f"{' or '.join(allowed)}")


def algorithm(method: str) -> Any:
    """The algorithm registered as ``method`` (a registry name or alias): a train.algorithms.base.Algorithm, not
    imported here, so this registry stays below the algorithms it names."""
    name = canonical_method(method)
    if name is None:
        raise ValueError(f"unknown training method {method!r}; expected one of {method_choices()}")
    return importlib.import_module(REGISTRY[name].module).ALGORITHM
