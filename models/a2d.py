"""AR -> diffusion (A2D): turn a local Hugging Face autoregressive checkpoint into one of our diffusion families.

    python -m tools.a2d --source /path/to/SmolLM2-135M-Instruct --to dream --out runs/a2d/smollm2_dream
    python -m tools.a2d --source DIR --gguf-file model.gguf --to sdar --block-size 4 --out runs/a2d/smollm2_sdar

Sources: Llama, Qwen2 and Qwen3 causal LMs (``model_type`` llama / qwen2 / qwen3), from safetensors or, through
transformers, from a GGUF file (``--gguf-file``). Targets, both with the source's layers unchanged (a Llama has
no q/k/v biases and no q/k norm; Qwen2 has biases; Qwen3 has the norm: the families' configs say which):

* ``dream``: full attention with shifted logits (the hidden state at i predicts token i + 1, as the AR model's
  does), as Dream was built from Qwen2.5 (arXiv 2508.15487). On a clean causal layout the converted model's logits
  are exactly the AR model's, so it starts as the AR model and the adaptation only has to teach it to read masks
  and attend both ways.
* ``sdar``: block diffusion with ``--block-size``, no shift (position i predicts token i from the masks of its
  block), as SDAR was built from Qwen3 (JetAstra/SDAR). The weights are the AR model's; the adaptation teaches
  the unshifted prediction.

The mask token (``--mask-token``, default ``<|mask|>``) is added to the tokenizer as a new special token (never
the EOS or pad); its embedding row (and LM-head row, when untied) is the mean of the rows of the tokenizer's
tokens (not of the unused rows a padded vocabulary keeps after them, one of which the mask id takes), a neutral
input that no AR statistics single out (dllm's A2D recipes and Dream start from a fresh token the same way). The
chat template and every other tokenizer file are kept. ``config.json`` records the conversion under ``a2d``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.errors import UserError
from core.files import check_model_out, write_model_folder
from models.registry import A2D_SOURCES, family_spec, model_bases

TARGETS = ("dream", "sdar")


class ConversionError(UserError):
    """An AR checkpoint this converter cannot turn into a diffusion model (one line saying why)."""


def load_ar(source: str | Path, gguf_file: str | None = None) -> tuple[Any, Any]:
    """The AR model (float32, eval) and its tokenizer from a local folder; never runs remote code."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = Path(source)
    if not source.is_dir():
        raise ConversionError(f"--source {source}: not a folder (a local Hugging Face checkpoint)")
    _refuse_diffusion_source(source)
    if gguf_file and not (source / gguf_file).is_file():  # transformers would look for it on the Hub
        found = sorted(p.name for p in source.glob("*.gguf"))
        raise ConversionError(f"--gguf-file {gguf_file}: no such file in {source} (GGUF files there: "
                              f"{', '.join(found) or 'none'})")
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(str(source), trust_remote_code=False, **extra)
    except Exception as err:  # noqa: BLE001 - one line, not a traceback
        raise ConversionError(f"--source {source}: cannot read its config ({type(err).__name__}: "
                              f"{_first_words(err)})") from None
    check_source(config)
    tokenizer = _load(source, "tokenizer", AutoTokenizer.from_pretrained, **extra)  # cheap: fails before the weights
    model = _load(source, "weights", AutoModelForCausalLM.from_pretrained, dtype=torch.float32, **extra)
    return model.eval(), tokenizer


