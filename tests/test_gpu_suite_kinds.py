"""bench.gpu_suite's grouping of profiled kernels by what they do (the decode breakdown)."""

from __future__ import annotations

import pytest

from bench.gpu_suite import _kernel_kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
        ("void flashinfer::PersistentVariableLengthMergeStatesKernel<...>", "attention"),
        ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "norm"),
        ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<...>", "rope"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
        # cuBLAS on the H200 (plan w, 2026-12-02): nvjet kernels without "splitK" were "other".
        ("nvjet_sm90_tst_128x16_64x11_2x1_v_bz_TNT", "gemm"),
        ("nvjet_sm90_tst_64x48_64x15_2x1_v_bz_splitK_TNT", "gemm"),
        ("nvjet_sm90_tst_64x24_64x16_4x2_h_bz_bias_TNT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "gemm"),
        ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
        ("void at::native::index_copy_kernel_impl<...>", "kv write"),
        ("void flashinfer::activation::act_and_mul_kernel<silu>", "activation"),
        ("void at::native::reduce_kernel<argmax>", "sampling/logits"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert _kernel_kind(name) == kind
