"""Reading a job config: one YAML file plus ``key=value`` overrides, checked and built into typed section objects.

The schema of a job kind is a tree of section dataclasses (see core/schema.py). Loading:
1. reads the file and the overrides (values are YAML scalars: ``1e-5`` is a float, ``[0,1]`` a list, ``null`` is
   None; overrides apply in order after the file; ``???`` is refused: a value is required);
2. maps the reference implementation's renamed keys (:data:`RENAMES`, one table) and drops, with a printed
   notice, reference keys that have no effect here (per job kind, jobs/config.py ``NO_EFFECT``);
3. rejects unknown keys naming the file and the closest valid key, and unsupported ones with the reason;
4. fills defaults from the dataclasses, lets a section follow another (``evaluation`` keys that are not set follow
   ``rollout``), resolves ``${a.b}`` interpolations, coerces types (int -> float; a number given to a text key
   keeps the text as written: ``project: 0123`` is "0123", not YAML's octal 83);
5. builds the section objects, whose own checks (ranges, allowed sets, cross-field rules) run on construction.
Every failure is a :class:`ConfigError`: one line naming the key and where it came from (file or override).

Nothing here imports torch, so a typo is reported in well under a second.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import UserError
from core.schema import SettingError, config_fields, describe_type

REQUIRED = "???"
USAGE = "usage: <script> config=path/to/job.yaml [key.sub=value ...]"


class ConfigError(UserError, ValueError):
    """A user-facing configuration error; the message is one line naming the key and the file."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None):
        super().__init__(" ".join(str(message).splitlines()))
        self.key = key
        self.source = source


def required() -> Any:
    """A field the user must set (no default)."""
    return dataclasses.field(default=None, metadata={"required": True})


# ------------------------------------------------------------------------------- reference key mapping

def _cache_from_use_cache(value: Any) -> Any:
    return value if not isinstance(value, bool) else ("prefix" if value else "none")


# (section, reference key) -> (our key, value conversion or None). Sections listed in _RENAMED_SECTIONS.
RENAMES: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    "max_token": ("max_tokens", None),
    "max_gen_length": ("max_tokens", None),  # Dream/LLaDA: the generation length
    "denoising_steps_per_block": ("denoising_steps", None),
    "stop_token_list": ("stop", None),
    "use_cache": ("cache", _cache_from_use_cache),  # true -> prefix, false -> none
    "batch_size": ("max_active", None),  # Dream/LLaDA: prompts sampled together
}
_RENAMED_SECTIONS = ("rollout", "evaluation")
# code key -> the spelling the user wrote, for the config loaded last (errors name the key as written)
_WRITTEN: dict[str, str] = {}


# notes a section's validate() raises while load() builds the config (printed with the file's name); None when no
# load is under way (a note is printed at once)
_VALIDATION_NOTES: list[str] | None = None


def note(line: str) -> None:
    """A notice from a section's checks (a setting with no effect, not worth a refusal): printed by the loading
    ``load`` with the config file's name, on its stream."""
    if _VALIDATION_NOTES is None:
        print(f"note: {line}", file=sys.stderr, flush=True)
    else:
        _VALIDATION_NOTES.append(line)


def as_written(key: str) -> str:
    """``key`` as the user spelled it (``rollout.denoising_steps`` -> ``rollout.denoising_steps_per_block`` when the
    config used the reference's name)."""
    return _WRITTEN.get(key, key)


def _user_spelling(err: ConfigError) -> ConfigError:
    """The same error naming the key as written."""
    if err.key not in _WRITTEN:
        return err
    code, user = err.key, _WRITTEN[err.key]
    text = str(err).replace(f"'{code}'", f"'{user}'").replace(f" {code.rpartition('.')[2]} ",
                                                                f" {user.rpartition('.')[2]} ")
    return ConfigError(text, user, err.source)

