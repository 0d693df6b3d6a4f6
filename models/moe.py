"""Shared sparse mixture-of-experts block (Qwen3-MoE style): an fp32 softmax router picks top-k experts per token,
each expert is a SwiGLU MLP run only on the tokens routed to it.

Parameter names match the public checkpoints (SDAR-30B-A3B, Qwen3-MoE, LLaDA2, LLaDA-MoE) on disk: ``gate.weight``
(the router), ``experts.{i}.{gate,up,down}_proj.weight``. In memory a layer's experts are two tensors
(``FusedExperts``, transformers 5's Qwen3-MoE layout): ``experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows,
then its up rows) and ``experts.down_proj`` [E, H, I]. ``from_pretrained`` fuses the per-expert tensors on load and
``save_pretrained`` splits them back (transformers' weight conversions, registered per model class by
``register_fused_experts``), so checkpoints keep the public names.

Grouped compute: the (token, slot) pairs are sorted by expert (argsort), per-expert counts come from a scatter, and
one grouped matrix product (``torch._grouped_mm``, offsets = the counts' running sum) multiplies each expert's rows by
its own weights only. Nothing is read back to the host, so the forward never waits for the device (tested on the
meta device, where a host read fails). On CUDA that holds in bf16 on Hopper or newer; elsewhere on CUDA (fp32,
fp16, an older GPU, whose grouped product would copy the offsets to the host itself) and for rows not a multiple of
16 bytes wide, the rows are split by the counts on the host, one product per expert.
Under DeepSpeed ZeRO-3 the two tensors are gathered when the ``experts`` module runs, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.common import AttentionLayout
from models.layers import silu_mul


class ExpertMLP(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def softmax_topk_routing(router_logits: Tensor, top_k: int, normalize: bool, bias: Tensor | None = None
                         ) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, expert indices [T, k]) of an fp32 softmax router, renormalised over the top-k when
    ``normalize`` (Qwen3-MoE's norm_topk_prob). ``bias`` (LLaDA-MoE's ``expert_bias``) is added to the
    probabilities before the choice, so the weights carry it too, as in the authors' code."""
    probs = F.softmax(router_logits.float(), dim=-1)
    if bias is not None:
        probs = probs + bias.float()
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


