"""LoRA and QLoRA adapters through peft: the ``lora`` config section, wrapping a loaded policy, sampling on merged
weights, adapter checkpoints and merging an adapter into a whole checkpoint.

* Wrapping: ``models.registry.load_policy`` loads the base model and ``wrap`` wraps ``adapter.model`` with
  ``peft.get_peft_model`` (a fresh adapter, B = 0: the model's outputs are the base model's exactly) or with
  ``PeftModel.from_pretrained(..., is_trainable=True)`` (a resumed adapter). The base weights are frozen, so the
  trainer's optimizer (AdamW over ``requires_grad`` parameters) holds only the adapter's.
* Sampling runs merged weights, or an equivalent that copies nothing. On CPU the pre-packed products of
  ``models.layers.packed_projections`` hold the base weights (in place of the model's own, parked while
  ``sample.generate`` samples) and add the adapters' low-rank products beside them: the weights held while
  sampling are one copy, as without LoRA, and the frozen base weights come back bit for bit (where the side
  product would cost over a quarter of the layer's own, at high ranks, the packed weight is base + delta merged
  and the base stays). Elsewhere (GPU, 16-bit) ``merged_for_sampling`` (entered by ``sample.generate``) merges the
  adapters into copies of the base weights and restores the original tensors after, bit for bit (no subtraction:
  repeated merge / unmerge would drift the frozen weights in 16-bit); the copies cost one transient copy of the
  adapted weights. 4-bit (QLoRA) layers are not merged (it would requantise): they sample as is.
* Checkpoints: a PeftModel's ``save_pretrained`` writes the adapter in peft's format (``adapter_config.json``,
  ``adapter_model.safetensors``) and a sample of the base weights (``base_fingerprint.json``: an adapter loaded on
  another base of the same shapes is refused); ``python -m tools.merge_lora`` writes a whole checkpoint with the
  adapter merged (``merged_model``) that ``load_model`` and eval.py read; ``load_model`` with ``model.adapter`` merges
  one at load.

The family's default targets come with the adapter (``Adapter.lora_targets``): this module reads nothing of the
registry, which imports it.

This module imports neither torch nor peft at import time (config loading imports it before torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.schema import SettingError, Settings, bounded
from models.errors import ModelLoadError, not_an_adapter_folder

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# a sample of the base model's weights, saved beside an adapter: loading it on another base of the same shapes
# (another model or initialisation, a copy fine-tuned far enough to move most weights by over 1%) is refused, where
# shapes alone cannot tell; a light fine-tune of the same base can pass
BASE_FINGERPRINT = "base_fingerprint.json"
_FINGERPRINT_VALUES = 8  # sampled values per weight tensor
_FINGERPRINT_RTOL = 1e-2  # above bf16's rounding (at most 2^-8 relative): the base in another dtype still matches


@dataclass
class LoraSettings(Settings):
    """``lora``: train low-rank adapters (peft) instead of every weight; off by default."""

    enabled: bool = False
    rank: int = 8  # r: the adapters' rank (>= 1 when enabled)
    alpha: float = bounded(16.0, 0.0, lo_open=True)  # scaling = alpha / rank
    dropout: float = bounded(0.0, 0.0, 1.0)  # on the adapters' input while training (sampling runs in eval mode)
    # module names (each layer's modules of that name); null = the family's attention and MLP projections
    # (models/registry.py FAMILIES[...].lora_targets)
    target_modules: list[str] | None = None
    # parameters adapted in place (peft's target_parameters), by their names within a layer: null = the family's
    # (a MoE family's routed experts: experts.gate_up_proj, experts.down_proj; FAMILIES[...].lora_parameters);
    # [] = none
    target_parameters: list[str] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"  # which biases train beside the adapters
    modules_to_save: list[str] | None = None  # modules trained whole and saved with the adapter (e.g. lm_head)
    load_in_4bit: bool = False  # QLoRA: the frozen base in 4-bit NF4 (CUDA + bitsandbytes only)
    init_seed: int = 0  # seeds the adapters' random init (lora_A), so a run and its resume agree

    def validate(self) -> None:
        super().validate()
        if self.enabled and self.rank <= 0:
            raise SettingError("rank", f"lora.rank must be >= 1 when lora.enabled is true, got {self.rank} "
                                       "(set lora.enabled=false to train every weight)")
        if self.load_in_4bit and not self.enabled:
            raise SettingError("load_in_4bit", "lora.load_in_4bit needs lora.enabled=true (QLoRA trains adapters "
                                               "on a 4-bit base)")


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def family_linear_names(model: Any) -> list[str]:
    """The distinct names of the model's linear layers (what target_modules may name)."""
    from torch import nn

    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n})


