"""Log-probabilities of trained tokens only: gather hidden states [T, H], then the LM head in chunks.

Never materialises [batch, seq, vocab] logits (at vocab 151,936 they would dominate training memory; the reference
computes logits at every position, Gen-Verse/dLLM-RL train/rl_trado.py). Logits are held ``chunk_size`` x vocab at a
time, in fp32 for the log-softmax, and recomputed in the backward pass, so peak memory is O(chunk x vocab) instead
of O(T x vocab).

Two ways, the same log-probs and gradients:

* a plain head (a bias-free product with a weight the model hands out, ``lm_head_weight``): ``head_logprobs``, one
  autograd function over slices of the vocabulary. The weight is cast to the compute dtype once per call and its
  gradient written slice by slice into one buffer. Per token chunk through the module (below), autocast casts the
  whole [vocab, hidden] weight again at every chunk's recomputation and each chunk's weight gradient is a
  [vocab, hidden] tensor of its own, added up: on SmolLM2-135M's TraceRL step (6 micro-batches of ~350 trained
  tokens, vocab 49,152, tied) the head's forward and backward took 3.28 s that way and 2.37 s this way
  (``python -m bench.train --head``);
* any other head (peft-wrapped, hooked, ZeRO-3-partitioned): the module itself, a chunk of tokens at a time under
  activation checkpointing.
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


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's where it is on, else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _vocab_slices(vocab: int, tokens: int, chunk_size: int) -> range:
    """Starts of the vocabulary slices: ``tokens`` x slice logits stay within ``chunk_size`` x ``vocab``."""
    return range(0, vocab, max(1, chunk_size * vocab // max(tokens, 1)))


class _HeadLogprobs(torch.autograd.Function):
    """log p(label | h) = h . w[label] - logsumexp(h @ w.T), over slices of the vocabulary (an online
    logsumexp), in fp32 from products in ``dtype``; the backward recomputes each slice's logits."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, dtype: torch.dtype, chunk_size: int) -> Tensor:
        h, w = hidden.detach().to(dtype), weight.detach().to(dtype)  # the products in ``dtype``, autocast or not
        tokens, vocab = h.shape[0], w.shape[0]
        best = torch.full((tokens,), -torch.inf, device=h.device)
        total = torch.zeros(tokens, device=h.device)
        picked = torch.zeros(tokens, device=h.device)
        starts = _vocab_slices(vocab, tokens, chunk_size)
        with torch.autocast(h.device.type, enabled=False):
            for start in starts:
                logits = (h @ w[start:start + starts.step].T).float()
                top = torch.maximum(best, logits.max(-1).values)
                total = total * torch.exp(best - top) + torch.exp(logits - top[:, None]).sum(-1)
                best = top
                cols, inside = _label_columns(labels, start, logits.shape[1])
                picked += torch.where(inside, logits.gather(1, cols[:, None]).squeeze(1), 0.0)
        lse = best + torch.log(total)
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.dtype, ctx.hidden_dtype, ctx.chunk_size = dtype, hidden.dtype, chunk_size
        return picked - lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, labels, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        w = weight.detach().to(ctx.dtype)  # cast again rather than hold the copy from forward to backward
        grad_h = torch.zeros(h.shape, device=h.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        grad = grad.float()
        starts = _vocab_slices(w.shape[0], h.shape[0], ctx.chunk_size)
        with torch.autocast(h.device.type, enabled=False):  # the forward's dtype, whatever encloses the backward
            for start in starts:
                piece = w[start:start + starts.step]
                # d logp / d logits = onehot(label) - softmax, times the incoming gradient
                d_logits = torch.exp((h @ piece.T).float() - lse[:, None]).mul_(-grad[:, None])
                cols, inside = _label_columns(labels, start, piece.shape[0])
                d_logits.scatter_add_(1, cols[:, None], torch.where(inside, grad, 0.0)[:, None])
                d_logits = d_logits.to(ctx.dtype)
                if want_h:
                    grad_h += d_logits @ piece
                if want_w:
                    grad_w[start:start + starts.step] = d_logits.T @ h
        return (grad_h.to(ctx.hidden_dtype) if want_h else None), grad_w, None, None, None


def _label_columns(labels: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """Each label's column in the vocabulary slice [start, start + width) (clamped into it) and whether it falls
    there (no host sync, unlike selecting the rows)."""
    local = labels - start
    return local.clamp(0, width - 1), (local >= 0) & (local < width)


def head_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 128) -> Tensor:
    """fp32 log p(label | hidden) for [T, H] hidden states and a plain LM head ``weight`` [V, H] (logits
    ``hidden @ weight.T``), at most ``chunk_size`` x V logits at a time (one function; see the module docstring)."""
    vocab = weight.shape[0]
    if labels.device.type == "cpu":  # the slices clamp a label into range: one outside would read a wrong column
        if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < vocab:
            raise ValueError(f"labels must lie in [0, {vocab}); got {int(labels.min())}..{int(labels.max())}")
    else:  # checked on the device, without making the host wait
        torch._assert_async(((labels >= 0) & (labels < vocab)).all(), f"labels must lie in [0, {vocab})")
    labels = labels.to(hidden.device)
    return _HeadLogprobs.apply(hidden, weight, labels, _compute_dtype(hidden, weight), chunk_size)


def token_logprobs(logits_fn: LogitsFn, hidden: Tensor, labels: Tensor, chunk_size: int = 128,
                   head_weight: Tensor | None = None) -> Tensor:
    """fp32 log p(label | hidden) for [T, H] hidden states: with ``head_weight`` (the plain head's weight,
    ``logits_fn(h) == h @ head_weight.T``) by ``head_logprobs``, else the LM head applied ``chunk_size`` rows at a
    time."""
    labels = labels.to(hidden.device)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    if head_weight is not None:
        return head_logprobs(hidden, head_weight, labels, chunk_size)
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
                      chunk_size: int = 128, head_weight: Tensor | None = None) -> Tensor:
    """Our way: gather the trained positions' hidden states, then chunked LM head + fp32 log-softmax."""
    return token_logprobs(logits_fn, gather_hidden(hidden, rows, cols), labels, chunk_size, head_weight)


def full_logits_logprobs(logits_fn: LogitsFn, hidden: Tensor, rows: Tensor, cols: Tensor,
                         labels: Tensor) -> Tensor:
    """The reference's way (Gen-Verse/dLLM-RL train/rl_trado.py forward_process): [R, N, V] logits, log-softmax over
    everything, then gather.

    Kept only as the baseline of ``bench/train.py`` and as a cross-check in tests.
    """
    logp = F.log_softmax(logits_fn(hidden).float(), dim=-1)
    return logp[rows.to(hidden.device), cols.to(hidden.device), labels.to(hidden.device)]
