"""Layers shared by every architecture: RoPE, RMSNorm, head split / merge, the init of fresh models."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, N, D] for rotate-half RoPE, computed in fp32 from explicit positions.

    Frequencies are computed on the fly (no buffer), so nothing can be left uninitialised by ``from_pretrained``.
    """
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def split_heads(x: Tensor, n_heads: int, head_dim: int) -> Tensor:
    b, n, _ = x.shape
    return x.view(b, n, n_heads, head_dim).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def init_linear_normal(module: nn.Module, std: float) -> None:
    """Plain normal init for freshly built (random) models; loading a checkpoint overwrites it."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
