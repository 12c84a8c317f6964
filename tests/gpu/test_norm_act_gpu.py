"""GPU: the Triton norm and activation kernels (runtime/model/norm_act_kernels.py) against
FlashInfer's and the torch path at the 8B and 3B shapes' sizes, and an engine running them
(`norm_act_kernels="triton"`) against one on FlashInfer's: the same scores, and greedy tokens
that agree up to bf16 near ties."""

from __future__ import annotations

import pytest
from gpu_engines import assert_engines_alike

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 48, 300])
@pytest.mark.parametrize("hidden,inter", [(4096, 14336), (2048, 11008)])
def test_kernels_match_flashinfer_and_torch(rows: int, hidden: int, inter: int) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from runtime.model import norm_act_kernels as k
    from runtime.model import ops

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    r = (3 * torch.randn(rows, hidden, device="cuda", generator=g)).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    gu = (4 * torch.randn(rows, 2 * inter, device="cuda", generator=g)).bfloat16()
    before = ops.flashinfer_enabled()
    try:
        ops.use_triton_norm_act(False)
        results = {}
        for path in ("torch", "flashinfer"):
            ops.use_flashinfer(path == "flashinfer")
            out, res = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
            results[path] = (out, res, ops.silu_and_mul(gu), ops.rms_norm(x, w, 1e-5))
        out, res = k.add_rmsnorm(x, r, w, 1e-5)
        mine = (out, res, k.silu_and_mul(gu), k.rmsnorm(x, w, 1e-5))
    finally:
        ops.use_flashinfer(before)
    for path, theirs in results.items():
        for name, a, b in zip(
            ("norm", "residual", "silu_mul", "rmsnorm"), mine, theirs, strict=True
        ):
            diff = (a.float() - b.float()).abs()
            assert torch.allclose(a.float(), b.float(), rtol=1.6e-2, atol=1.6e-2), (path, name)
            assert (diff == 0).float().mean() > 0.97, (path, name, diff.max())


def test_engine_with_triton_norm_act_scores_alike() -> None:
    assert_engines_alike([{"norm_act_kernels": "flashinfer"}, {"norm_act_kernels": "triton"}])
