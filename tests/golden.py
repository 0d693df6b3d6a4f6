"""Models for golden fixtures: numbers computed once by the public modeling code (outside this repository) on a tiny
model whose every tensor comes from one seeded generator."""

from __future__ import annotations

import torch
from torch import Tensor


def fill_seeded(model: torch.nn.Module, seed: int, *, weight: float, bias: float, head: float) -> torch.nn.Module:
    """Every parameter and buffer of ``model`` drawn from one generator seeded ``seed``, in name order: norm weights
    1 + 0.1 N(0, 1), expert biases ``bias`` N(0, 1), the LM head ``head`` N(0, 1) (sharp enough that some
    confidences pass a threshold), every other tensor ``weight`` N(0, 1). Names and shapes are the checkpoint's
    (fused experts are filled through their per-expert views), as the public code that made the numbers has them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(_checkpoint_views(model.state_dict(keep_vars=True)).items()):
            noise = torch.randn(tensor.shape, generator=g)
            if "norm" in name:
                tensor.copy_(1 + 0.1 * noise)
            elif name.endswith("expert_bias"):
                tensor.copy_(bias * noise)
            elif name == "lm_head.weight":
                tensor.copy_(head * noise)
            else:
                tensor.copy_(weight * noise)
    return model


def _checkpoint_views(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with every fused expert tensor (models/moe.py ``FusedExperts``) split into the checkpoint's
    per-expert tensors under their names on disk, as views, so filling them fills the model (transformers'
    ``revert_weight_conversion`` gives the same names and values, as copies)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            stem = name.removesuffix("down_proj")
            out.update({f"{stem}{e}.down_proj.weight": w for e, w in enumerate(tensor)})
        else:
            out[name] = tensor
    return out
