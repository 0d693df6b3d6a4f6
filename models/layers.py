"""Layers shared by every architecture: RoPE, RMSNorm, the gated MLP product, head split / merge, grouped linear
projections (packed for CPU inference), the init of fresh models."""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import UserError


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight (as the checkpoints'
    reference code does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension; ``weight`` is [D], or [..., D] matching x's trailing dimensions (one
    weight per head). Under autograd only the input is kept for backward (``_RMSNormFn``)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x32 / sqrt(mean(x32^2) + eps)).to(x.dtype). ``F.rms_norm`` runs exactly these ATen ops in one
    call (by hand they are six calls, whose dispatch dominates at decode shapes on CPU); given the weight it
    multiplies before the cast back, so the weight goes inside only where that cast is a no-op (fp32)."""
    shape = (x.shape[-1],)
    if weight.dim() == 1 and x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x, shape, None, eps) * weight


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm that keeps only its input for the backward pass (1/rms is recomputed there).

    Autograd through the plain ops would also keep the fp32 normalised copy (and, in bf16, an fp32 copy of the
    input): one hidden-sized tensor or more per norm, four norms per layer, for every token of a training row.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)  # as inside F.rms_norm
        normed = x32 * inv_rms
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_out * normed.to(x.dtype)).reshape(-1, *weight.shape).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad_out * weight).float()
            grad_x = (inv_rms * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin [B, N, 1, D] for rotate-half RoPE over heads laid out as [B, N, heads, D], computed in
    fp32 from explicit positions.

    The sin's first half is negated once here, so ``apply_rope`` rotates with one ``roll`` instead of slicing,
    negating and concatenating in every layer (bit for bit the same products). Frequencies are computed on the
    fly (no buffer), so nothing can be left uninitialised by ``from_pretrained``.
    """
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype)[:, :, None], sin.to(dtype)[:, :, None]


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1]: the negation lives in ``signed_sin``.

    Partial rotary (LLaDA2: 64 of 128 dimensions): when cos / sin are narrower than the heads, only the leading
    dimensions are rotated (rotate_half within them) and the rest pass unchanged."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotated], cos, signed_sin), x[..., rotated:]], dim=-1)
    return x * cos + x.roll(rotated // 2, -1) * signed_sin


def attention_heads(qkv: Tensor, n_heads: int, n_kv: int, head_dim: int, cos: Tensor, sin: Tensor,
                    qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, H, N, D] and k, v [B, Hkv, N, D] from a q/k/v projection output [B, N, (H + 2 Hkv) D], with q and
    k normalised per head (``qk_norm``: Qwen3's q_norm, k_norm) and rotated.

    q and k sit side by side in the projection output, so without autograd the norm and RoPE run once over both
    ([B, N, H + Hkv, D]) instead of once each: the same values, half the kernel launches (a decode step is
    launch-bound on CPU).
    """
    b, n, _ = qkv.shape
    heads = qkv.view(b, n, n_heads + 2 * n_kv, head_dim)
    qk, v = heads[:, :, : n_heads + n_kv], heads[:, :, n_heads + n_kv:]
    if qk_norm is not None:
        q_norm, k_norm = qk_norm
        if torch.is_grad_enabled() or hasattr(q_norm.weight, "ds_id"):
            q, k = _norm_and_rotate_apart(qk, n_heads, q_norm, k_norm, cos, sin)
            return q, k, v.transpose(1, 2)
        weight = torch.cat([q_norm.weight.expand(n_heads, -1), k_norm.weight.expand(n_kv, -1)])
        qk = rms_norm(qk, weight, q_norm.eps)
    qk = apply_rope(qk, cos, sin)
    return qk[:, :, :n_heads].transpose(1, 2), qk[:, :, n_heads:].transpose(1, 2), v.transpose(1, 2)


def _norm_and_rotate_apart(qk: Tensor, n_heads: int, q_norm: RMSNorm, k_norm: RMSNorm, cos: Tensor,
                           sin: Tensor) -> tuple[Tensor, Tensor]:
    """q and k normalised by their own modules and rotated one by one, as [B, heads, N, D]: under autograd the
    norm weights' gradients then sum in the order they always did (training numerics unchanged, bit for bit),
    and under ZeRO-3 a parameter is whole only inside its own module's call."""
    q, k = qk[:, :, :n_heads].transpose(1, 2), qk[:, :, n_heads:].transpose(1, 2)
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
    return apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, the gated MLP's product; under autograd it keeps only gate and up for the backward pass."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMulFn.apply(gate, up)
    return F.silu(gate) * up


class _SiluMulFn(torch.autograd.Function):
    """Autograd through F.silu(gate) * up would also keep silu(gate): an intermediate-sized tensor per layer."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        g, u, grad = gate.float(), up.float(), grad_out.float()  # in fp32, as torch's own silu backward
        sig = torch.sigmoid(g)
        grad_gate = (grad * u * sig * (1 + g * (1 - sig))).to(gate.dtype) if ctx.needs_input_grad[0] else None
        grad_up = (grad * g * sig).to(up.dtype) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def merge_heads(x: Tensor) -> Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class Projections:
    """Mixin for modules whose forward applies groups of ``nn.Linear`` children to one input (q/k/v, gate/up).

    ``projection_groups`` maps a group name to its children's names, in output order. ``project`` runs a group
    as those modules (their parameters and hooks as loaded: training, GPU, ZeRO-3) or, inside
    ``packed_projections`` and without autograd, as one pre-packed product over the concatenated weights.
    Parameter names, and so checkpoints, are the same either way.
    """

    projection_groups: dict[str, tuple[str, ...]] = {}

    def project(self, group: str, x: Tensor, split: bool = True) -> Tensor | tuple[Tensor, ...]:
        """The group's outputs, one per layer, or (``split=False``) side by side in one tensor."""
        packed = self.__dict__.get("_packed", {}).get(group)
        if packed is not None and not torch.is_grad_enabled():
            return packed(x, split)
        out = tuple(getattr(self, name)(x) for name in self.projection_groups[group])
        if len(out) == 1:
            return out[0]
        return out if split else torch.cat(out, -1)


class PackedLinear:
    """One product ``x @ cat(weights).T + cat(biases)`` over several ``nn.Linear``, split back per layer.

    The concatenated weight is reordered once into oneDNN's blocked layout. MKL's sgemm packs the weight again on
    every call, which dominates at decode shapes (a few tokens per row, weights streamed from L3): on a 2-core
    AMD EPYC (``bench.cpu_kernels``) a layer's products at 4 tokens cost 2.7-2.9x less pre-packed, at 128 tokens
    1.35x less. Results agree with MKL's to float32 rounding (a different summation order), not bit for bit.

    peft LoRA layers: while a low-rank side product (all active adapters' A stacked, their scaled B block-diagonal)
    costs at most ``SIDE_PRODUCT_MAX_COST`` of the main product's multiply-adds, the packed weight is the base
    weight exactly (``exact``: ``dense_weights`` gives it back bit for bit) and the adapters run beside it; past
    that (high ranks on small layers) the packed weight is base + the adapters' delta, merged.

    ``dtype``: the packed weight's dtype (default: the layers'). bf16 copies of fp32 weights serve sampling under
    CPU bf16 autocast: the input is cast as ``F.linear`` under autocast casts it, the output is bf16, and on a CPU
    with native bf16 products (AVX512-BF16 / AMX) they take 1.7-1.9x less time than fp32 packed ones (a layer's
    groups at hidden 576, 4-256 tokens, on a 2-core AMD EPYC: ``bench.cpu_kernels --hidden 576``). Such a copy is
    never ``exact``.
    """

    BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; any row count works
    # r=16 on a 768-wide model's groups: 0.05-0.13 (bench.memory: sampling 1.2x slower than merged, one copy of the
    # weights instead of two); r=128: 0.2-0.8, where merging is the faster choice
    SIDE_PRODUCT_MAX_COST = 0.25

    def __init__(self, layers: Sequence[nn.Module], dtype: torch.dtype | None = None):
        linears = [_base_linear(m) for m in layers]
        self.sizes = [m.out_features for m in linears]
        self.dtype = dtype or linears[0].weight.dtype  # a bf16 copy of fp32 weights under bf16 autocast
        low_rank = _stacked_low_rank(layers)
        cost = 0.0 if low_rank is None else (
            low_rank[0].shape[0] * (linears[0].in_features + sum(self.sizes))
            / (linears[0].in_features * sum(self.sizes)))
        side = low_rank is not None and cost <= self.SIDE_PRODUCT_MAX_COST  # the adapters beside the base product
        merged = low_rank is not None and not side
        self.low_rank = tuple(t.to(self.dtype) for t in low_rank) if side else None
        self.exact = not merged and self.dtype == linears[0].weight.dtype
        weight = torch.cat([_effective_weight(m) if merged else _base_linear(m).weight.detach()
                            for m in layers]).to(self.dtype)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        biases = [m.bias for m in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat([
            b.detach().to(self.dtype) if b is not None else weight.new_zeros(m.out_features)
            for b, m in zip(biases, linears)])

    def __call__(self, x: Tensor, split: bool = True) -> Tensor | tuple[Tensor, ...]:
        x = x.to(self.dtype)  # what F.linear does under autocast: the product and its output in the packed dtype
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.low_rank is not None:
            down, up = self.low_rank
            y = y + (x @ down.T) @ up.T
        return y.split(self.sizes, -1) if split and len(self.sizes) > 1 else y

    def dense_weights(self) -> list[Tensor]:
        """The layers' weights in their own layout, equal bit for bit to those packed (a reorder loses nothing);
        for an ``exact`` product only."""
        return [w.clone() for w in self.weight.to_dense().split(self.sizes)]


def _active_lora(module: nn.Module) -> list[str]:
    """The names of a peft LoRA layer's adapters that its forward applies (none for a plain or merged layer)."""
    if module is _base_linear(module) or module.merged or getattr(module, "disable_adapters", False):
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def _effective_weight(module: nn.Module) -> Tensor:
    """The weight of the product a layer computes: its own, or a LoRA layer's base weight plus the delta of its
    active adapters."""
    weight = _base_linear(module).weight.detach()
    names = _active_lora(module)
    if not names:
        return weight
    with torch.no_grad():
        return weight + sum(module.get_delta_weight(name) for name in names).to(weight.dtype)


def _stacked_low_rank(layers: Sequence[nn.Module]) -> tuple[Tensor, Tensor] | None:
    """(A, B) with ``x @ A.T @ B.T`` = the active LoRA adapters' outputs of ``layers``, side by side; None if none.

    A stacks every active adapter's ``lora_A`` rows; B is block-diagonal: each adapter's ``scaling * lora_B`` in
    its layer's output rows and its own rank columns."""
    pieces = [(i, m.lora_A[name].weight.detach(), m.lora_B[name].weight.detach() * m.scaling[name])
              for i, m in enumerate(layers) for name in _active_lora(m)]  # (layer index, A, scaled B)
    if not pieces:
        return None
    sizes = [_base_linear(m).out_features for m in layers]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    down = torch.cat([a for _, a, _ in pieces])
    up = down.new_zeros(sum(sizes), down.shape[0])
    col = 0
    for i, a, b in pieces:
        up[starts[i]:starts[i] + sizes[i], col:col + a.shape[0]] = b
        col += a.shape[0]
    return down, up


def packing_applies(model: nn.Module, dtype: torch.dtype | None = None) -> bool:
    """Pre-packed products pay (and are available) for whole fp32 weights on CPU with oneDNN, packed as they are or
    (``dtype`` bf16) as bf16 copies where the CPU multiplies bf16 natively; they are taken only while a copy of the
    model's weights fits in a quarter of the memory the system has available (a real-size model sampled on a small
    machine must not run out of memory for a speed-up)."""
    params = list(model.parameters())
    if not (params and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and all(p.device.type == "cpu" and p.dtype == torch.float32 and not hasattr(p, "ds_id")
                    for p in params)):
        return False
    if dtype not in (None, torch.float32) and not (dtype == torch.bfloat16 and native_cpu_bf16()):
        return False
    available = _available_memory_bytes()
    return available is None or 4 * sum(p.numel() * p.element_size() for p in params) <= available


@functools.cache
def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware. On x86 that takes AVX512-BF16 or AMX-BF16: elsewhere oneDNN
    converts bf16 to fp32 around its products, slower than fp32 itself (AVX-512 without BF16, a 2-core Intel Xeon
    Ice Lake: a 512 x 576 by 576 x 1536 product 37 ms in bf16 against 8.5 ms in fp32, 4.4x; AVX2 only, an AMD EPYC:
    torch's reference kernels, a 512 x 2048 by 2048 x 2048 product 15.8 s against 0.044 s, 360x; torch 2.13). Other
    architectures: oneDNN's own answer. ``DLLM_CPU_BF16=1`` (or ``0``) in the environment decides instead: bf16
    products whatever their speed, to reproduce a bf16 run's rounding or to exercise the bf16 paths anywhere."""
    forced = os.environ.get("DLLM_CPU_BF16", "")
    if forced:
        if forced not in ("0", "1"):
            raise UserError(f"DLLM_CPU_BF16={forced!r}: expected 1 (bf16 CPU products whatever their speed) or 0 "
                            "(float32), or leave it unset (bf16 where the CPU multiplies it natively)")
        return forced == "1"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("architecture") in ("x86_64", "x86", "AMD64"):
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(is_supported is not None and is_supported())


def cpu_bf16_emulated(setting: str) -> bool:
    """True, after a one-line warning naming ``setting``, where bf16 autocast on the CPU would run on emulated or
    reference kernels (``native_cpu_bf16``): the caller computes in float32 instead. The CPU recipes ask for bf16 for
    speed only (about 1.5x where the CPU multiplies bf16), so a run on such a CPU keeps its pace, not its rounding."""
    if native_cpu_bf16():
        return False
    warnings.warn(f"{setting}: this CPU has no native bf16 products (no AVX512-BF16 or AMX), where bf16 runs several "
                  "to hundreds of times slower than float32; computing in float32 instead (DLLM_CPU_BF16=1 forces "
                  "bf16)", stacklevel=3)
    return True


def cpu_autocast_dtype() -> torch.dtype | None:
    """The dtype of CPU autocast where it is on, else None."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None  # not Linux: no way to judge, pack


@contextlib.contextmanager
def packed_projections(model: nn.Module, park: bool = False) -> Iterator[None]:
    """Within: every ``Projections`` module of ``model`` runs its groups pre-packed where ``packing_applies``; under
    CPU bf16 autocast at entry, as bf16 copies of the weights (``PackedLinear``'s ``dtype``; never parked).

    For sampling only: the packed copies are taken on entry (later weight updates are not seen) and carry no
    gradient, so ``project`` ignores them whenever autograd is on. With ``park`` the packed weights of an ``exact``
    product stand in for the layers' own: those are parked (an empty tensor) until exit, then given back bit for
    bit from the packed copy, so sampling holds one copy of the weights, not two; nothing may read them inside (a
    scoped ``sample.generate`` parks; a server holding the packing for its lifetime does not). Never parked: a
    weight shared with another module (a tied LM head), and one that is a map of its checkpoint file (a model
    loaded memory-mapped and never written: its pages stay while any tensor of the file lives, so parking would add
    a copy, not free one).
    """
    # Nested use (a server's driver thread holds the packing while an offline ``generate`` runs) packs only what
    # is not packed yet and unpacks only that: the outer holder keeps its packed weights.
    dtype = cpu_autocast_dtype()  # under bf16 autocast: bf16 copies, as F.linear would cast to
    modules = [m for m in model.modules() if isinstance(m, Projections) and "_packed" not in m.__dict__] \
        if packing_applies(model, dtype) else []
    parkable = _parkable(model) if park and modules else (lambda weight: False)
    parked: dict[tuple[int, str], list[nn.Linear]] = {}  # (module, group) -> the layers whose weights it holds
    try:
        for module in modules:
            module._packed = {}
            for group, names in module.projection_groups.items():
                layers = [_packable(getattr(module, name)) for name in names]
                if any(m is None for m in layers):
                    continue  # another wrapped layer runs as is
                packed = module._packed[group] = PackedLinear(layers, dtype)
                linears = [_base_linear(m) for m in layers]
                if packed.exact and all(parkable(m.weight) for m in linears):
                    for m in linears:
                        m.weight.data = m.weight.data.new_empty(0)
                    parked[id(module), group] = linears
                for m in layers:  # their adapters are in the packed product: merged_for_sampling leaves them be
                    if type(m) is not nn.Linear:
                        m._served_packed = True
        yield
    finally:
        for module in modules:
            _unpack(module, parked)


def _parkable(model: nn.Module) -> Callable[[Tensor], bool]:
    """Whether a weight of ``model`` may be parked: used by one module only, and not a map of its checkpoint file."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    in_file = _file_mapped()
    return lambda weight: uses.get(id(weight)) == 1 and not in_file(weight.data_ptr())


def _unpack(module: nn.Module, parked: dict[tuple[int, str], list[nn.Linear]]) -> None:
    """Drop a module's packed products, each right after its parked layers have their weights back (so the last
    restore never holds both copies of the model)."""
    products = module.__dict__.pop("_packed", {})
    for group in list(products):
        packed = products.pop(group)
        layers = parked.get((id(module), group))
        if layers:
            for m, weight in zip(layers, packed.dense_weights(), strict=True):
                m.weight.data = weight
        del packed
    for names in module.projection_groups.values():
        for name in names:
            getattr(module, name).__dict__.pop("_served_packed", None)


def _file_mapped() -> Callable[[int], bool]:
    """Whether an address lies in a file-backed mapping of this process (Linux ``/proc/self/maps``; elsewhere every
    address counts as mapped, so nothing is parked)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return lambda ptr: True
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):  # an inode and a path: a file
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    ranges.sort()
    starts = [start for start, _ in ranges]

    def mapped(ptr: int) -> bool:
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr < ranges[i][1]

    return mapped


def _packable(module: nn.Module) -> nn.Module | None:
    """The layer a packed product may stand for: a plain ``nn.Linear``, or a peft LoRA layer over one (plain
    LoRA: no DoRA, no bias on B; the packed product adds its adapters as a low-rank side product)."""
    if type(module) is nn.Linear:
        return module
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(module, "lora_A"):
        return None
    variants = [*getattr(module, "use_dora", {}).values(), *getattr(module, "lora_bias", {}).values()]
    return None if any(variants) else module


def plain_head_weight(head: nn.Module | Tensor) -> Tensor | None:
    """The weight of an output head whose logits are exactly ``hidden @ weight.T``, for a trainer to use directly
    (train/logprobs.py ``head_logprobs``): ``head`` a plain bias-free ``nn.Linear`` without hooks, or the weight
    itself (a tied embedding the model applies with ``F.linear``), not partitioned by ZeRO-3. Else None."""
    if isinstance(head, nn.Module):
        hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks,
                 _global_module_hooks())
        if type(head) is not nn.Linear or head.bias is not None or any(hooks) or hasattr(head, "_hf_hook"):
            return None
        head = head.weight
    return None if hasattr(head, "ds_id") else head


def _global_module_hooks() -> bool:
    """Whether hooks registered for every module (``torch.nn.modules.module.register_module_forward_hook`` and
    kin) would watch the head's call."""
    from torch.nn.modules import module

    return any(getattr(module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def head_weight(model: nn.Module) -> Tensor | None:
    """``model.lm_head_weight()`` where the family defines it (a peft wrapper passes the call on), else None."""
    method = getattr(model, "lm_head_weight", None)
    return method() if callable(method) else None


def _base_linear(module: nn.Module) -> nn.Linear:
    return module if type(module) is nn.Linear else module.base_layer


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
    for name in getattr(module, "normal_init", ()):  # parameters of modules that are not nn.Linear (fused experts)
        nn.init.normal_(getattr(module, name), mean=0.0, std=std)
