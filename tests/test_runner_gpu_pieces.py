"""CPU tests of the GPU runtime's non-kernel pieces: graph batch-size bucketing, pad rows,
the pool's reserved pad block, batched label scoring and the OOM message."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.base import SeqSlice
from runtime.graphs.decode import bucket_for, graph_batch_sizes, pad_seqs
from runtime.kv.kv_pool import KVPool
from runtime.model.presets import get_preset
from runtime.request import Request, RequestKind
from runtime.runner import describe_oom, label_probs
from runtime.scheduler import Lease, ScheduledSeq, StepPlan


def test_graph_batch_sizes_cover_max_num_seqs() -> None:
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert graph_batch_sizes(1) == (1,)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_for_is_smallest_captured_size_not_below() -> None:
    sizes = graph_batch_sizes(100)
    assert [bucket_for(n, sizes) for n in (1, 3, 16, 17, 97, 100)] == [1, 4, 16, 24, 100, 100]
    with pytest.raises(ValueError):
        bucket_for(101, sizes)
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def test_pad_rows_use_only_the_pad_block() -> None:
    live = [SeqSlice(0, 1, 10, 11, [3]), SeqSlice(1, 1, 5, 6, [7])]
    padded = pad_seqs(live, 4, pad_block_id=99)
    assert padded[:2] == live
    for i, s in enumerate(padded[2:], start=2):
        assert (s.query_start, s.num_query_tokens, s.num_context_tokens) == (i, 1, 0)
        assert s.num_kept_tokens == 1 and s.block_ids == [99]


def test_pool_reserves_a_pad_block_outside_the_managers_range() -> None:
    cfg = get_preset("tiny")
    pool = KVPool.for_model(cfg, 10, 16, torch.float32, "cpu")
    assert pool.num_blocks == 10 and pool.pad_block_id == 10
    assert pool.k[0].shape[0] == 11 == pool.num_total_blocks
    plain = KVPool(1, 10, 16, 2, 8, torch.float32, "cpu")
    assert plain.pad_block_id is None and plain.k[0].shape[0] == 10


def test_label_probs_matches_per_row_reference() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    rows, labels, soft = [0, 2, 4], [[3, 7], [1, 2, 9], [40]], [True, False, True]
    got = label_probs(logits, rows, labels, soft)
    ref = []
    for r, lab, s in zip(rows, labels, soft, strict=True):
        lt = torch.tensor(lab)
        ref.append(logits[r, lt].softmax(-1) if s else logits[r].softmax(-1)[lt])
    torch.testing.assert_close(got, torch.cat(ref))


def test_oom_message_names_the_step() -> None:
    req = Request("r", RequestKind.SCORE, [1] * 100, label_token_ids=[1])
    seq = ScheduledSeq(
        request=req,
        lease=Lease(req, req.request_id, -1),
        num_context_tokens=0,
        num_new_tokens=100,
        num_kept_tokens=96,
        block_ids=list(range(6)),
        input_ids=[1] * 100,
        needs_output=True,
    )
    msg = describe_oom(StepPlan(step_id=0, prefill=[seq]))
    assert "100 tokens" in msg and "out of GPU memory" in msg


class _SpyMeter:
    """Stands in for the CUDA allocator: 'allocates' 1000 bytes per model forward that runs
    between reset() and peak()."""

    def __init__(self) -> None:
        self.forwards = 0
        self._at_reset = -1

    def reset(self) -> int:
        self._at_reset = self.forwards
        return 5000

    def peak(self) -> int:
        return 5000 + 1000 * (self.forwards - self._at_reset)


@pytest.mark.parametrize("hybrid", [True, False])
def test_profile_activation_peak_runs_one_forward_as_configured(hybrid: bool) -> None:
    from runtime.attention.torch_backend import TorchAttentionBackend
    from runtime.config import EngineConfig
    from runtime.model.loader import load_model
    from runtime.runner import profile_activation_peak

    model, mc, _ = load_model("random:tiny", torch.float32, "cpu")
    cfg = EngineConfig(
        model="random:tiny",
        device="cpu",
        hybrid_prefill=hybrid,
        prefill_chunk_tokens=16,
        max_num_seqs=4,
    )
    meter = _SpyMeter()
    seen: list[tuple[int, int | None, int]] = []
    real_forward = model.forward

    def spy(ids, positions, attn, chunk_tokens=None, stream_rows_above=0):  # type: ignore[no-untyped-def]
        meter.forwards += 1
        seen.append((int(ids.numel()), chunk_tokens, stream_rows_above))
        return real_forward(
            ids, positions, attn, chunk_tokens=chunk_tokens, stream_rows_above=stream_rows_above
        )

    model.forward = spy  # type: ignore[method-assign]
    peak = profile_activation_peak(cfg, model, mc, 40, TorchAttentionBackend, meter=meter)
    assert peak == 1000  # exactly one forward between reset and peak
    # The form the engine runs: rows stream only past one step's budget.
    assert seen == [(40, 16 if hybrid else None, cfg.prefill_token_budget)]
    # Longer than the position limit: clamped, not an index error.
    seen.clear()
    profile_activation_peak(cfg, model, mc, 10**9, TorchAttentionBackend, meter=meter)
    assert seen[0][0] == model.rotary.max_positions


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_profile_activation_peak_splits_the_tokens_over_sequences(num_seqs: int) -> None:
    """The engine measures a budget-sized step as two sequences (hybrid prefill then attends
    all rows at once, the higher peak) and a long prompt as one (it streams rows)."""
    from runtime.attention.torch_backend import TorchAttentionBackend
    from runtime.config import EngineConfig
    from runtime.model.loader import load_model
    from runtime.runner import profile_activation_peak

    model, mc, _ = load_model("random:tiny", torch.float32, "cpu")
    cfg = EngineConfig(
        model="random:tiny", device="cpu", prefill_chunk_tokens=16, prefill_token_budget=32
    )
    planned: list[list[tuple[int, int]]] = []
    streamed: list[bool] = []

    def backend(pool):  # type: ignore[no-untyped-def]
        be = TorchAttentionBackend(pool)
        real = be.plan

        def plan(batch):  # type: ignore[no-untyped-def]
            real(batch)
            planned.append([(s.query_start, s.num_query_tokens) for s in batch.seqs])
            streamed.append(be.attends_rows())

        be.plan = plan  # type: ignore[method-assign]
        return be

    profile_activation_peak(cfg, model, mc, 41, backend, meter=_SpyMeter(), num_seqs=num_seqs)
    assert planned == ([[(0, 41)]] if num_seqs == 1 else [[(0, 20), (20, 21)]])
    assert streamed == [num_seqs == 1]


def test_profile_activation_peak_needs_a_meter_off_cuda() -> None:
    from runtime.attention.torch_backend import TorchAttentionBackend
    from runtime.config import EngineConfig
    from runtime.model.loader import load_model
    from runtime.runner import profile_activation_peak

    model, mc, _ = load_model("random:tiny", torch.float32, "cpu")
    with pytest.raises(ValueError, match="meter"):
        profile_activation_peak(
            EngineConfig(model="random:tiny"), model, mc, 8, TorchAttentionBackend
        )


def test_attention_warm_up_uses_the_pad_block_and_survives_a_failure(caplog) -> None:
    """ModelRunner.warm_up_attention: the backend's warm-up gets the pool's pad block (block 0
    without one); a failure is logged as a fallback and start-up goes on; a backend without a
    warm-up (torch SDPA) is left alone."""
    from types import SimpleNamespace

    from runtime.runner import ModelRunner

    calls: list[int] = []

    def ok(block_id: int) -> list[str]:
        calls.append(block_id)
        return ["ragged"]

    def broken(block_id: int) -> list[str]:
        raise RuntimeError("no kernel for this head size")

    runner = SimpleNamespace(prefill_backend=SimpleNamespace(warm_up=ok),
                             kv_pool=SimpleNamespace(pad_block_id=41))  # fmt: skip
    ModelRunner.warm_up_attention(runner)  # type: ignore[arg-type]
    runner.kv_pool.pad_block_id = None
    ModelRunner.warm_up_attention(runner)  # type: ignore[arg-type]
    assert calls == [41, 0]
    runner.prefill_backend = SimpleNamespace(warm_up=broken)
    with caplog.at_level("WARNING", logger="greenlane.runner"):
        ModelRunner.warm_up_attention(runner)  # type: ignore[arg-type]
    assert "FALLBACK: attention warm-up failed" in caplog.text
    assert "no kernel for this head size" in caplog.text
    from runtime.diagnostics import fallbacks

    assert "no kernel for this head size" in fallbacks.taken()["attention warm-up"]
    runner.prefill_backend = SimpleNamespace()  # no warm_up: nothing to do
    ModelRunner.warm_up_attention(runner)  # type: ignore[arg-type]


def test_float_workspace_covers_the_split_kv_plans_the_h200_asked_for() -> None:
    """The sizes FlashInfer 0.5.3 asked for and did not get on the H200 (132 SMs) with the
    Qwen2.5-3B shape: tmp_v up to 138,412,032 bytes plus tmp_s; the 8B shape (8 KV heads)
    fits the default; one KV head over 32 query heads needs four times the 3B's."""
    from runtime.attention.flashinfer_backend import DEFAULT_WORKSPACE_BYTES, float_workspace_bytes

    qwen3b = float_workspace_bytes(16, 2, 128, 132)
    assert qwen3b >= 138_412_032 + 16 * 132 * 128 * 4 > DEFAULT_WORKSPACE_BYTES
    assert float_workspace_bytes(32, 8, 128, 132) == DEFAULT_WORKSPACE_BYTES
    assert float_workspace_bytes(32, 1, 128, 132) > 4 * 138_412_032


