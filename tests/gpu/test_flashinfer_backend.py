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


def _staged_paged_batch(specs: list[tuple[int, int, int]], hkv: int, seed: int):  # type: ignore[no-untyped-def]
    """A paged prefill batch of (context, query, kept) per sequence over a random bf16 pool
    (head dim 128, 16-token blocks) on CUDA, for an H100/H200 (132 SMs): (k caches, v
    caches, seqs, batch). Skips without CUDA or on another SM count."""
    import torch

    from bench.gpu_suite import _make_seqs
    from runtime.attention.base import ForwardBatch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the batch is chosen for 132 SMs (H100/H200)")
    bs = 16
    nblocks = sum(-(-max(ctx, kept) // bs) for ctx, _, kept in specs) + 16
    kc = [torch.randn(nblocks, bs, hkv, 128, device="cuda", dtype=torch.bfloat16)]
    vc = [torch.randn_like(kc[0])]
    seqs = _make_seqs(specs, bs, nblocks, torch.Generator().manual_seed(seed))
    t = sum(s.num_query_tokens for s in seqs)
    zeros = torch.zeros(t, dtype=torch.int64, device="cuda")
    return kc, vc, seqs, ForwardBatch(zeros, zeros, seqs, zeros[:1], is_decode=False)


def _matches_reference(be, kc, vc, seqs, hq: int, hkv: int) -> float:  # type: ignore[no-untyped-def]
    """The planned backend's layer-0 attention of random q/k/v against the float32
    reference: its relative error."""
    import torch

    from bench.gpu_suite import _ref_attention, rel_err

    t = sum(s.num_query_tokens for s in seqs)
    q = torch.randn(t, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, 128, device="cuda", dtype=torch.bfloat16)
    k_before, v_before = kc[0].clone(), vc[0].clone()
    out = be.forward(0, q, k, v)
    return rel_err(out, _ref_attention(q, k, v, k_before, v_before, seqs, 16, 128**-0.5))


@pytest.mark.gpu
def test_merged_step_that_splits_the_kv_fits_the_workspace() -> None:
    """A merged step of the Qwen2.5-3B shape (16 query heads over 2 KV heads) that FlashInfer's
    FA2 scheduler splits into 132 work tiles of 128 rows: its partial outputs need 133 MiB of
    float workspace, more than FlashInfer's default 128 MiB (the overflow failed 77 merged
    steps of a 48-stream chat run on the H200). Positive control: the default-sized buffer
    raises on this very batch; the backend's own size plans it and matches the reference."""
    from runtime.attention.flashinfer_backend import DEFAULT_WORKSPACE_BYTES, FlashInferBackend

    hq, hkv, d = 16, 2, 128
    # 20 decodes over 1,000 cached tokens + 2 prompt parts of 200 tokens after 64 cached.
    specs = [(1000, 1, 1001)] * 20 + [(64, 200, 264)] * 2
    kc, vc, seqs, batch = _staged_paged_batch(specs, hkv, seed=0)

    small = FlashInferBackend(kc, vc, hq, hkv, d, workspace_bytes=DEFAULT_WORKSPACE_BYTES)
    with pytest.raises(RuntimeError, match="batch_prefill_tmp_v"):
        small.plan(batch)

    be = FlashInferBackend(kc, vc, hq, hkv, d)
    assert be.workspace.numel() > DEFAULT_WORKSPACE_BYTES
    be.plan(batch)
    assert be.debug_state()["mode"] == "paged_fa2"
    assert _matches_reference(be, kc, vc, seqs, hq, hkv) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("context", "chunk", "mode"),
    [(20_000, 400, "paged"), (8_000, 350, "paged_fa2"), (8_000, 360, "paged")],
)
def test_a_merged_step_takes_the_kernel_its_work_calls_for_and_matches(
    context: int, chunk: int, mode: str
) -> None:
    """A merged step of the Llama-3.1-8B shape (32 query heads over 8 KV heads): a chunk
    after a long context beside 10 decodes of 2,000 cached tokens. `prefill_on_fa2` sends it
    to FA3 ("paged") where the chunk's attention work outweighs FA3's waste on the one-token
    rows (20k of context), or FA2's plan stops splitting the KV (8k, 360 tokens: 34 tiles
    for 33), and keeps it on FA2 ("paged_fa2") at 8k and 350 tokens, where FA2 split and
    measured 0-5 % faster. Each way the output matches the float32 reference."""
    from runtime.attention.flashinfer_backend import FlashInferBackend

    hq, hkv = 32, 8
    specs = [(context, chunk, context + chunk)] + [(2000, 1, 2001)] * 10
    kc, vc, seqs, batch = _staged_paged_batch(specs, hkv, seed=1)
    be = FlashInferBackend(kc, vc, hq, hkv, 128)
    be.plan(batch)
    assert be.debug_state()["mode"] == mode
    assert _matches_reference(be, kc, vc, seqs, hq, hkv) < 2e-2


@pytest.mark.gpu
def test_hybrid_prefill_writes_attention_into_the_hidden_buffer_and_matches() -> None:
    """A hybrid prefill of a batch that attends all rows at once (two sequences here; one
    long prompt streams rows instead, below) hands FlashInfer the layer's consumed
    hidden-state buffer as `out=` (one [T, H] tensor less at the activation peak). The output
    must land there, and the hidden states must match an unchunked forward (bf16 tolerance)."""
    import torch

    from bench.gpu_suite import rel_err
    from runtime.attention.base import ForwardBatch, SeqSlice

    model, mc, be = _quarter_8b()
    handed: list[bool] = []
    real = be.forward

    def spy(layer_idx, q, k, v, rope=None, out=None):
        o = real(layer_idx, q, k, v, rope=rope, out=out)
        handed.append(out is not None and o.data_ptr() == out.data_ptr())
        return o

    be.forward = spy  # type: ignore[method-assign]
    ids = torch.randint(0, mc.vocab_size, (1000,), device="cuda")
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.cat([torch.arange(600), torch.arange(400)]).cuda(),
        seqs=[SeqSlice(0, 600, 0, 0, []), SeqSlice(600, 400, 0, 0, [])],
        logits_indices=torch.tensor([599, 999], device="cuda"),
        is_decode=False,
    )
    with torch.inference_mode():
        be.plan(batch)
        assert not be.attends_rows()
        full = model(batch.input_ids, batch.positions, be)
        assert handed == [False] * mc.num_layers
        handed.clear()
        be.plan(batch)
        chunked = model(batch.input_ids, batch.positions, be, chunk_tokens=128)
    assert handed == [True] * mc.num_layers
    assert rel_err(chunked.float(), full.float()) < 2e-2


