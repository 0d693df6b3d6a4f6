"""Shared sparse mixture-of-experts block (Qwen3-MoE style): an fp32 softmax router picks top-k experts per token,
each expert is a SwiGLU MLP run only on the tokens routed to it.

Parameter names match the public checkpoints (SDAR-30B-A3B, Qwen3-MoE): ``gate.weight`` (the router),
``experts.{i}.{gate,up,down}_proj.weight``.

Grouped compute: the (token, slot) pairs are sorted by expert (argsort), per-expert counts come from bincount, and
the sorted rows are split by those counts so each expert multiplies only its own rows; results are scaled by the
routing weights and scattered back with index_add_. Splitting needs the counts on the host: one device-to-host copy
of ``num_experts`` integers per layer (torch's grouped mm, ``torch._grouped_mm``, avoids it but on CPU in torch 2.13
requires 16-byte-aligned strides and is not used yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def grouped_expert_compute(x: Tensor, weights: Tensor, index: Tensor, experts: nn.ModuleList) -> Tensor:
    """sum_k weights[t, k] * experts[index[t, k]](x[t]) for every token t, each expert run on its own tokens only."""
    n_tokens, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k  # the token each sorted (token, slot) pair came from
    # counted by a scatter, not bincount, whose CUDA kernel syncs on its own to size its output
    counts = flat.new_zeros(len(experts)).scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts.tolist()  # the one host copy (see module docstring)
    rows = x.index_select(0, token_of)
    # Under DeepSpeed ZeRO-3 an expert's weights are gathered by a collective when its module runs, so every rank
    # runs every expert, an idle one on zero rows: ranks that skipped different experts would pair up the wrong
    # gathers (same shapes: no error, wrong weights) or wait for ever.
    every = _partitioned(experts)
    outs = [experts[e](chunk) for e, chunk in enumerate(rows.split(counts)) if counts[e] or every]
    out_rows = torch.cat(outs) if outs else rows.new_zeros((0, x.shape[-1]))
    scaled = out_rows * weights.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


def _partitioned(experts: nn.ModuleList) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the experts' weights (its parameters carry a ``ds_id``)."""
    return hasattr(experts[0].gate_proj.weight, "ds_id")


def naive_expert_compute(x: Tensor, weights: Tensor, index: Tensor, experts: nn.ModuleList) -> Tensor:
    """Reference: every expert on every token, combined with the dense routing weights (tests and bench only)."""
    dense = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device)
    dense.scatter_(1, index, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out = out + expert(x) * dense[:, e : e + 1].to(x.dtype)
    return out


def load_balancing_loss(router_logits: Tensor, index: Tensor, num_experts: int) -> Tensor:
    """Switch / Qwen3-MoE auxiliary loss: num_experts * sum_e (fraction of routed slots to e) * (mean prob of e)."""
    probs = F.softmax(router_logits.float(), dim=-1)
    routed = F.one_hot(index, num_experts).float().sum(dim=1)  # [T, E]: slots per expert per token
    fraction = routed.mean(dim=0) / index.shape[1]
    return num_experts * (fraction * probs.mean(dim=0)).sum()


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
        self.experts = nn.ModuleList(ExpertMLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.register_buffer("expert_bias", None)  # a family may set one (a tensor [E]): see softmax_topk_routing
        self.last_router_logits: Tensor | None = None

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits fp32, weights fp32, indices) for flattened tokens [T, H]."""
        logits = F.linear(flat.float(), self.gate.weight.float())
        weights, index = softmax_topk_routing(logits, self.top_k, self.norm_topk_prob, self.expert_bias)
        return logits, weights, index

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, index = self.route(flat)
        self.last_router_logits = logits if self.keep_router_logits else None
        out = grouped_expert_compute(flat, weights.to(x.dtype), index, self.experts)
        return out.reshape(x.shape)

    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the last forward (None unless output_router_logits)."""
        if self.last_router_logits is None:
            return None
        _, index = torch.topk(self.last_router_logits, self.top_k, dim=-1)
        return load_balancing_loss(self.last_router_logits, index, self.num_experts)


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

    def router_aux_loss(self) -> Tensor | None:
        """Mean load-balancing loss over the sparse layers of the last forward (None unless output_router_logits)."""
        losses = [loss for loss in (b.aux_loss() for b in self.moe_blocks()) if loss is not None]
        return sum(losses) / len(losses) if losses else None
