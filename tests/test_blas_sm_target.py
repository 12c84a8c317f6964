"""runtime/partition/blas_sm_target.py off CUDA: unavailable with the reason, and a no-op (the GPU
side is measured and checked by bench/gpu_suite.py's gemm_sm_target section)."""

from __future__ import annotations

import pytest
import torch

from runtime.partition.blas_sm_target import BlasSmTarget, shared_blas_sm_target


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_without_cuda_it_says_why_and_does_nothing() -> None:
    t = BlasSmTarget()
    assert not t.available and t.reason == "no CUDA device"
    t.set(64)
    assert t.current == 0  # nothing was set
    assert t.num_sets == 0


def test_disabled_by_config_means_no_instance() -> None:
    assert shared_blas_sm_target(enabled=False) is None
    assert shared_blas_sm_target(enabled=True) is shared_blas_sm_target(enabled=True)