def _quarter_8b():
    """Two layers of the 8B's attention geometry at a quarter of its width (q heads x
    head_dim = hidden, as out= needs), bf16 on CUDA, with the engine's FlashInfer backend over
    a 64-block pool."""
    import dataclasses

    import torch

    from runtime.config import EngineConfig
    from runtime.engine import make_attention_backend
    from runtime.kv.kv_pool import KVPool
    from runtime.model.llama import LlamaForCausalLM
    from runtime.model.presets import get_preset
    from runtime.runner import use_ops_for

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base = get_preset("llama-3.1-8b")
    mc = dataclasses.replace(
        base,
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=2,
        num_q_heads=8,
        num_kv_heads=2,
        vocab_size=4096,
        max_position_embeddings=32768,
        rope_scaling=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(mc).to("cuda", torch.bfloat16).eval()
    cfg = EngineConfig(model="random:tiny")
    pool = KVPool.for_model(mc, 64, cfg.block_size, torch.bfloat16, torch.device("cuda"))
    be = make_attention_backend(cfg, pool, mc.num_q_heads)
    assert use_ops_for(be) and be.writes_out
    return model, mc, be


def _one_prompt(mc, num_tokens: int, kept: int, blocks: list[int]):
    """A prefill batch of one prompt of `num_tokens` random ids, no cached context, keeping
    its first `kept` rows' K/V in `blocks`."""
    import torch

    from runtime.attention.base import ForwardBatch, SeqSlice

    T = num_tokens
    return ForwardBatch(
        input_ids=torch.randint(0, mc.vocab_size, (T,), device="cuda"),
        positions=torch.arange(T, device="cuda"),
        seqs=[SeqSlice(0, T, 0, kept, blocks)],
        logits_indices=torch.tensor([T - 1], device="cuda"),
        is_decode=False,
    )


@pytest.mark.gpu
def test_one_long_prompt_streams_rows_and_matches() -> None:
    """One prompt without cached context streams rows (`DecoderLayer.forward_rows`): each
    chunk of queries attends to the keys up to its last row through FlashInfer's single
    prefill (queries aligned with the last keys). Hidden states match the unchunked forward;
    the kept rows' K/V in the pool match the unchunked forward's; nothing past them is written."""
    import torch

    from bench.gpu_suite import rel_err

    model, mc, be = _quarter_8b()
    T, kept, bs = 1000, 600, be.block_size
    blocks = list(range(1, 1 + (kept + bs - 1) // bs))
    batch = _one_prompt(mc, T, kept, blocks)
    slots = torch.tensor(
        [blocks[p // bs] * bs + p % bs for p in range(len(blocks) * bs)], device="cuda"
    )
    calls: list[tuple[int, int]] = []
    real = be.attend_rows

    def spy(layer_idx, q, k, v):
        calls.append((int(q.shape[0]), int(k.shape[0])))
        return real(layer_idx, q, k, v)

    be.attend_rows = spy  # type: ignore[method-assign]
    with torch.inference_mode():
        be.plan(batch)
        full = model(batch.input_ids, batch.positions, be)
        pool_full = [be.k_caches[i].view(-1, 2, 128)[slots].clone() for i in range(2)]
        for c in list(be.k_caches) + list(be.v_caches):
            c.zero_()
        be.plan(batch)
        assert be.attends_rows()
        rows = model(batch.input_ids, batch.positions, be, chunk_tokens=128)
    assert calls[:8] == [(128, 128 * (i + 1)) for i in range(7)] + [(104, 1000)]
    assert len(calls) == 8 * mc.num_layers
    assert rel_err(rows.float(), full.float()) < 2e-2
    for i in range(2):
        got = be.k_caches[i].view(-1, 2, 128)[slots]
        assert rel_err(got[:kept].float(), pool_full[i][:kept].float()) < 1e-2
        assert not got[kept:].any()  # the discarded suffix's rows of the last block


@pytest.mark.gpu
def test_streamed_rows_after_a_cached_prefix_match() -> None:
    """A long prompt whose first 256 positions are cached (a prefix hit, the suffix discarded
    as scoring does): the rows read the context's K/V from the pool (`read_context`) and
    attend to context + rows; the hidden states match the batch's whole-T forward (FlashInfer's
    gather path) and the uncached prompt's forward at the same positions."""
    import torch

    from bench.gpu_suite import rel_err
    from runtime.attention.base import ForwardBatch, SeqSlice

    model, mc, be = _quarter_8b()
    bs, ctx, T = be.block_size, 256, 1000
    ids = torch.randint(0, mc.vocab_size, (T,), device="cuda")
    blocks = list(range(1, 1 + ctx // bs))
    whole = ForwardBatch(ids, torch.arange(T, device="cuda"), [SeqSlice(0, T, 0, ctx, blocks)],
                         torch.tensor([T - 1], device="cuda"), is_decode=False)  # fmt: skip
    rest = ForwardBatch(ids[ctx:], torch.arange(ctx, T, device="cuda"),
                        [SeqSlice(0, T - ctx, ctx, ctx, blocks)],
                        torch.tensor([T - ctx - 1], device="cuda"), is_decode=False)  # fmt: skip
    with torch.inference_mode():
        be.plan(whole)
        uncached = model(whole.input_ids, whole.positions, be)[ctx:]  # writes the prefix
        be.plan(rest)
        full = model(rest.input_ids, rest.positions, be)
        be.plan(rest)
        assert be.attends_rows() and be.num_context_rows() == ctx
        rows = model(rest.input_ids, rest.positions, be, chunk_tokens=128)
    assert rel_err(rows.float(), full.float()) < 2e-2
    assert rel_err(rows.float(), uncached.float()) < 2e-2


@pytest.mark.gpu
def test_streamed_rows_hold_a_prompt_in_its_stream_and_kv() -> None:
    """The point of streaming rows: a long prompt's activation peak grows by the residual
    stream and K/V a token (hidden + 2 * kv heads * head_dim elements), where attending all
    rows at once also held h, q and the residual pair. Measured with CUDA's allocator between
    8k and 16k tokens, after a warm-up (FlashInfer's scratch buffers)."""
    import torch

    model, mc, be = _quarter_8b()

    def peak(T: int) -> int:
        batch = _one_prompt(mc, T, 0, [])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            be.plan(batch)
            out = model(batch.input_ids, batch.positions, be, chunk_tokens=2048)
            del out
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak(4096)
    per_token = (peak(16384) - peak(8192)) / 8192
    stream_and_kv = (mc.hidden_size + 2 * mc.num_kv_heads * mc.head_dim) * 2  # bf16
    # ids and positions (int64) add 16 bytes a token; anything near 2x would be the old peak.
    assert per_token <= 1.1 * stream_and_kv + 16, (per_token, stream_and_kv)


@pytest.mark.gpu
def test_a_streamed_layer_in_row_pieces_matches_the_whole_layer_on_flashinfer() -> None:
    """Sub-layer slices on FlashInfer: one prompt's layers run as row pieces of whole chunks
    (`forward_layer_rows`: rows 0-384, then 384-1000, in 128-row chunks) give the stream
    `forward_layers` gives over the same layers (the same chunks run; compared to bf16
    rounding, in case a library picks another algorithm between the two runs)."""
    import torch

    model, mc, be = _quarter_8b()
    T, bs = 1000, be.block_size
    blocks = list(range(1, 1 + (T + bs - 1) // bs))
    batch = _one_prompt(mc, T, T, blocks)
    with torch.inference_mode():
        be.plan(batch)
        assert model.streams_rows(T, be, 128)
        h0 = model.embed(batch.input_ids)
        whole, res = model.forward_layers(
            h0.clone(), None, batch.positions, be, 0, mc.num_layers, 128
        )
        assert res is None
        be.plan(batch)
        h, kv = h0.clone(), None
        for layer in range(mc.num_layers):
            for start, end in ((0, 384), (384, T)):
                h, kv = model.forward_layer_rows(
                    h, None, batch.positions, be, layer, start, end, 128, kv
                )
            assert kv is None
    from bench.gpu_suite import rel_err

    assert rel_err(h.float(), whole.float()) < 1e-3
