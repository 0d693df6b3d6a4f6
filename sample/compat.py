"""``block_diffusion_generate``: the TraDo / SDAR model cards' sampling function, as a thin layer over ``generate``.

For users coming from the model card::

    output_ids = block_diffusion_generate(model, prompt=tokenizer(text, return_tensors="pt"), mask_id=151669,
                                          gen_length=200, block_length=4, denoising_steps=4, temperature=1.0,
                                          top_k=0, top_p=1.0, remasking_strategy="low_confidence_dynamic",
                                          confidence_threshold=0.9)
    text = tokenizer.decode(output_ids[0], skip_special_tokens=False)

Arguments keep the model card's names and meaning; sampling itself is ``sample.generate.generate`` (the batched,
KV-cached block sampler), so the tokens are the sampler's for the same settings and seed. Differences from the
reference function, all deliberate:

* ``model`` may be the Hugging Face model (``SDARForCausalLM``, as on the model card) or one of our adapters
  (``models.registry.load_model``);
* ``prompt`` may also hold several rows (``input_ids`` [B, L] with an ``attention_mask`` marking padding), be a
  tensor, or a list of ids; every row is sampled in one batch;
* like the reference, the response runs to the end of the block holding position ``prompt + gen_length`` (the
  output covers whole blocks) and stops only at ``stopping_criteria_idx`` tokens (EOS included only if listed);
  a row that stops ends after its stop token, and rows shorter than the longest are right-padded with
  ``mask_id`` (the model card's ``.replace('<|MASK|>', '')`` cleaning removes them);
* randomness comes from a generator seeded with ``seed``; without one, the seed is drawn from torch's global
  RNG, so ``torch.manual_seed`` makes a call reproducible as it does for the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from models.registry import Adapter, family_spec
from sample.generate import generate
from sample.params import SamplingParams

__all__ = ["block_diffusion_generate"]


def block_diffusion_generate(model: Any, prompt: Any, mask_id: int, gen_length: int = 128, block_length: int = 4,
                             denoising_steps: int = 4, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                             remasking_strategy: str = "low_confidence_dynamic", confidence_threshold: float = 0.85,
                             stopping_criteria_idx: Sequence[int] | None = None, seed: int | None = None,
                             tokenizer: Any = None) -> Tensor:
    """Prompt + generated ids as a LongTensor [B, T] on the model's device; see the module docstring."""
    adapter = _block_adapter(model, mask_id, block_length, tokenizer)
    rows = _prompt_rows(prompt)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    # A row's budget depends on its prompt length (whole blocks): one batched call per distinct budget.
    budgets = {_budget(len(ids), gen_length, block_length) for ids in rows}
    responses: dict[int, list[int]] = {}
    for budget in sorted(budgets):
        which = [i for i, ids in enumerate(rows) if _budget(len(ids), gen_length, block_length) == budget]
        params = SamplingParams(max_tokens=budget, block_size=block_length, denoising_steps=denoising_steps,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                remasking_strategy=remasking_strategy, dynamic_threshold=confidence_threshold,
                                stop_token_ids=list(stopping_criteria_idx or []), seed=seed)
        params.check_for(adapter)
        for i, traj in zip(which, generate(adapter, [rows[i] for i in which], params, progress=False)):
            responses[i] = traj.response_ids
    full = [rows[i] + responses[i] for i in range(len(rows))]
    width = max(len(f) for f in full)
    device = next(adapter.model.parameters()).device
    return torch.tensor([f + [mask_id] * (width - len(f)) for f in full], dtype=torch.long, device=device)


def _budget(prompt_len: int, gen_length: int, block_length: int) -> int:
    """Response tokens of the reference: up to the end of the block that holds position prompt + gen_length."""
    return -(-(prompt_len + gen_length) // block_length) * block_length - prompt_len


def _block_adapter(model: Any, mask_id: int, block_length: int, tokenizer: Any) -> Adapter:
    """An adapter whose only stops are the caller's (the reference stops at nothing else, EOS included)."""
    if isinstance(model, Adapter):
        if model.attention != "block":
            raise ValueError(f"block_diffusion_generate is for block-diffusion models (TraDo / SDAR); this adapter "
                             f"is a {model.model_base} model: use sample.generate.generate")
        if model.mask_id != mask_id:
            raise ValueError(f"mask_id {mask_id} differs from the model's mask id {model.mask_id}")
        return dataclasses.replace(model, eos_ids=(), stop_ids=())
    cfg = model.config
    if getattr(cfg, "model_type", None) != "sdar":
        raise ValueError(f"block_diffusion_generate is for TraDo / SDAR models (model_type 'sdar'), got "
                         f"{getattr(cfg, 'model_type', None)!r}: load other families with models.registry.load_model "
                         "and sample with sample.generate.generate")
    rows = model.get_input_embeddings().num_embeddings
    if not 0 <= mask_id < rows:
        raise ValueError(f"mask_id {mask_id} is outside this model's vocabulary (ids 0 to {rows - 1}): pass the "
                         "id of its mask token")
    spec = family_spec("sdar")
    pad = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else mask_id
    return Adapter(model=model, model_base="sdar", family=spec.family, attention=spec.attention,
                   block_size=block_length, mask_id=mask_id, pad_id=pad, eos_ids=(), shift_logits=spec.shift_logits,
                   tokenizer=tokenizer, stop_ids=())


def _prompt_rows(prompt: Any) -> list[list[int]]:
    """Prompt token rows from a tokenizer output (``input_ids`` + optional ``attention_mask``), a tensor or ids."""
    mask = None
    if isinstance(prompt, Mapping) or hasattr(prompt, "input_ids"):
        ids = prompt["input_ids"]
        mask = prompt.get("attention_mask") if hasattr(prompt, "get") else None
    else:
        ids = prompt
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool().reshape(ids.shape)
    return [row[k].tolist() for row, k in zip(ids.cpu(), keep.cpu())]
