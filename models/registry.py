"""`model_base` -> family adapter, and `load_model`: the only place that knows how families differ.

The adapter carries what shared code must know about a family (mask/pad/eos ids, block or full attention, logit
shift, how to run a forward with a layout and a cache); samplers and trainers receive it and never branch on the
family name.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from models.common import AttentionLayout, KVCache
from models.dream import DreamBaseModel, DreamConfig, DreamModel
from models.errors import ModelLoadError, not_a_model_folder
from models.kinds import ATTENTION_OF
from models.layers import head_weight, native_cpu_bf16
from models.llada import LLaDAConfig, LLaDAModel, LLaDAModelLM, MMadaConfig, MMadaModelLM
from models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM
from models.llada_moe import LLaDAMoEConfig, LLaDAMoEModel, LLaDAMoEModelLM
from models.sdar import SDARConfig, SDARForCausalLM, SDARModel
from models.sdar_moe import SDARMoeConfig, SDARMoeForCausalLM, SDARMoeModel


@dataclass(frozen=True)
class FamilySpec:
    family: str
    model_types: tuple[str, ...]  # config.model_type values accepted for this model_base
    model_class: type
    attention: str  # "block" | "full"
    shift_logits: bool
    turn_end: str  # token closing an assistant turn (a natural stop token)
    backbone_class: type  # the model without its LM head: what the value model puts its value head on
    # LoRA's default targets (lora.target_modules: null): the attention and MLP projections, by the family's own
    # module names (a name matches every layer's module of that name; the LM head is never a default target)
    lora_targets: tuple[str, ...] = ()
    # LoRA's default parameter targets (lora.target_parameters: null): a MoE family's fused routed experts, which
    # are tensors of a module, not linear modules (peft's target_parameters)
    lora_parameters: tuple[str, ...] = ()


_QWEN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LLADA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
_LLADA2_TARGETS = ("query_key_value", "dense", "gate_proj", "up_proj", "down_proj")
_EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")  # models/moe.py FusedExperts
A2D_SOURCES = ("llama", "qwen2", "qwen3")  # autoregressive architectures models/a2d.py converts

FAMILIES: dict[str, FamilySpec] = {
    "trado": FamilySpec("sdar", ("sdar",), SDARForCausalLM, ATTENTION_OF["trado"], False, "<|im_end|>", SDARModel,
                        _QWEN_TARGETS),
    "sdar": FamilySpec("sdar", ("sdar",), SDARForCausalLM, ATTENTION_OF["sdar"], False, "<|im_end|>", SDARModel,
                       _QWEN_TARGETS),
    "sdar_moe": FamilySpec("sdar", ("sdar_moe",), SDARMoeForCausalLM, ATTENTION_OF["sdar_moe"], False,
                           "<|im_end|>", SDARMoeModel, _QWEN_TARGETS, _EXPERT_PARAMETERS),
    "dream": FamilySpec("dream", ("Dream", "dream"), DreamModel, ATTENTION_OF["dream"], True,
                        "<|im_end|>", DreamBaseModel, _QWEN_TARGETS),
    "llada": FamilySpec("llada", ("llada",), LLaDAModelLM, ATTENTION_OF["llada"], False, "<|eot_id|>", LLaDAModel,
                        _LLADA_TARGETS),
    "mmada": FamilySpec("llada", ("mmada", "llada"), MMadaModelLM, ATTENTION_OF["mmada"], False,
                        "<|eot_id|>", LLaDAModel, _LLADA_TARGETS),
    "llada2": FamilySpec("llada2", ("llada2_moe",), LLaDA2MoeModelLM, ATTENTION_OF["llada2"], False, "<|role_end|>",
                         LLaDA2MoeModel, _LLADA2_TARGETS, _EXPERT_PARAMETERS),
    # the hub config says model_type "llada", as dense LLaDA's: load_model tells them apart (is_llada_moe)
    "llada_moe": FamilySpec("llada", ("lladamoe", "llada"), LLaDAMoEModelLM, ATTENTION_OF["llada_moe"], False,
                            "<|role_end|>", LLaDAMoEModel, _QWEN_TARGETS, _EXPERT_PARAMETERS),
}


def register_auto_classes() -> None:
    """Register our classes with the Auto* factories so `from_pretrained(local_dir)` works by model_type."""
    for cfg_cls, base_cls, lm_cls in (
        (SDARConfig, SDARModel, SDARForCausalLM),
        (SDARMoeConfig, SDARMoeModel, SDARMoeForCausalLM),
        (DreamConfig, None, DreamModel),
        (LLaDAConfig, None, LLaDAModelLM),
        (MMadaConfig, None, MMadaModelLM),
        (LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM),
        (LLaDAMoEConfig, LLaDAMoEModel, LLaDAMoEModelLM),
    ):
        with contextlib.suppress(ValueError):  # already registered
            AutoConfig.register(cfg_cls.model_type, cfg_cls)
        for auto, cls in ((AutoModel, base_cls or lm_cls), (AutoModelForCausalLM, lm_cls)):
            with contextlib.suppress(ValueError):
                auto.register(cfg_cls, cls)


register_auto_classes()


@dataclass
class Adapter:
    """What shared code needs to know about a loaded model: the one contract between a family and the core."""

    model: Any
    model_base: str
    family: str
    attention: str
    block_size: int | None
    mask_id: int
    pad_id: int
    eos_ids: tuple[int, ...]
    shift_logits: bool
    tokenizer: Any = None
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    lora_targets: tuple[str, ...] = ()  # the family's default LoRA target modules (FamilySpec.lora_targets)
    lora_parameters: tuple[str, ...] = ()  # and target parameters (FamilySpec.lora_parameters)

    @property
    def backbone(self):
        return self.model.backbone

    @property
    def position_limit(self) -> int | None:
        """The positions the model accepts (``max_position_embeddings``; LLaDA's config maps its
        ``max_sequence_length`` to that name), or None when the config sets none."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def hidden(self, input_ids: Tensor, position_ids: Tensor, layout: AttentionLayout,
               cache: KVCache | None = None, store_kv: bool | int = False) -> Tensor:
        """Final normalised hidden states [B, N, H] for the given layout (and cache)."""
        return self.backbone(input_ids, position_ids=position_ids, layout=layout, past_key_values=cache,
                             store_kv=store_kv).last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """LM head on (a selection of) hidden states."""
        return self.model.lm_logits(hidden)

    def head_weight(self) -> Tensor | None:
        """The LM head's weight where ``logits`` is exactly ``hidden @ weight.T`` (models.layers.plain_head_weight),
        else None."""
        return head_weight(self.model)

    def forward(self, input_ids: Tensor, position_ids: Tensor, layout: AttentionLayout,
                cache: KVCache | None = None, store_kv: bool = False) -> Tensor:
        """Logits [B, N, V] as the model emits them (for shifted families, position i predicts token i+1)."""
        return self.logits(self.hidden(input_ids, position_ids, layout, cache, store_kv))

    def new_cache(self) -> KVCache:
        return self.model.new_cache()

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt rendered with the tokenizer's chat template (a str is one user turn).

        Message contents are always encoded as text: special-token strings inside them (``<|MASK|>``,
        ``<|im_end|>``) stay text, so data can never inject a mask id or a fake turn; special tokens come only
        from the template.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        tok = self.tokenizer
        if not any(sp in str(m.get("content", "")) for m in messages for sp in tok.all_special_tokens):
            out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return list(out)
        marked = [dict(m, content=f"{_MARK}{i}{_MARK}") for i, m in enumerate(messages)]
        rendered = tok.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids: list[int] = []
        for j, piece in enumerate(rendered.split(_MARK)):
            if j % 2:
                ids += self.encode_text(str(messages[int(piece)]["content"]))
            elif piece:
                ids += tok.encode(piece, add_special_tokens=False)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text (special-token strings in it are split into ordinary tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


_MARK = "\ue000"  # a private-use character marking where message contents go in the rendered template


def _family_hint(model_type: Any, raw: dict) -> str:
    """What to do with a checkpoint of another model_type: the family that reads it, or A2D for an AR model."""
    if model_type in A2D_SOURCES:
        return (f": an autoregressive {model_type} checkpoint; convert it first (python -m tools.a2d --source ... "
                "--to sdar|dream)")
    if model_type == "llada" and is_llada_moe(raw):
        return "; this checkpoint loads with model.model_base=llada_moe"
    bases = [base for base in model_bases(model_type) if base != "llada_moe"]
    return f"; this checkpoint loads with model.model_base={' or '.join(bases)}" if bases else ""


def model_bases(model_type: Any) -> list[str]:
    """The model_base values whose families read a checkpoint of ``model_type``."""
    return [base for base, spec in FAMILIES.items() if model_type in spec.model_types]


def family_spec(model_base: str) -> FamilySpec:
    if model_base not in FAMILIES:
        raise ModelLoadError(f"unknown model_base {model_base!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[model_base]


def make_adapter(model: Any, tokenizer: Any, model_base: str, block_size: int | None = None) -> Adapter:
    """Adapter for an already-built model and tokenizer (tests build tiny models this way)."""
    spec = family_spec(model_base)
    mask_id = _mask_id(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ModelLoadError("tokenizer has neither a pad token nor an EOS token")
    eos_ids = _eos_ids(tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None))
    turn_end = tokenizer.convert_tokens_to_ids(spec.turn_end) if spec.turn_end in tokenizer.get_vocab() else None
    stop_ids = tuple(sorted(set(eos_ids) | ({turn_end} if turn_end is not None else set())))
    bs = block_size or (getattr(model.config, "block_size", None) if spec.attention == "block" else None)
    return Adapter(model=model, model_base=model_base, family=spec.family, attention=spec.attention,
                   block_size=bs, mask_id=mask_id, pad_id=pad_id, eos_ids=eos_ids, shift_logits=spec.shift_logits,
                   tokenizer=tokenizer, stop_ids=stop_ids, lora_targets=spec.lora_targets,
                   lora_parameters=spec.lora_parameters)


def _eos_ids(*sources: Any) -> tuple[int, ...]:
    """Every EOS id the tokenizer or the config names; a config may list several (e.g. Llama 3's three)."""
    ids = set()
    for source in sources:
        ids.update(i for i in (source if isinstance(source, (list, tuple)) else [source]) if isinstance(i, int))
    return tuple(sorted(ids))


def _mask_id(tokenizer: Any, model: Any) -> int:
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        # The reference silently falls back to the pad id (Gen-Verse/dLLM-RL sample/jetengine_ext/engine/llm_engine.py):
        # denoising with the wrong token.
        raise ModelLoadError(
            "tokenizer has no mask token (set tokenizer.mask_token, e.g. '<|MASK|>' for TraDo/SDAR, "
            "'<|mask|>' for Dream, '<|mdm_mask|>' for LLaDA)"
        )
    cfg_mask = getattr(model.config, "mask_token_id", None)
    if isinstance(cfg_mask, int) and cfg_mask != mask_id and cfg_mask < model.config.vocab_size:
        raise ModelLoadError(f"tokenizer mask id {mask_id} differs from the model config's mask_token_id {cfg_mask}")
    return mask_id


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# what load_model reads of a plain dict, and the other keys of a job's model section it passes over
LOAD_KEYS = ("pretrained_model", "model_base", "tokenizer", "dtype", "attn_backend", "adapter")
_JOB_MODEL_KEYS = ("init_tiny_if_missing", "optimized_name", "value_base_model", "optimized_value_name",
                   "process_reward_model")


def _check_model_keys(cfg: dict) -> None:
    """One line for a key ``load_model`` would silently pass over (a typo), naming the closest it reads."""
    import difflib

    for key in cfg:
        if key not in LOAD_KEYS and key not in _JOB_MODEL_KEYS:
            close = difflib.get_close_matches(str(key), LOAD_KEYS, n=1)
            raise ModelLoadError(f"unknown model key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; load_model reads {', '.join(LOAD_KEYS)}")


def load_model(cfg: Any, device: str | torch.device = "cpu", load_in_4bit: bool = False,
               map_weights: bool = True) -> Adapter:
    """Load ``cfg.pretrained_model`` (a local folder) for ``cfg.model_base``; returns its adapter (which holds the
    model and the tokenizer).

    ``cfg`` is the ``model`` section of a job config (attribute or key access): pretrained_model, model_base,
    optional tokenizer (folder), dtype, attn_backend, optional adapter (a LoRA adapter folder merged into the
    weights at load, models/lora.py). The adapter's block size is the checkpoint's own (``config.block_size`` of
    block models); samplers and training views take theirs from their settings. ``load_in_4bit``: the weights in
    4-bit NF4 (QLoRA; CUDA only). ``map_weights=False``: safetensors files are read into the process's own memory
    instead of being memory-mapped (on CPU a mapped tensor shares one mapping with the whole file, so freeing it
    frees nothing; see ``load_policy``).
    """
    if isinstance(cfg, dict):  # a plain dict from Python (a job's model section was checked when it loaded)
        _check_model_keys(cfg)
    get = (lambda k, d=None: cfg.get(k, d)) if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
    model_base = get("model_base")
    spec = family_spec(model_base)
    path = Path(str(get("pretrained_model")))
    if not (path / "config.json").is_file():
        raise ModelLoadError(not_a_model_folder(path))
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: not a valid JSON config ({e})") from None
    if model_type not in spec.model_types:
        raise ModelLoadError(f"{path}: model_type {model_type!r} does not match model_base {model_base!r} "
                             f"(expected {' or '.join(spec.model_types)}){_family_hint(model_type, raw)}")
    moe = model_type == "llada" and is_llada_moe(raw)
    if model_type == "llada" and moe != (model_base == "llada_moe"):
        which, base = ("LLaDA-MoE", "llada_moe") if moe else ("dense LLaDA", "llada or mmada")
        raise ModelLoadError(f"{path}: this model_type 'llada' checkpoint is {which} (it has "
                             f"{'' if moe else 'no '}num_experts): set model.model_base={base}")
    dtype_name = get("dtype", "float32") or "float32"
    if dtype_name not in DTYPES:
        raise ModelLoadError(f"dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not native_cpu_bf16():
        warnings.warn("model.dtype=bfloat16 on a CPU without native bf16 products (no AVX512-BF16 or AMX): every "
                      "product runs several to hundreds of times slower than with model.dtype=float32", stacklevel=2)
    overrides = {"attn_backend": get("attn_backend", "sdpa") or "sdpa"}
    if load_in_4bit:
        overrides.update(_four_bit(dtype, device))
    tokenizer = load_tokenizer(get("tokenizer") or path)
    if not map_weights:
        overrides["disable_mmap"] = True
    model = _from_pretrained(spec.model_class, path, dtype, overrides)
    if not load_in_4bit:  # a quantized model is placed by device_map and cannot be moved
        model = model.to(device)
    if get("adapter"):
        from models.lora import merged_model

        model = merged_model(model, get("adapter"))
    rows = model.get_input_embeddings().num_embeddings  # (the weight may be partitioned by ZeRO-3)
    if len(tokenizer) > rows:
        raise ModelLoadError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                             f"{rows} rows (a tokenizer of another model? set model.tokenizer)")
    return make_adapter(model, tokenizer, model_base)


def load_policy(model_cfg: Any, lora: Any, resume_adapter: str | Path | None, device: Any) -> Adapter:
    """The policy of a training job: ``load_model(model_cfg)``, wrapped with LoRA adapters (models/lora.py) when
    ``lora.enabled``: fresh ones, or those saved in ``resume_adapter`` to continue from. Without LoRA,
    ``resume_adapter`` is a whole checkpoint to load instead of ``model_cfg.pretrained_model``."""
    from core.schema import replace

    if lora is None or not lora.enabled:
        return load_model(model_cfg if resume_adapter is None else replace(model_cfg, pretrained_model=str(
            resume_adapter)), device=device)
    from models.lora import wrap

    # The frozen base of a LoRA policy on CPU is read into the process's own memory: never written, it would stay a
    # map of the checkpoint file, whose pages cannot leave while any tensor of the file lives, so the sampler's
    # packed products could not stand in for it (models.layers.packed_projections parks what they hold).
    own = torch.device(device).type == "cpu"
    return wrap(load_model(model_cfg, device=device, load_in_4bit=lora.load_in_4bit, map_weights=not own), lora,
                resume_adapter)


def is_llada_moe(config: dict) -> bool:
    """Whether a ``config.json`` (as a dict) is LLaDA-MoE's. Its hub config says model_type "llada", as dense
    LLaDA-8B's does; only the MoE one has experts (``num_experts``) or names ``LLaDAMoEModelLM``."""
    return bool(config.get("num_experts")) or any("MoE" in str(a) for a in config.get("architectures") or ())


def _four_bit(dtype: torch.dtype, device: str | torch.device) -> dict:
    """from_pretrained arguments of a 4-bit NF4 base (QLoRA): CUDA and bitsandbytes only, one line otherwise."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        raise ModelLoadError("lora.load_in_4bit (QLoRA) needs a CUDA GPU, and this process has none; set "
                             "lora.load_in_4bit=false to train LoRA adapters on the unquantized model")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelLoadError("lora.load_in_4bit (QLoRA) needs the bitsandbytes package "
                             "(pip install bitsandbytes)") from None
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True),
            "device_map": {"": torch.device(device)}}


def _from_pretrained(model_class: type, path: Path, dtype: torch.dtype, overrides: dict) -> Any:
    """``from_pretrained`` with one-line errors for missing, truncated or mismatched weight files."""
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")]
    if not weights:
        raise ModelLoadError(f"{path}: no weight files (*.safetensors or *.bin) in the checkpoint folder")
    try:
        model, info = model_class.from_pretrained(str(path), dtype=dtype, output_loading_info=True, **overrides)
    except Exception as e:  # noqa: BLE001 - any failure here is a broken checkpoint folder: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"{path}: cannot load the weights ({type(e).__name__}: {first[:300]})") from None
    # transformers fills a missing weight with a fresh random one and only logs it: a renamed or truncated
    # checkpoint would train and evaluate partly random. Weights the model has no place for are dropped: said, as
    # some checkpoints carry extra heads (multi-token prediction, vision) the text model does not use
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint does not match {model_class.__name__}: {len(missing)} missing "
                             f"weight(s), e.g. {', '.join(missing[:3])} (renamed, truncated or another "
                             "architecture's weights; they would be random)")
    if unexpected:
        print(f"note: {path}: {len(unexpected)} weight(s) of the checkpoint have no place in "
              f"{model_class.__name__} and are not loaded, e.g. {', '.join(unexpected[:3])}", file=sys.stderr,
              flush=True)
    return model


# Remote-code tokenizer classes whose files are a standard tokenizer's: Dream's DreamTokenizer is Qwen2's
# byte-level BPE (vocab.json + merges.txt, Qwen2 split regex) plus the added tokens its tokenizer_config lists.
_STANDARD_FOR_REMOTE = {"DreamTokenizer": "Qwen2Tokenizer"}


def _remote_tokenizer_class(path: Path) -> str | None:
    """The tokenizer class a folder's tokenizer_config.json names through ``auto_map`` (custom code), else None."""
    cfg_file = path / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file}: not a valid JSON tokenizer config ({e})") from None
    auto = (cfg.get("auto_map") or {}).get("AutoTokenizer") if isinstance(cfg, dict) else None
    if not auto:
        return None
    # auto_map's AutoTokenizer is "module.Class" or a [slow, fast] pair of them.
    first = next((a for a in (auto if isinstance(auto, list) else [auto]) if a), "")
    return str(cfg.get("tokenizer_class") or first.rsplit(".", 1)[-1])


def _standard_tokenizer(path: Path, remote: str):
    """The standard tokenizer equivalent to a remote-code one: same files, same ids, no custom code run."""
    import transformers

    if (path / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    standard = _STANDARD_FOR_REMOTE.get(remote, remote)  # SDAR's auto_map names a copy of Qwen2Tokenizer
    if hasattr(transformers, standard) and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return getattr(transformers, standard).from_pretrained(str(path), local_files_only=True)
    raise ModelLoadError(f"{path}: the tokenizer class {remote!r} is remote code (auto_map), which is never run, and "
                         "the folder has no tokenizer.json (or vocab.json + merges.txt of a known equivalent)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one


def load_tokenizer(path: str | Path):
    """A local tokenizer folder's tokenizer; remote code (auto_map) is never executed nor prompted for."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer path {str(path)!r} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{str(path)!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): point at the "
                             "checkpoint's folder")
    remote = _remote_tokenizer_class(path)
    try:
        if remote:
            return _standard_tokenizer(path, remote)
        # trust_remote_code=False: transformers raises instead of asking "[y/N]" on a terminal.
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - surface a one-line cause
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {first[:300]}") from None
