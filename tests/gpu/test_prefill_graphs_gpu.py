"""GPU: piecewise prefill graphs (runtime/graphs/prefill.py). Captured at engine start-up, they
give the eager forward's hidden states for prefill parts of several sizes (fresh prompts,
cached context, a discarded scoring suffix, padding rows left by a larger step), and an engine
that replays them (also with `merge_mixed_steps`: a step's prefill parts and decodes in one
graph replay) scores like one that runs prefill eagerly. A merged step of mostly decodes runs
its attention on FlashInfer's FA2 kernels and generates what separate forwards generate.

Model: random:qwen2.5-3b with a small KV pool (head_dim 128, whose FlashInfer kernels the
device run has cached). bf16: the graphs' GEMMs run at the bucket's row count, where cuBLAS may
pick another kernel than at the part's, so results agree to bf16 rounding, not bit for bit."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gpu_engines import chat_and_scoring, greedy_agreement, rel_err, run_to_end, small_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("write_kv", [False, True])
def test_captured_prefill_graphs_match_the_eager_forward(write_kv: bool) -> None:
    import torch

    from runtime.attention.base import ForwardBatch, SeqSlice
    from runtime.engine import make_attention_backend

    # Every bucket, not only the default's; write_kv: the graphs run the fused RoPE + K/V
    # write themselves (`prefill_graphs_write_kv`).
    eng, _ = small_engine(
        prefill_graph_max_tokens=2048, prefill_graphs_write_kv="true" if write_kv else "false"
    )
    try:
        pg = eng.runner.prefill_graphs
        assert pg is not None and pg.captured, "prefill graphs were not captured"
        assert pg.max_tokens == 2048
        # Every captured bucket was timed; none kept is beaten by a larger one (dropped ones
        # pad to the next kept bucket: a step below covers the smallest dropped one).
        from runtime.graphs.prefill import dominated_buckets

        assert set(pg.bucket_ms) == set(pg.token_sizes) | set(pg.dropped)
        assert all(t > 0 for t in pg.bucket_ms.values()), pg.bucket_ms
        assert dominated_buckets({n: pg.bucket_ms[n] for n in pg.token_sizes}) == []
        model, pool, cfg = eng.model, eng.kv_pool, eng.config
        rng = random.Random(0)
        bs = cfg.block_size
        next_block = [0]

        def blocks(n_tokens: int) -> list[int]:
            n = -(-n_tokens // bs)
            out = list(range(next_block[0], next_block[0] + n))
            next_block[0] += n
            return out

        def batch(specs: list[tuple[int, int, int, list[int]]]) -> ForwardBatch:
            ids, pos, seqs = [], [], []
            for ctx, n, kept, blk in specs:
                seqs.append(SeqSlice(len(ids), n, ctx, kept, blk))
                ids += [rng.randrange(5, 30000) for _ in range(n)]
                pos += range(ctx, ctx + n)
            rows = [s.query_start + s.num_query_tokens - 1 for s in seqs]
            dev = pool.device
            return ForwardBatch(
                torch.tensor(ids, device=dev),
                torch.tensor(pos, device=dev),
                seqs,
                torch.tensor(rows, device=dev),
                False,
            )

        a, b = blocks(1500), blocks(700)
        steps = [
            [(0, 2048, 2048, blocks(2048))],  # the largest bucket, exactly
            [(0, 1000, 1000, a), (0, 300, 300, b)],  # two fresh prompts: 1300 -> 1536
            [(1000, 400, 1400, a), (0, 500, 160, blocks(500))],  # context; scoring suffix
            [(300, 5, 305, b)],  # 5 tokens after larger steps: padding rows hold leftovers
        ]
        if pg.dropped:  # a part the size of a dropped bucket, padded to a larger one
            n = min(pg.dropped)
            steps.append([(0, n, n, blocks(n))])
        # The pool after each step must be the eager forward's too; when the graphs write it
        # themselves, padding rows (some holding a larger step's slots) and the scoring suffix
        # write nothing.
        assert (pg.kv_write is not None) is write_kv
        errs, pool_errs = [], []
        with torch.inference_mode():
            for specs in steps:
                fb = batch(specs)
                before = [t.clone() for t in (*pool.k, *pool.v)]
                eager_be = make_attention_backend(cfg, pool, model.cfg.num_q_heads)
                graph_be = make_attention_backend(cfg, pool, model.cfg.num_q_heads)
                eager_be.plan(fb)
                want = model(fb.input_ids, fb.positions, eager_be).clone()
                want_pool = [t.clone() for t in (*pool.k, *pool.v)]
                for t, saved in zip((*pool.k, *pool.v), before, strict=True):
                    t.copy_(saved)
                graph_be.plan(fb)
                got = pg.run(fb.input_ids, fb.positions, graph_be).clone()
                errs.append(rel_err(got, want))
                for t, w, b0 in zip((*pool.k, *pool.v), want_pool, before, strict=True):
                    pool_errs.append(rel_err(t, w))
                    # Slots the eager forward left alone: the graphs left them too, exactly.
                    untouched = (w == b0).all(dim=-1).all(dim=-1)
                    assert torch.equal(t[untouched], b0[untouched]), "a stray K/V write"
        assert max(errs) < 2e-2, errs
        assert max(pool_errs) < 2e-2, pool_errs
    finally:
        eng.shutdown(0)


def test_engine_scores_alike_with_and_without_prefill_graphs(monkeypatch) -> None:
    from runtime.graphs.prefill import PrefillGraphs

    replays = []
    real_run = PrefillGraphs.run

    def counting_run(self, input_ids, positions, attn):  # type: ignore[no-untyped-def]
        replays.append(int(input_ids.shape[0]))
        return real_run(self, input_ids, positions, attn)

    monkeypatch.setattr(PrefillGraphs, "run", counting_run)
    from runtime.runner import ModelRunner

    merged = []
    real_merged = ModelRunner._run_merged

    def counting_merged(self, prefill, decode, pending):  # type: ignore[no-untyped-def]
        merged.append(len(decode))
        return real_merged(self, prefill, decode, pending)

    monkeypatch.setattr(ModelRunner, "_run_merged", counting_merged)
    results = []
    # Eager prefill; prefill graphs; prefill graphs with a step's parts merged into one replay.
    for max_tokens, merge in ((0, False), (1024, False), (1024, True)):
        eng, sink = small_engine(
            prefill_graph_max_tokens=max_tokens,
            prefill_token_budget=1024,
            merge_mixed_steps=merge,
        )
        assert (eng.runner.prefill_graphs is not None) == (max_tokens > 0)
        # Fresh requests per engine (a request is mutable state), the same ones each time.
        reqs = chat_and_scoring(
            seed=3, profile_tokens=600, num_items=6, item_max=200, chat_max=400, max_tokens=16
        )
        results.append(run_to_end(eng, sink, reqs))
    assert replays, "no prefill part replayed the graphs"
    assert merged, "no step merged its prefill parts and decodes"
    eager = results[0]
    for other in results[1:]:
        for rid, (out, tokens) in eager.items():
            g_out, g_tokens = other[rid]
            if rid.startswith("s"):
                assert g_out.label_probs == pytest.approx(out.label_probs, abs=2e-2), rid
            else:
                assert len(g_tokens) == len(tokens) == 16, rid


def _decode_then_arrive(
    eng: Any, sink: Any, reqs: list[Any], num_decoding: int = 8
) -> dict[str, list[int]]:
    """Start `eng`, add the first `num_decoding` requests, add the rest once those are
    decoding (two tokens each), and return every request's tokens after shutdown."""
    import time

    eng.start()
    try:
        for r in reqs[:num_decoding]:
            eng.add(r)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # the first ones are decoding
            with sink.cv:
                if all(len(sink.tokens.get(r.request_id, [])) >= 2 for r in reqs[:num_decoding]):
                    break
            time.sleep(0.005)
        for r in reqs[num_decoding:]:
            eng.add(r)
        assert sink.wait([r.request_id for r in reqs], timeout_s=120)
    finally:
        eng.shutdown(0)
    return {r.request_id: sink.tokens[r.request_id] for r in reqs}