def _head_names(model: Any) -> list[str]:
    """The LM head's module name(s): the output embeddings, or the linear layers emitting one logit per token."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = model.get_input_embeddings().num_embeddings
    return [n for n, m in model.named_modules() if n and (m is head if head is not None else (
        isinstance(m, nn.Linear) and m.out_features == vocab))]


def peft_config(settings: LoraSettings, model: Any, family_targets: Sequence[str],
                family_parameters: Sequence[str] = ()) -> Any:
    """peft's LoraConfig for ``model``: ``settings.target_modules`` / ``target_parameters`` or else the family's
    defaults (the registry's ``lora_targets`` / ``lora_parameters``), checked against the model's own names."""
    from peft import LoraConfig

    names = family_linear_names(model)
    # the family's defaults that this config builds (a MoE model may have no dense MLP, SDAR-30B-A3B has none)
    targets = (list(settings.target_modules) if settings.target_modules is not None
               else [t for t in family_targets if t in names])
    unknown = [t for t in targets if t not in names]
    if not targets or unknown:
        raise ModelLoadError(f"lora.target_modules {unknown or targets} match no module of this "
                             f"{type(model).__name__}; its linear modules are {names}")
    parameters = list(settings.target_parameters if settings.target_parameters is not None else family_parameters)
    owned = {n for n, p in model.named_parameters() if _is_expert_tensor(p)}
    unknown = [t for t in parameters if not any(n.endswith("." + t) for n in owned)]
    if unknown:
        have = sorted({n.split(".", 3)[-1] for n in owned}) or "none"  # without the model.layers.{i}. prefix
        raise ModelLoadError(f"lora.target_parameters {unknown} match no expert tensor of this "
                             f"{type(model).__name__} (it has {have})")
    heads = _head_names(model)
    exclude = heads if heads and settings.target_modules is None else None  # LLaDA's head is also named ff_out
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, target_parameters=parameters or None, exclude_modules=exclude,
                      bias=settings.bias,
                      modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None)


def _is_expert_tensor(param: Any) -> bool:
    """A fused expert tensor [E, out, in] (what target_parameters adapt in place); under ZeRO-3 a parameter is a
    flat shard and ``ds_shape`` its shape."""
    return len(getattr(param, "ds_shape", param.shape)) == 3


def wrap(adapter: Any, settings: LoraSettings, resume: str | Path | None = None) -> Any:
    """Wrap ``adapter.model`` with fresh LoRA adapters, or with the adapter saved in ``resume`` (trainable)."""
    adapter.model = wrapped_model(adapter.model, settings, adapter.lora_targets, resume,
                                  family_parameters=adapter.lora_parameters)
    return adapter


def wrapped_model(model: Any, settings: LoraSettings, family_targets: Sequence[str],
                  resume: str | Path | None = None, also_save: tuple[str, ...] = (),
                  family_parameters: Sequence[str] = ()) -> Any:
    """``model`` as a trainable PeftModel: fresh adapters (seeded by ``settings.init_seed``) or those in ``resume``.
    ``also_save``: modules trained whole beside ``settings.modules_to_save`` (the value model's head)."""
    from peft import get_peft_model

    if settings.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if resume is not None:
        return load_adapter(model, resume, trainable=True)
    import torch

    config = peft_config(settings, model, family_targets, family_parameters)
    if also_save:
        config.modules_to_save = sorted({*(config.modules_to_save or ()), *also_save})
    devices = [d for d in {p.device for p in model.parameters()} if d.type == "cuda"]
    fingerprint = base_fingerprint(model)
    with torch.random.fork_rng(devices=devices):  # a seeded init that leaves the caller's RNG as it was
        torch.manual_seed(settings.init_seed)
        wrapped = get_peft_model(model, config)
    wrapped.dllm_base_fingerprint = fingerprint  # saved beside the adapter (write_base_fingerprint)
    return wrapped


def _check_adapter_fits(model: Any, path: Path) -> None:
    """One line when the adapter in ``path`` was not trained on this base model (missing modules, other shapes)."""
    from safetensors import safe_open
    from torch import nn

    if not (path / ADAPTER_CONFIG).is_file():
        raise ModelLoadError(not_an_adapter_folder(path))
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ModelLoadError(f"{path}: no {ADAPTER_WEIGHTS}")
    modules = dict(model.named_modules())
    with safe_open(str(weights), framework="pt") as fh:
        for key in fh.keys():  # noqa: SIM118 - a safetensors handle is not iterable
            for kind in ("lora_A", "lora_B"):
                if f".{kind}." not in key:
                    continue
                name = key.split(f".{kind}.")[0].removeprefix("base_model.model.")
                while name.endswith(".base_layer"):  # nested ParamWrappers: one per adapted expert tensor
                    name = name.removesuffix(".base_layer")
                module = modules.get(name)
                if module is not None and any(_is_expert_tensor(p) for p in module.parameters(recurse=False)):
                    continue  # fused expert tensors (target_parameters): peft checks their shapes as it loads
                if module is None or not isinstance(getattr(module, "weight", None), nn.Parameter):
                    raise ModelLoadError(f"{path}: the adapter does not match this base model (it adapts {name!r}, "
                                         "which the base model does not have)")
                shape = fh.get_slice(key).get_shape()
                fits = shape[1] == module.in_features if kind == "lora_A" else shape[0] == module.out_features
                if not fits:
                    raise ModelLoadError(f"{path}: the adapter does not match this base model ({name} is "
                                         f"{module.in_features}->{module.out_features} there, the adapter's "
                                         f"{kind} is {list(shape)})")


def base_fingerprint(model: Any) -> dict[str, list[float]]:
    """A few evenly spaced values of every floating-point weight of a plain (unwrapped) base model, by name.
    Quantized (4-bit) and partitioned (ZeRO-3, empty) tensors are left out."""
    import torch

    out = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point() or param.numel() == 0:
                continue
            flat = param.detach().reshape(-1)
            out[name] = flat[spread_indices(flat.numel(), _FINGERPRINT_VALUES).to(flat.device)].float().cpu().tolist()
    return out


def spread_indices(n: int, k: int) -> Any:
    """``min(k, n)`` evenly spaced indices of ``range(n)``, first and last included, in integer arithmetic (float32
    ``linspace`` rounds ``n - 1`` up to ``n`` past 2^24 elements: an embedding of 151,936 x 2,560)."""
    import torch

    k = min(k, n)
    return torch.arange(k, dtype=torch.long) * (n - 1) // max(k - 1, 1)


def write_base_fingerprint(model: Any, folder: Path) -> None:
    """Save the fingerprint of the base a PeftModel was wrapped on (taken when it was wrapped) beside its adapter."""
    import json

    fingerprint = getattr(model, "dllm_base_fingerprint", None)
    if fingerprint:
        (Path(folder) / BASE_FINGERPRINT).write_text(json.dumps(fingerprint), encoding="utf-8")


def _check_same_base(fingerprint: dict[str, list[float]], path: Path) -> None:
    """One line when the adapter's saved fingerprint says it was trained on another base model."""
    import json

    saved_file = path / BASE_FINGERPRINT
    if not saved_file.is_file() or not fingerprint:
        return  # an adapter from elsewhere (peft, an older run): shapes are all that can be checked
    try:
        saved = json.loads(saved_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{saved_file}: unreadable ({type(e).__name__}); remove it to skip the check") from None
    pairs = [(a, b) for name in saved.keys() & fingerprint.keys() for a, b in zip(saved[name], fingerprint[name])]
    differ = sum(abs(a - b) > _FINGERPRINT_RTOL * abs(a) + 1e-6 for a, b in pairs)
    if pairs and differ > len(pairs) // 10:
        base = _adapter_base_name(path)
        raise ModelLoadError(f"{path}: the adapter was trained on another base model ({differ} of {len(pairs)} "
                             f"sampled base weights differ{'; it was trained on ' + repr(base) if base else ''}): "
                             "load it on its own base (or remove its base_fingerprint.json to force it)")


def _adapter_base_name(path: Path) -> str:
    import json

    try:
        return str(json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
                   or "")
    except (OSError, ValueError, AttributeError):
        return ""


def load_adapter(model: Any, path: str | Path, trainable: bool = False) -> Any:
    """``PeftModel.from_pretrained(model, path)`` after checking the adapter fits the model (one-line errors)."""
    from peft import PeftModel

    path = Path(path)
    _check_adapter_fits(model, path)
    fingerprint = base_fingerprint(model)
    _check_same_base(fingerprint, path)
    try:
        wrapped = PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except Exception as e:  # noqa: BLE001 - a broken adapter folder: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"{path}: cannot load the adapter ({type(e).__name__}: {first[:300]})") from None
    wrapped.dllm_base_fingerprint = fingerprint  # saved with the adapter's next checkpoint
    return wrapped


def merged_model(model: Any, path: str | Path) -> Any:
    """``model`` with the adapter in ``path`` merged into its weights (a plain model again)."""
    return load_adapter(model, path).merge_and_unload()


def _lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextmanager
def merged_for_sampling(model: Any):
    """Within: the active adapters of a PeftModel are merged into (copies of) its base weights; on exit the
    original weight tensors come back unchanged, bit for bit. Anything else (a plain model, 4-bit layers, layers
    already merged by an outer holder) is left as it is."""
    import torch
    from torch import nn

    if not is_peft(model):
        yield
        return
    from peft.tuners.lora.layer import ParamWrapper

    layers = [m for m in _lora_layers(model) if not m.merged and not m.__dict__.get("_served_packed", False)
              and (type(m.base_layer) is nn.Linear or isinstance(m, ParamWrapper))]  # packed: adapters applied
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = _adapted_weight(layer)
                saved.append((weight, weight.data))
                weight.data = weight.data.clone()
                layer.merge(adapter_names=list(layer.active_adapters))
        yield
    finally:
        for weight, data in saved:
            weight.data = data
        for layer in layers:
            layer.merged_adapters = []


def _adapted_weight(layer: Any) -> Any:
    """The base tensor a LoRA layer adds its delta to: a linear layer's weight, or the expert tensor a
    ``ParamWrapper`` (peft's target_parameters) adapts."""
    if hasattr(layer, "parameter_name"):
        return getattr(layer.get_base_layer(), layer.parameter_name)
    return layer.base_layer.weight
