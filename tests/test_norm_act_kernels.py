"""The Triton norm and activation kernels (runtime/model/norm_act_kernels.py) against the torch
reference path of runtime/model/ops.py. Without CUDA they run under Triton's interpreter
(conftest); the GPU engine A/B is tests/gpu/test_norm_act_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runtime.model import norm_act_kernels as k  # noqa: E402 - after the skip
from runtime.model import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# Triton's interpreter rounds float32 -> bfloat16 toward zero whatever the rounding mode asked
# (seen with triton 3.x on this CPU); CUDA rounds to nearest even, as torch does. So on CPU a
# bf16 result may be one unit in the last place off everywhere; on CUDA nearly all are equal.
INTERPRETED = DEVICE == "cpu"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one unit in the last place of the dtype, and on CUDA equal but for a few elements
    (the kernels sum the squares in another order than torch's mean: a rounding can move)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    tol = 1e-5 if got.dtype == torch.float32 else 1.6e-2  # bf16: 8 bits of mantissa
    assert torch.allclose(g, w, rtol=tol, atol=tol), (g - w).abs().max()
    if got.dtype != torch.float32 and not INTERPRETED:
        assert (g == w).float().mean() > 0.98


@pytest.fixture(autouse=True)
def _torch_path():
    """The ops under test take their torch path (the switches are process-wide)."""
    before = ops.flashinfer_enabled()
    ops.use_flashinfer(False)
    ops.use_triton_norm_act(False)
    yield
    ops.use_flashinfer(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 96), (48, 576)])
def test_add_rmsnorm_matches_torch(dtype: torch.dtype, rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=g).to(DEVICE, dtype)
    r = (3 * torch.randn(rows, dim, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    x0, r0 = x.clone(), r.clone()
    out, r_out = k.add_rmsnorm(x, r, w, 1e-6)
    want_out, want_r = ops.fused_add_rms_norm(x, r, w, 1e-6)
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(r_out, want_r)  # one rounding of the same sum
    _close(r_out, want_r)
    _close(out, want_out)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


def test_add_rmsnorm_reads_strided_rows() -> None:
    """A row-strided view (e.g. a column slice of a wider buffer) is read through its stride."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 200, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[:, :128]
    r = torch.randn(6, 128, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16, device=DEVICE)
    out, r_out = k.add_rmsnorm(x, r, w, 1e-5)
    want_out, want_r = ops.fused_add_rms_norm(x.contiguous(), r, w, 1e-5)
    _close(r_out, want_r)
    _close(out, want_out)


@pytest.mark.parametrize("shape", [(7, 64), (3, 4, 32)])
def test_rmsnorm_matches_torch(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, torch.bfloat16)
    _close(k.rmsnorm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 64), (9, 1500)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    """1,500 columns: two column blocks of 1,024, the second partly masked."""
    g = torch.Generator().manual_seed(inter)
    x = (4 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE, dtype)
    _close(k.silu_and_mul(x), ops.silu_and_mul(x))


def test_empty_batch() -> None:
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    out, r_out = k.add_rmsnorm(x, x, w, 1e-6)
    assert out.shape == r_out.shape == (0, 64)
    assert k.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def test_config_refuses_an_unknown_kernel_choice() -> None:
    from runtime.config import EngineConfig

    with pytest.raises(ValueError, match="norm_act_kernels"):
        EngineConfig(norm_act_kernels="cudnn")
    with pytest.raises(ValueError, match="merged_step_attention"):
        EngineConfig(merged_step_attention="fa4")
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="cudnn")