def _rename_section(tree: dict[str, Any], section: str, src: str, notices: list[str]) -> None:
    body = tree.get(section)
    if not isinstance(body, dict):
        return
    for old, (new, convert) in RENAMES.items():
        if old not in body:
            continue
        value = body.pop(old)
        written = value
        value = convert(value) if convert else value
        shown = f" ({written!r} -> {value!r})" if value != written else ""
        notices.append(f"note: {src}: '{section}.{old}' is the reference's name of '{section}.{new}'{shown}; "
                       f"write '{new}'")
        _WRITTEN[f"{section}.{new}"] = f"{section}.{old}"
        current = body.get(new)
        if new not in body or _is_interp(current, f"{section}.{old}"):
            body[new] = value
        elif current != value and not _is_interp(value, f"{section}.{new}"):
            raise ConfigError(f"{src}: '{section}.{old}' (the reference's name of '{section}.{new}') and "
                              f"'{section}.{new}' are both set, to different values ({value!r} vs {current!r})",
                              f"{section}.{old}", src)


def _is_interp(value: Any, key: str) -> bool:
    return isinstance(value, str) and value.strip() == "${" + key + "}"


def _rename_interpolations(tree: Any) -> Any:
    """Point ``${rollout.max_token}``-style interpolations at the renamed keys."""
    if isinstance(tree, dict):
        return {k: _rename_interpolations(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rename_interpolations(v) for v in tree]
    if isinstance(tree, str) and "${" in tree:
        for section in _RENAMED_SECTIONS:
            for old, (new, _) in RENAMES.items():
                tree = tree.replace("${" + f"{section}.{old}" + "}", "${" + f"{section}.{new}" + "}")
    return tree


def _apply_renames(tree: dict[str, Any], src: str, notices: list[str]) -> dict[str, Any]:
    for section in _RENAMED_SECTIONS:
        _rename_section(tree, section, src, notices)
    return _rename_interpolations(tree)


# The reference's process-reward settings sit in rollout.reward_model; ours are the process_reward section.
PROCESS_REWARD_RENAMES = {"reward_chunk_length": "chunk_length", "max_generation_token": "max_new_tokens"}


def _move_reward_model(tree: dict[str, Any]) -> None:
    rollout = tree.get("rollout")
    if not isinstance(rollout, dict) or not isinstance(rollout.get("reward_model"), dict):
        return
    moved = {PROCESS_REWARD_RENAMES.get(k, k): v for k, v in rollout.pop("reward_model").items()}
    tree["process_reward"] = {**moved, **(tree.get("process_reward") or {})}


def _normalise_reference_form(tree: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the reference eval form ``model: <path>`` + ``model_base: <name>`` to the nested form, and its
    ``rollout.reward_model`` section to ``process_reward``."""
    _move_reward_model(tree)
    if isinstance(tree.get("model"), str):
        tree["model"] = {"pretrained_model": tree["model"]}
    if "model_base" in tree and (tree.get("model") is None or isinstance(tree.get("model"), dict)):
        tree["model"] = dict(tree.get("model") or {}, model_base=tree.pop("model_base"))
    return tree


# ------------------------------------------------------------------------------------------ schema walk


@functools.cache
def all_keys(cls: type, prefix: str = "", sections: bool = True) -> tuple[str, ...]:
    """Every dotted key of a schema; ``sections`` False: the settings only (``key=value`` targets)."""
    keys: list[str] = []
    for name, (tp, _) in config_fields(cls).items():
        if sections or not _is_section(tp):
            keys.append(prefix + name)
        if _is_section(tp):
            keys.extend(all_keys(tp, f"{prefix}{name}.", sections))
    return tuple(keys)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def closest_key(key: str, root: type) -> str:
    """The valid setting whose last name is most like `key`'s: a sibling with a 0.1 head start, else one in another
    section (``training.lerning_rate`` means ``optimizer.params.learning_rate``, not the sibling
    ``training.lower_p``); else the best overall. Sections themselves are not suggested (not a ``key=value``)."""
    parent, _, leaf = key.rpartition(".")
    settings = all_keys(root, sections=False)

    def ratio(k: str) -> float:
        return difflib.SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio()

    best = max(settings, key=lambda k: ratio(k) + (0.1 if k.rpartition(".")[0] == parent else 0.0))
    if ratio(best) >= 0.6:
        return best
    return difflib.get_close_matches(key, settings, n=1, cutoff=0.0)[0]


def defaults_tree(cls: type) -> dict[str, Any]:
    """Default values of a schema as plain data; required keys hold ``???``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or not f.init:
            continue
        tp = config_fields(cls)[f.name][0]
        if _is_section(tp):
            out[f.name] = defaults_tree(tp)
        elif f.metadata.get("required"):
            out[f.name] = REQUIRED
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = f.default
    return out


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for name, value in tree.items():
        key = f"{prefix}{name}"
        yield key
        if isinstance(value, dict):
            yield from _leaf_keys(value, key + ".")


def _is_mapping_field(schema: type, key: str) -> bool:
    """Whether ``key`` names a free-form mapping field (``dict[...]``, e.g. ``system.env``), not a section."""
    cls: Any = schema
    *sections, name = key.split(".")
    for part in sections:
        tp = config_fields(cls).get(part, (None,))[0]
        if not _is_section(tp):
            return False
        cls = tp
    tp = config_fields(cls).get(name, (None,))[0]
    return tp is not None and _accepts_mapping(tp)


def _drop_key(tree: dict[str, Any], key: str) -> None:
    """Remove ``key`` (dotted) from a nested dict, where present."""
    *sections, name = key.split(".")
    for part in sections:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return
    tree.pop(name, None)


# ------------------------------------------------------------------------------------------------ coercion


class _Mismatch(Exception):
    """A value does not fit a type; `specific` when the value had the right shape (better to report)."""

    def __init__(self, detail: str, specific: bool = False):
        super().__init__(detail)
        self.detail = detail
        self.specific = specific


def _fail(detail: str, specific: bool = False) -> Any:
    raise _Mismatch(detail, specific)


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
    return _fail(detail, specific=isinstance(value, str))


def _coerce_union(value: Any, args: tuple[Any, ...], tp: Any) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return coerce(value, arm)
        except _Mismatch as err:
            errors.append(err)
    specific = [e for e in errors if e.specific]
    if specific:
        raise specific[0]
    return _fail(f"expects {describe_type(tp)}, got {value!r}")


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
    return _fail(f"expects {describe_type(tp)}, got {value!r} ({type(value).__name__})")


def coerce(value: Any, tp: Any) -> Any:
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
            return _fail(f"expects {describe_type(tp)}, got {value!r}")
        try:
            return [coerce(v, args[0]) for v in value]
        except _Mismatch as err:
            raise _Mismatch(f"list element {err.detail}", specific=True) from None
    if origin is dict:
        if not isinstance(value, dict):
            return _fail(f"expects {describe_type(tp)}, got {value!r}")
        return {str(k): coerce(v, args[1]) for k, v in value.items()}
    return _coerce_scalar(value, tp)


# ------------------------------------------------------------------------------------------ reading sources


def split_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    """Separate ``config=path`` from the ``key=value`` overrides."""
    path: str | None = None
    overrides: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"argument {arg!r} is not of the form key=value ({USAGE})", key=arg)
        if key.strip() != "config":
            overrides.append(arg)
        elif path is not None:
            raise ConfigError(f"config= given twice ({path!r} and {value!r})", key="config")
        else:
            path = value.strip()
    if not path:
        raise ConfigError(f"missing 'config=<file.yaml>' argument ({USAGE})", key="config")
    return path, overrides


def read_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping, without resolving interpolations."""
    if Path(path).is_dir():
        inside = sorted(p.name for p in Path(path).glob("*.yaml"))[:4]
        raise ConfigError(f"config={path}: a folder, not a config file (YAML files in it: "
                          f"{', '.join(inside) or 'none'})", key="config", source=path)
    if not Path(path).is_file():
        raise ConfigError(f"config={path}: file not found (cwd {os.getcwd()})", key="config", source=path)
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}", source=path) from None
    except (OmegaConfBaseException, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {str(err).splitlines()[0]}", source=path) from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections", source=path)
    return typing.cast(dict, OmegaConf.to_container(raw, resolve=False))


def number_texts(path: str) -> dict[str, str]:
    """Dotted key -> the text of each plain scalar in the YAML file, as written (empty if it cannot be read)."""
    try:
        root = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return {}
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
            name = f"{prefix}{key.value}"
            if isinstance(value, yaml.MappingNode):
                walk(value, name + ".")
            elif isinstance(value, yaml.ScalarNode) and value.style is None and "${" not in value.value:
                out[name] = value.value  # used only where it was read as a number (never an interpolation)

    walk(root, "")
    return out


def _wants_text(tp: Any) -> bool:
    """A key whose type takes text but no number: a number there was meant as the text it was written as."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return str in arms and not any(a in (int, float) for a in arms)


def parse_override(item: str, path: str) -> dict[str, Any]:
    """One ``a.b=c`` override as a nested dict (value parsed as a YAML scalar)."""
    key, _, value = item.partition("=")
    key = key.strip()
    src = f"{path} (override {item!r})"
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{src}: malformed key {key!r}", key, src)
    if value.strip() == REQUIRED:
        raise ConfigError(f"{src}: key '{key}' needs a value ({REQUIRED} is the marker of a required key)", key, src)
    try:
        tree = OmegaConf.from_dotlist([item])
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{src}: cannot parse the value: {str(err).splitlines()[0]}", key, src) from None
    return typing.cast(dict, OmegaConf.to_container(tree, resolve=False))


# ------------------------------------------------------------------------------------------ tree checks


def check_tree(tree: dict[str, Any], cls: type, root: type, src: str, unsupported: dict[str, str],
               notices: list[str], no_effect: dict[str, Any], prefix: str = "") -> None:
    """Reject unknown keys and section/scalar shape errors in one source; drop no-effect keys with a notice.

    A no-effect entry is a reason (any value is dropped with a notice) or a pair (the one value the reference's
    files hold, the refusal of any other): ``current_epoch: 1`` loads with a notice, ``current_epoch: 3`` is an
    error, since it asks for something this framework does another way."""
    fields = config_fields(cls)
    for name in list(tree):
        key, value = f"{prefix}{name}", tree[name]
        if key in no_effect and str(name) not in fields:
            why = no_effect[key]
            if isinstance(why, tuple):
                only, refusal = why
                if value != only:
                    raise ConfigError(f"{src}: key '{key}' is {value!r}: {refusal}", key, src)
                why = f"the reference's default {only!r}; {refusal}"
            notices.append(f"note: {src}: '{key}' has no effect here ({why})")
            del tree[name]
            continue
        if str(name) not in fields:
            _unknown_key(key, root, src, unsupported)
        for bad, reason in unsupported.items():
            if key == bad and value is not None:
                raise ConfigError(f"{src}: unsupported key '{key}': {reason}", key, src)
        tp = fields[str(name)][0]
        if _is_section(tp):
            if value is None:
                tree[name] = {}
            elif not isinstance(value, dict):
                raise ConfigError(f"{src}: key '{key}' is a section (a mapping), got {value!r}", key, src)
            else:
                check_tree(value, tp, root, src, unsupported, notices, no_effect, key + ".")
        elif isinstance(value, dict) and not _accepts_mapping(tp):
            raise ConfigError(f"{src}: key '{key}' expects {describe_type(tp)}, got a mapping", key, src)


def _unknown_key(key: str, root: type, src: str, unsupported: dict[str, str]) -> None:
    for bad, reason in unsupported.items():
        if key == bad or key.startswith(bad + "."):
            raise ConfigError(f"{src}: unsupported key '{key}': {reason}", key, src)
    raise ConfigError(f"{src}: unknown key '{key}' (closest valid key: '{closest_key(key, root)}')", key, src)


def _accepts_mapping(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_mapping(a) for a in typing.get_args(tp))
    return tp is Any or origin is dict


# ------------------------------------------------------------------------------------------ building


_INTERP = re.compile(r"\$\{([^}]*)\}")


def _resolve(cfg: DictConfig, key: str, src: str) -> Any:
    node, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, node) if node else cfg
    try:
        value = parent[leaf]
        if isinstance(value, DictConfig) or OmegaConf.is_list(value):
            value = OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as err:
        raw = OmegaConf.to_container(parent, resolve=False).get(leaf)  # type: ignore[union-attr]
        raise ConfigError(f"{src}: key '{key}': cannot resolve {raw!r}: {str(err).splitlines()[0]}",
                          key, src) from None
    return value


