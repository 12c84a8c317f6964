"""Fused add + RMSNorm and SiLU-and-mul as small Triton kernels (one launch each).

Why: under 48 chat streams on the H200 (Llama-3.1-8B shape, 2026-12-02, the torch profiler over
200 steps of each server), FlashInfer's `FusedAddRMSNormKernel` took 4.3 µs a launch and its
`act_and_mul_kernel` 5.4 µs, where vLLM's torch.compile-generated Triton kernels for the same
work took 2.4-2.6 µs and 3.0 µs: 0.45 ms of a 5.7 ms decode step against 0.26 ms, and more on
the 3B shape's 36 layers. These kernels do the same arithmetic as `runtime.model.ops`' torch
path (float32 inside, the same roundings to the model dtype: HF's order for RMSNorm), one
program per row; `use_triton_norm_act(True)` routes the ops here. Off by default until an A/B
on the GPU says they are faster (`--norm-act-kernels triton`).

Shapes: x, residual [M, D] (D = hidden size; rows contiguous); gate|up [M, 2 I]. On a machine
without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, the tests' conftest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [M, D] input (the layer's output)
    r_ptr,  # [M, D] residual (HAS_RESIDUAL only)
    w_ptr,  # [D] weight
    out_ptr,  # [M, D] rmsnorm(x [+ r]) * w
    r_out_ptr,  # [M, D] x + r (HAS_RESIDUAL only)
    x_st,
    r_st,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= D
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_st + cols, mask=mask, other=0.0)
        # The sum rounds to the model dtype first, as `x + residual` does in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype, fp_downcast_rounding="rtne")
        tl.store(r_out_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    # HF order: normalise in float32, round to the dtype, then scale by the weight.
    normed = (xf * rstd).to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(x.dtype, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * D + cols, y, mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [M, 2 I]: gate | up
    out_ptr,  # [M, I]
    x_st,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * x_st + INTER + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # silu rounds to the dtype before the product, as F.silu(gate) * up does in torch.
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(
        out_ptr + row * INTER + cols,
        (act * u.to(tl.float32)).to(g.dtype, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) as new tensors; inputs untouched."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    r2 = residual.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M:
        block = triton.next_power_of_2(D)
        _rmsnorm_kernel[(M,)](
            x2, r2, weight, out, r_out, x2.stride(0), r2.stride(0), eps, D=D, BLOCK=block,
            HAS_RESIDUAL=True, num_warps=_warps(block),
        )  # fmt: skip
    return out.view(x.shape), r_out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dim, as a new tensor ([..., D], e.g. q/k norms)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M:
        block = triton.next_power_of_2(D)
        _rmsnorm_kernel[(M,)](
            x2, x2, weight, out, out, x2.stride(0), 0, eps, D=D, BLOCK=block,
            HAS_RESIDUAL=False, num_warps=_warps(block),
        )  # fmt: skip
    return out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 I] as [gate | up] -> silu(gate) * up, [..., I]."""
    two_i = x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, inter), dtype=x.dtype, device=x.device)
    if M:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(M, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), INTER=inter, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