def _load(source: Path, what: str, loader: Any, **kwargs: Any) -> Any:
    try:
        return loader(str(source), trust_remote_code=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - one line, not a traceback
        raise ConversionError(f"--source {source}: cannot load its {what} ({type(err).__name__}: "
                              f"{_first_words(err)})") from None


def _first_words(err: Exception, limit: int = 200) -> str:
    """An error's first line, cut at a word (not mid-word) when it runs past ``limit`` characters."""
    line = (str(err).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def _refuse_diffusion_source(source: Path) -> None:
    """One line for a source that is already one of our diffusion families (transformers knows none of them)."""
    import json

    try:
        model_type = json.loads((source / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # no readable config.json (a GGUF folder): transformers reads what there is
    bases = model_bases(model_type)
    if bases:
        raise ConversionError(f"--source {source}: already a diffusion checkpoint (model_type {model_type!r}, "
                              f"model_base {' / '.join(bases)}); a2d converts autoregressive Llama / Qwen2 / "
                              "Qwen3 models")


def check_source(config: Any) -> None:
    """One line for an architecture or option the diffusion families cannot reproduce exactly."""
    kind = getattr(config, "model_type", None)
    if kind not in A2D_SOURCES:
        raise ConversionError(f"unsupported architecture {kind!r} ({getattr(config, 'architectures', None)}); "
                              f"A2D converts {', '.join(A2D_SOURCES)} causal LMs")
    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise ConversionError(f"rope_scaling {rope_type!r} is not supported (the diffusion families use plain RoPE)")
    if getattr(config, "mlp_bias", False):
        raise ConversionError("mlp_bias=true is not supported (the families' MLPs have no biases)")
    if getattr(config, "use_sliding_window", False):
        raise ConversionError("use_sliding_window=true is not supported (the families attend over every position)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {config.hidden_act!r} is not supported (the families' MLPs use SiLU)")


def add_mask_token(tokenizer: Any, mask_token: str) -> int:
    """Add ``mask_token`` as a new special token; returns its id."""
    if not mask_token.strip():
        raise ConversionError(f"--mask-token {mask_token!r}: give the new token some text (default <|mask|>)")
    if mask_token in tokenizer.get_vocab():
        raise ConversionError(f"--mask-token {mask_token!r} is already a token of this tokenizer (id "
                              f"{tokenizer.convert_tokens_to_ids(mask_token)}); choose a new one")
    tokenizer.add_special_tokens({"mask_token": mask_token})
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    if mask_id in {tokenizer.eos_token_id, tokenizer.pad_token_id} or mask_id is None:
        raise ConversionError(f"the tokenizer has no room for a new mask token ({mask_token!r} became id {mask_id})")
    return mask_id


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _eos_ids(ar: Any, tokenizer: Any) -> int | list[int] | None:
    """The tokenizer's EOS and every one the AR config lists (Llama 3.1's three): each must stop the sampler."""
    listed = getattr(ar, "eos_token_id", None)
    ids = sorted({*(listed if isinstance(listed, (list, tuple)) else [listed]), tokenizer.eos_token_id} - {None})
    return ids[0] if len(ids) == 1 else (ids or None)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def target_config(ar: Any, to: str, vocab: int, mask_id: int, tokenizer: Any, block_size: int) -> Any:
    """The diffusion family's config with the AR model's shapes."""
    common = dict(
        vocab_size=vocab, hidden_size=ar.hidden_size, intermediate_size=ar.intermediate_size,
        num_hidden_layers=ar.num_hidden_layers, num_attention_heads=ar.num_attention_heads,
        num_key_value_heads=ar.num_key_value_heads,
        head_dim=getattr(ar, "head_dim", None) or ar.hidden_size // ar.num_attention_heads,
        max_position_embeddings=ar.max_position_embeddings, rms_norm_eps=ar.rms_norm_eps, rope_theta=_rope_theta(ar),
        tie_word_embeddings=bool(getattr(ar, "tie_word_embeddings", False)),
        attention_bias=ar.model_type == "qwen2" or bool(getattr(ar, "attention_bias", False)),
        qk_norm=ar.model_type == "qwen3", mask_token_id=mask_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=_eos_ids(ar, tokenizer), bos_token_id=_first(tokenizer.bos_token_id, ar.bos_token_id),
    )
    if to == "dream":
        from models.dream import DreamConfig

        return DreamConfig(**common)
    from models.sdar import SDARConfig

    if block_size < 1 or ar.max_position_embeddings % block_size:
        raise ConversionError(f"--block-size {block_size} does not divide the model's {ar.max_position_embeddings} "
                              "positions")
    return SDARConfig(block_size=block_size, **common)


def converted_state(ar_model: Any, vocab: int, config: Any, mask_id: int) -> dict[str, torch.Tensor]:
    """The AR weights under the family's names (the same Qwen-style names), embedding and head grown to ``vocab``
    rows, the mask token's row (and any new one) the mean of the rows of the tokens before it: the tokenizer's own,
    not the unused rows a padded vocabulary (Qwen2.5, Qwen3) holds after them, where the mask id can land without
    the matrix growing; zero q/k/v biases where the family has biases and the source does not."""
    state = {k: v.detach().clone() for k, v in ar_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in state:
            old = state[key]
            mean = old[:mask_id].mean(0, keepdim=True)
            grown = torch.cat([old, mean.expand(vocab - old.shape[0], -1)]) if old.shape[0] < vocab else old
            grown[mask_id] = mean[0]
            state[key] = grown
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:  # a tied source saved without a head
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


def convert(source: str | Path, to: str, out: str | Path, block_size: int | None = None,
            mask_token: str = "<|mask|>", gguf_file: str | None = None, overwrite: bool = False) -> Path:
    """Write ``out``: the converted checkpoint (config, safetensors, tokenizer) that ``load_model`` and
    ``AutoModelForCausalLM`` read. ``block_size``: sdar only (default 4). ``overwrite``: replace a non-empty ``out``
    (swapped for the new folder once that is whole; refused otherwise)."""
    if to not in TARGETS:
        raise ConversionError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    if to == "dream" and block_size is not None:
        raise ConversionError(f"--block-size {block_size} has no effect with --to dream (full attention: no blocks; "
                              "a sampler's block size is a sampling setting): leave it out")
    block_size = 4 if block_size is None else block_size
    if block_size < 1:
        raise ConversionError(f"--block-size must be at least 1, got {block_size}")
    check_model_out(out, overwrite, source)
    ar_model, tokenizer = load_ar(source, gguf_file)
    ar = ar_model.config
    mask_id = add_mask_token(tokenizer, mask_token)
    vocab = max(ar.vocab_size, len(tokenizer))
    config = target_config(ar, to, vocab, mask_id, tokenizer, block_size)
    config.a2d = {"source": str(source), "gguf_file": gguf_file, "source_model_type": ar.model_type, "target": to,
                  "mask_token": mask_token, "mask_row_init": "mean of the embedding rows of the tokens before it",
                  "shifted_logits": to == "dream", "block_size": block_size if to == "sdar" else None}
    model = family_spec(to).model_class(config)
    state = converted_state(ar_model, vocab, config, mask_id)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    for key in expected - state.keys():
        if key.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[key] = torch.zeros_like(model.state_dict()[key])  # a bias-free source: zero biases, same outputs
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"the {ar.model_type} weights do not map onto {to} (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    def write(folder: Path) -> None:  # a fresh folder: no file of an earlier conversion stays (a stray shard)
        model.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))

    return write_model_folder(out, write)