def build(cls: type, cfg: DictConfig, sources: dict[str, str], path: str, prefix: str = "",
          texts: dict[str, str] | None = None) -> Any:
    """Instantiate section class `cls` from the merged config (values coerced; the class validates itself).
    ``texts``: dotted key -> a number's text as written, for text keys."""
    texts = texts or {}
    kwargs: dict[str, Any] = {}
    for name, (tp, _meta) in config_fields(cls).items():
        key = prefix + name
        src = sources.get(key, path)
        if _is_section(tp):
            kwargs[name] = build(tp, cfg, sources, path, key + ".", texts)
            continue
        if OmegaConf.is_missing(OmegaConf.select(cfg, prefix[:-1]) if prefix else cfg, name):
            raise ConfigError(f"{src}: missing required key '{key}' (set it in the file or pass {key}=...)", key, src)
        value = _resolve(cfg, key, src)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key in texts and _wants_text(tp):
            value = texts[key]
        elif isinstance(value, dict) and typing.get_origin(tp) is dict and _wants_text(typing.get_args(tp)[1]):
            # a mapping of text (system.env): OMP_NUM_THREADS: 010 or FLAG: false mean the text written
            value = {k: texts.get(f"{key}.{k}", v) if isinstance(v, (int, float)) else v for k, v in value.items()}
        try:
            kwargs[name] = coerce(value, tp)
        except _Mismatch as err:
            raise ConfigError(f"{src}: key '{key}' {err.detail}", key, src) from None
    try:
        return cls(**kwargs)
    except SettingError as err:
        key = prefix + err.field
        src = sources.get(key, path)
        raise ConfigError(f"{src}: key '{key}': {err}", key, src) from None