def _on_fa2(query_lens: list[int], kv_lens: list[int], hq: int, hkv: int) -> bool:
    from runtime.attention.flashinfer_backend import prefill_on_fa2

    return prefill_on_fa2(query_lens, kv_lens, hq, hkv, 132, 16)  # H100/H200: 132 SMs


def test_a_short_query_over_a_cached_prefix_plans_fa2_a_full_one_fa3() -> None:
    """FlashInfer's Hopper prefill never splits the KV: one work item per query head per 128
    query rows. A scoring suffix of ~150 rows (3B shape: 16 query heads) makes 32 items for
    132 SMs, so it goes to FA2, whose plan splits the KV; a 2,048-row chunk (256 items) stays
    on FA3."""
    ctx = 12_000
    assert _on_fa2([150], [ctx + 150], 16, 2)  # 32 items
    assert _on_fa2([150], [ctx + 150], 32, 8)  # 8B: 64 items, under half of 132
    assert not _on_fa2([150, 1], [ctx + 150, 900], 32, 8)  # 96 items, one of two rows a decode
    assert not _on_fa2([2048], [ctx + 2048], 16, 2)  # 256 items
    assert not _on_fa2([150] * 24, [ctx + 150] * 24, 16, 2)  # 24 scoring suffixes: 768 items
    assert _on_fa2([512], [ctx + 512], 16, 2)  # 64 items: at most half of 132
    assert not _on_fa2([640], [ctx + 640], 16, 2)  # 80 items


