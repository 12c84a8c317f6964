"""GPU: FlashInfer backend and ops against float32 / torch references (bench/gpu_suite.py
holds the checks so the device run and pytest share them)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.gpu
def test_flashinfer_backend_all_modes_match_reference() -> None:
    from bench import gpu_suite

    gpu_suite.RESULTS["checks"].clear()
    gpu_suite.section_backend()
    failed = [c for c in gpu_suite.RESULTS["checks"] if not c["ok"]]
    assert gpu_suite.RESULTS["checks"] and not failed, failed


@pytest.mark.gpu
def test_flashinfer_ops_match_torch() -> None:
    from bench import gpu_suite

    gpu_suite.RESULTS["checks"].clear()
    gpu_suite.section_ops()
    failed = [c for c in gpu_suite.RESULTS["checks"] if not c["ok"]]
    assert gpu_suite.RESULTS["checks"] and not failed, failed


@pytest.mark.gpu
def test_merged_step_that_splits_the_kv_fits_the_workspace() -> None:
    """A merged step of the Qwen2.5-3B shape (16 query heads over 2 KV heads) that FlashInfer's
    FA2 scheduler splits into 132 work tiles of 128 rows: its partial outputs need 133 MiB of
    float workspace, more than FlashInfer's default 128 MiB (the overflow failed 77 merged
    steps of a 48-stream chat run on the H200). Positive control: the default-sized buffer
    raises on this very batch; the backend's own size plans it and matches the reference."""
    import torch

    from bench.gpu_suite import _make_seqs, _ref_attention, rel_err
    from runtime.attention.base import ForwardBatch
    from runtime.attention.flashinfer_backend import DEFAULT_WORKSPACE_BYTES, FlashInferBackend

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the batch below is chosen for 132 SMs (H100/H200)")
    hq, hkv, d, bs, nblocks = 16, 2, 128, 16, 1400
    # 20 decodes over 1,000 cached tokens + 2 prompt parts of 200 tokens after 64 cached.
    specs = [(1000, 1, 1001)] * 20 + [(64, 200, 264)] * 2
    gen = torch.Generator().manual_seed(0)
    kc = [torch.randn(nblocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)]
    vc = [torch.randn_like(kc[0])]
    seqs = _make_seqs(specs, bs, nblocks, gen)
    t = sum(s.num_query_tokens for s in seqs)
    zeros = torch.zeros(t, dtype=torch.int64, device="cuda")
    batch = ForwardBatch(zeros, zeros, seqs, zeros[:1], is_decode=False)

    small = FlashInferBackend(kc, vc, hq, hkv, d, workspace_bytes=DEFAULT_WORKSPACE_BYTES)
    with pytest.raises(RuntimeError, match="batch_prefill_tmp_v"):
        small.plan(batch)

    be = FlashInferBackend(kc, vc, hq, hkv, d)
    assert be.workspace.numel() > DEFAULT_WORKSPACE_BYTES
    be.plan(batch)
    assert be.debug_state()["mode"] == "paged_fa2"
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    k_before, v_before = kc[0].clone(), vc[0].clone()
    out = be.forward(0, q, k, v)
    ref = _ref_attention(q, k, v, k_before, v_before, seqs, bs, d**-0.5)
    assert rel_err(out, ref) < 2e-2