def load(argv: Sequence[str], schema: type, unsupported: dict[str, str] | None = None,
         follows: dict[str, str] | None = None, stream: Any = None, no_effect: dict[str, str] | None = None) -> Any:
    """Load ``config=<file>`` plus overrides into an instance of ``schema`` (see the module docstring).

    ``follows`` maps a section to another whose value its unset keys take (``{"evaluation": "rollout"}``).
    ``unsupported`` keys are refused with their reason; ``no_effect`` keys (the reference's keys for things this
    framework does differently) are dropped with a notice on ``stream`` (stderr by default).
    """
    unsupported, no_effect = unsupported or {}, no_effect or {}
    _WRITTEN.clear()
    path, overrides = split_argv(argv)
    notices: list[str] = []
    layers = [_apply_renames(_normalise_reference_form(read_yaml(path)), path, notices)]
    check_tree(layers[0], schema, schema, path, unsupported, notices, no_effect)
    sources = dict.fromkeys(_leaf_keys(layers[0]), path)
    texts = number_texts(path)
    for item in overrides:
        src = f"{path} (override {item!r})"
        raw = _normalise_reference_form(parse_override(item, path))
        for key in _leaf_keys(raw):  # written in the code's words here: errors say it so
            _WRITTEN.pop(key, None)
        tree = _apply_renames(raw, src, notices)
        check_tree(tree, schema, schema, src, unsupported, notices, no_effect)
        sources.update(dict.fromkeys(_leaf_keys(tree), src))
        leaves = list(_leaf_keys(tree))
        for key in leaves:  # what the file wrote for these keys no longer applies
            texts.pop(key, None)
        key_text, _, text = item.partition("=")
        if len(leaves) == key_text.count(".") + 1 and "${" not in text:  # one key set to a scalar, not a mapping
            texts[leaves[-1]] = text.strip()  # its value's text as typed
        if _is_mapping_field(schema, key_text.strip()):  # ``system.env={}``: the value replaces, merges nothing
            for layer in layers:
                _drop_key(layer, key_text.strip())
        layers.append(tree)
    try:
        cfg = typing.cast(DictConfig, OmegaConf.merge(defaults_tree(schema), *layers))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {str(err).splitlines()[0]}", source=path) from None
    for section, leader in (follows or {}).items():
        for name in config_fields(config_fields(schema)[section][0]):
            if f"{section}.{name}" not in sources and name in cfg[leader]:
                cfg[section][name] = "${" + f"{leader}.{name}" + "}"
    if OmegaConf.is_missing(cfg.experiment, "project"):
        cfg.experiment.project = Path(path).stem
    global _VALIDATION_NOTES
    outer, _VALIDATION_NOTES = _VALIDATION_NOTES, []  # a load inside a section's checks keeps its own notes
    try:
        out = build(schema, cfg, sources, path, texts=texts)
    except ConfigError as err:
        raise _user_spelling(err) from None
    finally:
        notices += [f"note: {path}: {line}" for line in _VALIDATION_NOTES]
        _VALIDATION_NOTES = outer
    for line in notices:
        print(line, file=stream or sys.stderr)
    return out