def test_a_merged_step_leaves_fa2_for_a_heavy_chunk_fa2_would_underfill() -> None:
    """Mostly one-token rows (a merged step) stay on FA2 (FA3's 128-row tiles would be
    mostly empty) unless the chunk's attention work passes FA3_WORK_RATIO_HIGH (2.5) times
    that waste, or passes FA3_WORK_RATIO_LOW (1) times it where FA2's plan does not split
    the KV; and whatever the work, they stay where FA3's grid would idle most of the GPU
    (FA3_IDLE_RATIO). The H100 sweeps (8B and 3B shapes) that set them: FA3 won at 41k and
    20k of context; at 8k FA2 won by up to 5 % while it split and lost by 15-20 % once it
    stopped; at 30k an unsplit FA2 plan of 40 tiles lost by 22 %; the 3B's 256-token chunks
    (FA3: 32 CTAs) ran 0.58-0.67x FA3's time on FA2."""
    from runtime.attention.flashinfer_backend import fa2_split_plan, prefill_on_fa2

    def merged(u: int, ctx: int, k: int, dctx: int = 2001) -> tuple[list[int], list[int]]:
        return [u] + [1] * k, [ctx + u] + [dctx] * k

    # Chat on the H200's 3B: a short prompt beside 40 decodes, FA2 (the old rule's case).
    assert _on_fa2([2048] + [1] * 40, [2048] + [900] * 40, 16, 2)
    assert _on_fa2(*merged(350, 41_000, 10), 32, 8) is False  # ratio 5.7: FA3
    assert _on_fa2(*merged(330, 20_000, 10), 32, 8) is False  # ratio 2.6: FA3
    # 8k of context beside 10 decodes: ratio 1.1 while FA2 splits (350), 1.2 once it does
    # not (360, past 2 * ceil(360 / 32) + 10 = 34 > 33 tiles: 22 tiles unsplit).
    at, past = (fa2_split_plan(*merged(u, 8_000, 10), 32, 8, 132, 16) for u in (350, 360))
    assert at["split_kv"] and not past["split_kv"] and past["num_work_tiles"] == 22
    assert _on_fa2(*merged(350, 8_000, 10), 32, 8)
    assert _on_fa2(*merged(360, 8_000, 10), 32, 8) is False
    # 256 tokens at 30k beside 24 decodes of 1.5k: ratio 1.7, FA2 unsplit with 40 tiles (a
    # 64-row query tile), over its budget of 33 but each tile reading all 30k keys: FA3. So
    # 512 at 12k beside 48 decodes of 1k (ratio 1.04, 80 such tiles), where FA2 measured 8 %
    # faster: the one step the rule misses by more than 3.2 %. Beside 16 (ratio 3.1): FA3.
    unsplit = fa2_split_plan(*merged(256, 30_000, 24, 1501), 32, 8, 132, 16)
    assert not unsplit["split_kv"] and unsplit["num_work_tiles"] == 40
    assert _on_fa2(*merged(256, 30_000, 24, 1501), 32, 8) is False
    assert _on_fa2(*merged(512, 12_000, 48, 1001), 32, 8) is False
    assert _on_fa2(*merged(512, 12_000, 16, 1001), 32, 8) is False
    # The 3B (16 query heads over 2 KV heads): 256 tokens at 30k beside 4 decodes is ratio
    # 10, but FA3's grid is 2 x (16 + 4) = 40 CTAs, each of the chunk's 32 reading 30k keys,
    # against FA2's KV split over 132 tiles: FA2. 700 tokens fill 88 of FA3's CTAs: FA3.
    assert _on_fa2(*merged(256, 30_000, 4, 1501), 16, 2)
    assert _on_fa2(*merged(256, 16_000, 24, 1501), 16, 2)
    assert _on_fa2(*merged(700, 30_000, 4, 1501), 16, 2) is False
    # Below the low threshold the plan is not searched: a short chunk beside many decodes.
    assert _on_fa2(*merged(64, 8_000, 40), 32, 8)
    # Unknown query heads: the one-token rule alone.
    assert prefill_on_fa2(*merged(350, 41_000, 10), None, 8, 132, 16)