def test_merged_steps_of_mostly_decodes_run_fa2_and_generate_alike(monkeypatch) -> None:
    """Eight chat streams decode, then two more arrive: their prefills merge with the eight
    decodes into steps of mostly one-token rows, which plan FlashInfer's FA2 paged prefill
    (`paged_fa2`). The greedy tokens match an engine that runs prefill and decode as separate
    forwards (eager prefill, no merging), up to bf16 near ties."""

    from runtime.attention.flashinfer_backend import FlashInferBackend
    from runtime.request import Request, RequestKind, SamplingParams

    modes: list[str] = []
    one_token_fa2: list[bool] = []  # an FA2 plan had one-token rows (decodes merged in)
    real_plan = FlashInferBackend.plan

    def recording_plan(self, batch):  # type: ignore[no-untyped-def]
        real_plan(self, batch)
        modes.append(self._plan.mode)
        if self._plan.mode == "paged_fa2" and not batch.is_decode:
            one_token_fa2.append(any(s.num_query_tokens == 1 for s in batch.seqs))

    monkeypatch.setattr(FlashInferBackend, "plan", recording_plan)
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 30000) for _ in range(rng.randrange(40, 300))] for _ in range(10)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    results: list[dict[str, list[int]]] = []
    for merge in (False, True):
        # Decode-only steps on FlashInfer + cuBLAS on both sides, like the merged steps' decode
        # rows: the fused decode (the default up to 64 rows) rounds differently, and through
        # random weights greedy tokens diverge from the first differing one (107 of 240 agreed
        # with it on the H200, 2026-12-03; judged against fp32 in test_fused_decode_gpu.py).
        eng, sink = small_engine(
            prefill_graph_max_tokens=1024 if merge else 0,
            prefill_token_budget=1024,
            merge_mixed_steps=merge,
            fused_decode_max_batch=1,
        )
        modes.clear()  # start-up's attention warm-up plans every mode once: not a step's
        one_token_fa2.clear()
        reqs = [Request(f"c{i}", RequestKind.GENERATE, p, sp) for i, p in enumerate(prompts)]
        results.append(_decode_then_arrive(eng, sink, reqs))
        assert all(len(t) == 24 for t in results[-1].values())
        if merge:
            assert any(one_token_fa2), f"no merged step planned FA2: {sorted(set(modes))}"
        else:
            # Prefill-only batches may plan FA2 (a short query over a cached prefix), never
            # with decode rows in them.
            assert not any(one_token_fa2)
    agree, total = greedy_agreement(results[0], results[1])
    assert agree >= total // 2, (agree, total)


def test_engine_start_warms_up_every_attention_kernel() -> None:
    """Start-up plans and runs each attention kernel family once (FlashInferBackend.warm_up),
    so none compiles or loads inside a request's step."""
    eng, _ = small_engine()
    try:
        backend = eng.runner.prefill_backend
        assert backend._paged_fa2 is not None, "start-up did not plan the FA2 kernels"
        assert backend._ragged_fa2 is not None, "start-up did not plan FA2's ragged kernels"
        modes = backend.warm_up(eng.runner.kv_pool.pad_block_id)
        assert modes == ["ragged", "paged", "paged_fa2", "gather", "decode"]
    finally:
        eng.shutdown(0)
