"""GPU: piecewise prefill graphs (runtime/prefill_graphs.py). Captured at engine start-up, they
give the eager forward's hidden states for prefill parts of several sizes (fresh prompts,
cached context, a discarded scoring suffix, padding rows left by a larger step), and an engine
that replays them (also with `merge_mixed_steps`) scores like one that runs prefill eagerly.

Model: random:qwen2.5-3b with a small KV pool (head_dim 128, whose FlashInfer kernels the
device run has cached). bf16: the graphs' GEMMs run at the bucket's row count, where cuBLAS may
pick another kernel than at the part's, so results agree to bf16 rounding, not bit for bit."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu


def _engine(**kw):  # type: ignore[no-untyped-def]
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench.gpu_partition import Sink
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    sink = Sink()
    cfg = EngineConfig(
        model="random:qwen2.5-3b",
        attention_backend="flashinfer",
        cuda_graphs=True,
        num_kv_blocks=1200,
        max_num_seqs=16,
        max_model_len=4096,
        prefill_policy="fcfs",
        **kw,
    )
    return Engine(cfg, sink), sink


def _rel_err(a, b) -> float:  # type: ignore[no-untyped-def]
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def test_captured_prefill_graphs_match_the_eager_forward() -> None:
    import torch

    from runtime.attention.base import ForwardBatch, SeqSlice
    from runtime.engine import make_attention_backend

    eng, _ = _engine(prefill_graph_max_tokens=2048)  # every bucket, not only the default's
    try:
        pg = eng.runner.prefill_graphs
        assert pg is not None and pg.captured, "prefill graphs were not captured"
        assert pg.max_tokens == 2048
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
        errs = []
        with torch.inference_mode():
            for specs in steps:
                fb = batch(specs)
                eager_be = make_attention_backend(cfg, pool, model.cfg.num_q_heads)
                graph_be = make_attention_backend(cfg, pool, model.cfg.num_q_heads)
                eager_be.plan(fb)
                want = model(fb.input_ids, fb.positions, eager_be).clone()
                graph_be.plan(fb)
                got = pg.run(fb.input_ids, fb.positions, graph_be).clone()
                errs.append(_rel_err(got, want))
        assert max(errs) < 2e-2, errs
    finally:
        eng.shutdown(0)


def test_engine_scores_alike_with_and_without_prefill_graphs(monkeypatch) -> None:
    from runtime.prefill_graphs import PrefillGraphs
    from runtime.request import Request, RequestKind, SamplingParams

    replays = []
    real_run = PrefillGraphs.run

    def counting_run(self, input_ids, positions, attn):  # type: ignore[no-untyped-def]
        replays.append(int(input_ids.shape[0]))
        return real_run(self, input_ids, positions, attn)

    monkeypatch.setattr(PrefillGraphs, "run", counting_run)
    rng = random.Random(3)
    profile = [rng.randrange(5, 30000) for _ in range(600)]
    items = [[rng.randrange(5, 30000) for _ in range(rng.randrange(20, 200))] for _ in range(6)]
    chats = [[rng.randrange(5, 30000) for _ in range(rng.randrange(30, 400))] for _ in range(4)]
    results = []
    # Eager prefill; prefill graphs; prefill graphs with a step's parts merged into one forward.
    for max_tokens, merge in ((0, False), (1024, False), (1024, True)):
        eng, sink = _engine(
            prefill_graph_max_tokens=max_tokens,
            prefill_token_budget=1024,
            merge_mixed_steps=merge,
        )
        assert (eng.runner.prefill_graphs is not None) == (max_tokens > 0)
        eng.start()
        try:
            reqs = [
                Request(
                    f"chat{i}",
                    RequestKind.GENERATE,
                    c,
                    SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0),
                )
                for i, c in enumerate(chats)
            ]
            reqs += [
                Request(f"s{i}", RequestKind.SCORE, profile + it, label_token_ids=[11, 22, 33])
                for i, it in enumerate(items)
            ]
            for r in reqs:
                eng.add(r)
            assert sink.wait([r.request_id for r in reqs], timeout_s=120)
            results.append(
                {
                    r.request_id: (sink.done[r.request_id], sink.tokens.get(r.request_id, []))
                    for r in reqs
                }
            )
        finally:
            eng.shutdown(0)
    assert replays, "no prefill part replayed the graphs"
    eager = results[0]
    for other in results[1:]:
        for rid, (out, tokens) in eager.items():
            g_out, g_tokens = other[rid]
            if rid.startswith("s"):
                assert g_out.label_probs == pytest.approx(out.label_probs, abs=2e-2), rid
            else:
                assert len(g_tokens) == len(tokens) == 16, rid