def sigmoid_group_limited_routing(router_logits: Tensor, expert_bias: Tensor, top_k: int, n_group: int,
                                  topk_group: int, routed_scaling: float, normalize: bool = True
                                  ) -> tuple[Tensor, Tensor]:
    """(weights [T, k] fp32, expert indices [T, k]) of LLaDA2's router (DeepSeek-V3 style).

    Scores are fp32 sigmoids; ``expert_bias`` is added for the choice only. Experts are split into ``n_group``
    equal groups, a group scores the sum of its two best biased scores, only the ``topk_group`` best groups are
    eligible, and the top-k eligible experts are chosen. Weights are the unbiased sigmoids of the chosen experts,
    renormalised over them when ``normalize``, times ``routed_scaling`` (2.5 in LLaDA2.0-mini).
    """
    scores = torch.sigmoid(router_logits.float())
    biased = scores + expert_bias.float()
    n_tokens, n_experts = biased.shape
    grouped = biased.view(n_tokens, n_group, n_experts // n_group)
    group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best_groups = group_score.topk(topk_group, dim=-1).indices
    allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
    eligible = biased.masked_fill(~allowed.repeat_interleave(n_experts // n_group, dim=1), float("-inf"))
    index = eligible.topk(top_k, dim=-1).indices
    weights = scores.gather(1, index)
    if normalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, index


class FusedExperts(nn.Module):
    """A layer's routed experts as two tensors: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; forward
    returns sum_k weights[t, k] * expert_{index[t, k]}(x[t]) for every token t."""

    normal_init = ("gate_up_proj", "down_proj")  # models.layers.init_linear_normal draws them like nn.Linear weights

    def __init__(self, num_experts: int, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        for weight in (self.gate_up_proj, self.down_proj):  # nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in))
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)

    def __len__(self) -> int:
        return self.gate_up_proj.shape[0]

    def expert(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Expert ``e``'s (gate, up, down) weights, views in nn.Linear's [out, in] layout."""
        gate, up = self.gate_up_proj[e].chunk(2, dim=0)
        return gate, up, self.down_proj[e]

    def forward(self, x: Tensor, weights: Tensor, index: Tensor) -> Tensor:
        return grouped_expert_compute(x, weights, index, self.gate_up_proj, self.down_proj)

    def host_sync_free(self) -> bool:
        """Whether both projections run as one grouped product each (nothing read back to the host)."""
        return all(grouped_mm_runs(w.new_empty(0, w.shape[-1]), w) for w in (self.gate_up_proj, self.down_proj))


def expert_layers_sync_free(model: nn.Module) -> bool:
    """Whether every fused expert layer of ``model`` (none in a dense model) computes without a host sync, as a CUDA
    graph capture needs; the per-expert split copies the expert counts to the host."""
    return all(m.host_sync_free() for m in model.modules() if isinstance(m, FusedExperts))


def grouped_expert_compute(x: Tensor, weights: Tensor, index: Tensor, gate_up: Tensor, down: Tensor,
                           grouped: bool | None = None) -> Tensor:
    """sum_k weights[t, k] * expert_{index[t, k]}(x[t]) for every token t, each expert run on its own tokens only
    (``FusedExperts``' layout), without reading anything back to the host where the grouped product runs.
    ``grouped``: force the grouped product (True) or the per-expert split (False); None = wherever it runs."""
    n_tokens, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k  # the token each sorted (token, slot) pair came from
    # counted by a scatter, not bincount, whose CUDA kernel syncs on its own to size its output
    counts = flat.new_zeros(gate_up.shape[0]).scatter_add_(0, flat, torch.ones_like(flat))
    rows = x.index_select(0, token_of)
    gate, up = _per_expert_product(rows, gate_up, counts, grouped).chunk(2, dim=-1)
    out_rows = _per_expert_product(silu_mul(gate, up), down, counts, grouped)
    scaled = out_rows * weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled.to(x.dtype))


def _per_expert_product(rows: Tensor, weight: Tensor, counts: Tensor, grouped: bool | None = None) -> Tensor:
    """rows [N, in], sorted by expert with ``counts`` [E] rows each, times their expert's ``weight`` [E, out, in]
    transposed: [N, out]. Under autocast both sides are cast as ``F.linear`` would cast them."""
    device = rows.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        rows, weight = rows.to(dtype), weight.to(dtype)
    else:
        weight = weight.to(rows.dtype)
    if grouped if grouped is not None else grouped_mm_runs(rows, weight):
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    sizes = counts.tolist()  # a host copy: only where the grouped product cannot run
    # unbind, not weight[e]: the backward of E index views would add E gradients the size of the whole tensor
    per_expert = weight.unbind(0)
    outs = [F.linear(chunk, per_expert[e]) for e, chunk in enumerate(rows.split(sizes)) if sizes[e]]
    return torch.cat(outs) if outs else rows.new_zeros((0, weight.shape[1]))


def grouped_mm_runs(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands without waiting for the device: on CPU in fp32 / bf16 /
    fp16; on CUDA in bf16 on compute capability 9.0 or newer (Hopper's fused kernel; before it torch runs a loop that
    copies the offsets to the host, pytorch/pytorch#161407, #186620). Rows and weight rows must be a multiple of 16
    bytes wide."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16 or torch.cuda.get_device_capability(rows.device) < (9, 0):
            return False
    elif rows.device.type not in ("cpu", "meta") or rows.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    align = 16 // rows.element_size()
    return rows.shape[-1] % align == 0 and weight.shape[-2] % align == 0 and rows.stride(-1) == 1


def naive_expert_compute(x: Tensor, weights: Tensor, index: Tensor, experts: FusedExperts) -> Tensor:
    """Reference: every expert on every token, combined with the dense routing weights (tests and bench only)."""
    dense = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device)
    dense.scatter_(1, index, weights)
    out = torch.zeros_like(x)
    for e, (gate_up, down) in enumerate(zip(experts.gate_up_proj.unbind(0), experts.down_proj.unbind(0),
                                            strict=True)):
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        out = out + F.linear(silu_mul(gate, up), down) * dense[:, e : e + 1].to(x.dtype)
    return out


def register_fused_experts(*names: str) -> None:
    """Have ``from_pretrained`` / ``save_pretrained`` of the model classes (or model types) ``names`` fuse a
    checkpoint's per-expert tensors (``mlp.experts.{i}.{gate,up,down}_proj.weight``) into ``FusedExperts``' two
    tensors and split them back: transformers' own weight conversions, the ones it uses for Qwen3-MoE. By class name
    (transformers looks the class up first): a hub config may carry another family's model_type (LLaDA-MoE's
    "llada")."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    for name in names:
        register_checkpoint_conversion_mapping(name, [
            WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                            target_patterns="mlp.experts.gate_up_proj",
                            operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
            WeightConverter(source_patterns="mlp.experts.*.down_proj.weight",
                            target_patterns="mlp.experts.down_proj", operations=[MergeModulelist(dim=0)]),
        ], overwrite=True)


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int, num_experts: int,
                        real_tokens: Tensor | None = None) -> Tensor:
    """Switch / Qwen3-MoE auxiliary loss as transformers' ``load_balancing_loss_func`` (which the public SDAR-MoE
    and LLaDA-MoE modeling code calls) computes it: the tokens of every sparse layer together,
    num_experts * sum_e (tokens sending one of their top-k slots to e, summed over the k slots, per token) *
    (mean router probability of e). A balanced router scores top_k. ``real_tokens`` ([T] bool, the flattened
    batch's non-padding tokens) leaves the padding out, as that function's ``attention_mask`` does: otherwise a
    row's loss would depend on how long the other rows of its batch are."""
    if real_tokens is not None:
        router_logits = [logits[real_tokens] for logits in router_logits]
    probs = F.softmax(torch.cat([logits.float() for logits in router_logits]), dim=-1)
    index = torch.topk(probs, top_k, dim=-1).indices
    routed = F.one_hot(index, num_experts).float().sum(dim=1)  # [N, E]: slots per expert per token
    return num_experts * (routed.mean(dim=0) * probs.mean(dim=0)).sum()


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + ``experts``; forward returns the combined expert outputs, same shape as ``x``.

    After each forward, ``last_router_logits`` holds the fp32 router logits [T, E] when the config asks for
    ``output_router_logits`` (for the auxiliary loss), else None.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.keep_router_logits = bool(getattr(config, "output_router_logits", False))
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.register_buffer("expert_bias", None)  # a family may set one (a tensor [E]): see softmax_topk_routing
        self.last_router_logits: Tensor | None = None

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits fp32, weights fp32, indices) for flattened tokens [T, H]. The gate runs in the model's
        dtype and the softmax in fp32, as in Qwen3-MoE's block (SDAR-MoE's) and OLMoE's (LLaDA-MoE's): in bf16 a
        fp32 gate picks other experts for some tokens than the public code does."""
        logits = self.gate(flat).float()
        weights, index = softmax_topk_routing(logits, self.top_k, self.norm_topk_prob, self.expert_bias)
        return logits, weights, index

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, index = self.route(flat)
        self.last_router_logits = logits if self.keep_router_logits else None
        return self.experts(flat, weights, index).reshape(x.shape)


def is_moe_layer(config, layer_idx: int) -> bool:
    """Qwen3-MoE's rule: a sparse block unless listed in mlp_only_layers; every decoder_sparse_step-th layer."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1)
    return config.num_experts > 0 and (layer_idx + 1) % step == 0


class MoeBackboneMixin:
    """``moe_blocks`` and the router auxiliary loss of a backbone whose sparse layers are ``SparseMoeBlock``s (the
    trainer adds ``router_aux_loss_coef`` x ``router_aux_loss()`` to the loss when the config asks for it)."""

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    router_real_tokens: Tensor | None = None  # [B * N] bool: the last forward's non-padding tokens (None: all)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, layout: AttentionLayout | None = None, **kwargs: Any):
        out = super().forward(input_ids, attention_mask=attention_mask, position_ids=position_ids, layout=layout,
                              **kwargs)
        valid = layout.valid if layout is not None else (
            attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None)
        self.router_real_tokens = None if valid is None else valid.reshape(-1).bool()
        return out

    def router_aux_loss(self) -> Tensor | None:
        """The load-balancing loss over the sparse layers and real tokens of the last forward (None unless
        output_router_logits)."""
        blocks = [b for b in self.moe_blocks() if b.last_router_logits is not None]
        if not blocks:
            return None
        return load_balancing_loss([b.last_router_logits for b in blocks], blocks[0].top_k, blocks[0].num_experts,
                                   self.router_real_tokens)
