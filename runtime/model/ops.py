"""Token-wise model ops: RMSNorm, fused add + RMSNorm, SiLU-and-mul, rotary embedding.

Each op is one function with a torch implementation (the reference, used on CPU and whenever
FlashInfer is off). `use_flashinfer(True)` flips a module-level switch; a FlashInfer path can be
added inside each function behind `_FLASHINFER` without touching the model code.
Norms and RoPE compute in float32 internally and cast back to the input dtype, matching the
`transformers` reference numerics in fp32 and being at least as accurate in bf16.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from runtime.model.config import RopeScaling

_FLASHINFER = False


def use_flashinfer(enabled: bool) -> None:
    """Route ops through FlashInfer kernels (CUDA only) when True; torch otherwise."""
    global _FLASHINFER
    _FLASHINFER = bool(enabled)


def flashinfer_enabled() -> bool:
    return _FLASHINFER


# The array.array type code of each dtype host lists become. Why: `torch.tensor(list)`
# converts element by element through Python's number protocol; `array.array` converts in one
# C loop and the tensor then views its buffer. This 2-core VM: 2,400 ints 36 against 132 us,
# 14,400 (the page indices of 16 queries after 14k-token cached profiles) 206 against 758.
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A flat sequence of numbers as a CPU tensor of `dtype` (through `array.array` for the
    dtypes above; a nested list, an empty one or another dtype through `torch.tensor`)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values or isinstance(values[0], (list, tuple)):
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array(code, values), dtype=dtype)  # the tensor keeps the array


def h2d(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device: from pinned memory
    with a non-blocking copy on CUDA. (A plain `torch.tensor(values, device=cuda)` or a
    list index on a CUDA tensor copies from pageable memory and synchronises the stream,
    which would serialise the host with the step in flight.)"""
    t = host_tensor(values, dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# --- FlashInfer paths (GPU engineer). Used only when the switch is on, the tensor is on CUDA
# and in a half dtype the kernels support; anything else takes the torch path below. The
# kernels compute in float32 internally like the torch path; rounding differs slightly.
_HALF = (torch.float16, torch.bfloat16)


def _fi_ok(x: torch.Tensor) -> bool:
    return _FLASHINFER and x.is_cuda and x.dtype in _HALF


def _fi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import flashinfer

    # The kernel takes [rows, D]; q/k norms pass [T, heads, D].
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = flashinfer.norm.rmsnorm(x2, weight.to(x.dtype), eps)
    return out.view(x.shape)


def _fi_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    import flashinfer

    # In place: residual <- x + residual; x <- rmsnorm(residual) * weight. Work on private
    # contiguous copies when the inputs are views so the caller's buffers stay untouched.
    xs = x if x.is_contiguous() else x.contiguous()
    rs = residual if residual.is_contiguous() else residual.contiguous()
    flashinfer.norm.fused_add_rmsnorm(
        xs.view(-1, xs.shape[-1]), rs.view(-1, rs.shape[-1]), weight.to(x.dtype), eps
    )
    return xs, rs


def _fi_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    import flashinfer

    return flashinfer.activation.silu_and_mul(x.contiguous())


# FlashInfer's RoPE kernel is compiled for these head sizes only and raises for others (32, as
# the tiny test presets have, seen on the H200); other sizes take the torch path below.
_FI_ROPE_HEAD_DIMS = (64, 128, 256, 512)


def _fi_apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import flashinfer

    T, Hq, D = q.shape
    Hkv = k.shape[1]
    # q/k usually arrive as column views of the fused qkv output ([T, H, D], row stride = the
    # qkv width). The out-of-place kernel reads them through their strides and writes fresh
    # contiguous outputs: one launch, where copying them first took three (this matters at
    # decode batch 1, where every layer is a chain of tiny kernels). reshape() here is a view
    # whenever the head dims are packed, which they are for qkv columns and for q/k norms.
    q_out, k_out = flashinfer.rope.apply_rope_with_cos_sin_cache(
        positions, q.reshape(T, Hq * D), k.reshape(T, Hkv * D), D, cos_sin_cache, is_neox=True
    )
    return q_out.view(T, Hq, D), k_out.view(T, Hkv, D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D]. Normalise in fp32, cast back, then scale (HF order)."""
    if _fi_ok(x):
        return _fi_rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). Pure: inputs are
    not modified (a FlashInfer version may work in place; callers must not rely on either)."""
    if _fi_ok(x):
        return _fi_fused_add_rms_norm(x, residual, weight, eps)
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] laid out as [gate | up]; returns silu(gate) * up, [..., I]."""
    if _fi_ok(x):
        return _fi_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")
    # Llama 3: long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    max_positions: int,
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second (the layout
    FlashInfer's `apply_rope_with_cos_sin_cache` takes)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (rotate halves), as Llama and Qwen use.
    q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64, cache: [P, D] float32.
    Returns new (q, k) in the input dtype; the rotation itself is computed in float32."""
    if _fi_ok(q) and cos_sin_cache.dtype == torch.float32 and q.shape[-1] in _FI_ROPE_HEAD_DIMS:
        return _fi_apply_rope(q, k, positions, cos_sin_cache)
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T,1,D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope_one(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """`apply_rope` for one tensor (q or k alone), x: [T, H, D]. The kernels rotate a pair:
    the second is a one-head view of x, rotated and dropped (1/H of the work extra)."""
    return apply_rope(x, x[:, :1], positions, cos_sin_cache)[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
