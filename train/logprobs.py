"""Log-probabilities of trained tokens only: gather hidden states [T, H], then the LM head in chunks.

Never materialises [batch, seq, vocab] logits (at vocab 151,936 they would dominate training memory; the reference
computes logits at every position, Gen-Verse/dLLM-RL train/rl_trado.py). Each chunk's
logits are computed in fp32 for the log-softmax and, when gradients are needed, recomputed in the backward pass
(activation checkpointing per chunk), so peak memory is O(chunk x vocab) instead of O(T x vocab).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LogitsFn = Callable[[Tensor], Tensor]


def gather_hidden(hidden: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Hidden states [T, H] at (row, col) pairs of a [R, N, H] tensor."""
    return hidden[rows.to(hidden.device), cols.to(hidden.device)]


def _chunk_logprobs(logits_fn: LogitsFn, hidden: Tensor, labels: Tensor) -> Tensor:
    logits = logits_fn(hidden).float()
    return logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def token_logprobs(logits_fn: LogitsFn, hidden: Tensor, labels: Tensor, chunk_size: int = 128) -> Tensor:
    """fp32 log p(label | hidden) for [T, H] hidden states, the LM head applied ``chunk_size`` rows at a time."""
    labels = labels.to(hidden.device)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    out = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
        if recompute:
            # No metadata check at recompute: under ZeRO-3 a frozen head (a LoRA policy's) is re-partitioned in place
            # right after the recompute (torch keeps frozen tensors undetached), and gathered again by DeepSpeed's
            # pre-backward hook before the product's backward reads it; the check would see the empty shard.
            out.append(checkpoint(_chunk_logprobs, logits_fn, h, y, use_reentrant=False, determinism_check="none"))
        else:
            out.append(_chunk_logprobs(logits_fn, h, y))
    return torch.cat(out)


def gathered_logprobs(logits_fn: LogitsFn, hidden: Tensor, rows: Tensor, cols: Tensor, labels: Tensor,
                      chunk_size: int = 128) -> Tensor:
    """Our way: gather the trained positions' hidden states, then chunked LM head + fp32 log-softmax."""
    return token_logprobs(logits_fn, gather_hidden(hidden, rows, cols), labels, chunk_size)


def full_logits_logprobs(logits_fn: LogitsFn, hidden: Tensor, rows: Tensor, cols: Tensor,
                         labels: Tensor) -> Tensor:
    """The reference's way (Gen-Verse/dLLM-RL train/rl_trado.py forward_process): [R, N, V] logits, log-softmax over
    everything, then gather.

    Kept only as the baseline of ``bench/train.py`` and as a cross-check in tests.
    """
    logp = F.log_softmax(logits_fn(hidden).float(), dim=-1)
    return logp[rows.to(hidden.device), cols.to(hidden.device), labels.to(hidden.device)]