def test_fa2_split_drops_to_one_kv_chunk_when_its_tiles_no_longer_fit_twice() -> None:
    # H100 (132 SMs), Llama-3.1-8B heads (32 query, 8 KV), 16-token pages: at most
    # 2 * 132 // 8 = 33 work tiles when split. A chunk of u tokens after 41,000 is ceil(u / 32)
    # query tiles of 128 packed rows; each of 10 decodes one tile. Two KV chunks each fit
    # while 2 * ceil(u / 32) + 10 <= 33, i.e. up to u = 352.
    from runtime.attention.flashinfer_backend import fa2_split_plan

    def plan(u: int, k: int) -> dict:
        return fa2_split_plan([u] + [1] * k, [41000 + u] + [2001] * k, 32, 8, 132, 16)

    at, past = plan(352, 10), plan(353, 10)
    assert at["split_kv"] and at["kv_chunks_per_seq"][0] == 2 and at["cta_tile_q"] == 128
    assert at["num_work_tiles"] == 2 * 11 + 10 <= at["max_work_tiles_if_split"] == 33
    assert not past["split_kv"] and past["kv_chunks_per_seq"][0] == 1
    assert past["num_work_tiles"] == 12 + 10
    assert plan(416, 6)["split_kv"] and not plan(417, 6)["split_kv"]


def test_fallbacks_keep_their_first_reason_until_a_new_engine() -> None:
    from runtime.config import EngineConfig
    from runtime.diagnostics import fallbacks
    from runtime.engine import Engine

    fallbacks.note("prefill graphs", "out of memory")
    fallbacks.note("prefill graphs", "a later reason")
    assert fallbacks.taken()["prefill graphs"] == "out of memory"
    eng = Engine(EngineConfig(model="random:tiny", num_kv_blocks=64), lambda outs: None)
    assert fallbacks.taken() == {}  # a new engine starts with none (tests build many)
    eng._publish_stats()
    assert eng.stats()["fallbacks"] == {}


def test_staging_waits_count_as_the_launch_waiting_for_the_device() -> None:
    """`ModelRunner.device_wait_s` sums the host's waits in the staging guard (what the step
    trace's `launch_wait_ms` reads over a launch); a planner with nothing staged waits not."""
    import time

    from runtime.runner import ModelRunner

    class SlowEvent:  # a step still running on the device: synchronize blocks 20 ms
        def synchronize(self) -> None:
            time.sleep(0.02)

    runner = ModelRunner.__new__(ModelRunner)  # only the guard's state
    runner._staging_events, runner.device_wait_s = {}, 0.0
    backend = object()
    runner._guard_staging(backend)
    assert runner.device_wait_s == 0.0
    runner._staging_events[id(backend)] = SlowEvent()
    runner._guard_staging(backend)
    runner._guard_staging(backend)
    assert runner.device_wait_s >= 0.04
