"""GPU: the fused RoPE + K/V pool write (`--fused-rope-kv-write`) on the FlashInfer path. The
model's forward with a fusing backend gives the unfused forward's hidden states and pool in
every attention mode (fresh prompts, cached context, a discarded scoring suffix, decode), and
an engine with it on (decode graphs and prefill graphs included) scores like one with it off.

Model: random:qwen2.5-3b with a small KV pool (head_dim 128: FlashInfer's cached kernels)."""

from __future__ import annotations

import dataclasses
import random

import pytest

pytestmark = pytest.mark.gpu


def _rel_err(a, b) -> float:  # type: ignore[no-untyped-def]
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def test_fused_forward_matches_the_unfused_one_in_every_mode() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from runtime.attention.base import ForwardBatch, SeqSlice
    from runtime.attention.flashinfer_backend import FlashInferBackend
    from runtime.kv.kv_pool import KVPool
    from runtime.model import ops
    from runtime.model.loader import _materialise, init_random_weights
    from runtime.model.presets import get_preset

    ops.use_flashinfer(True)
    cfg = get_preset("qwen2.5-3b")
    cfg = dataclasses.replace(cfg, num_layers=4)  # four layers are enough here
    model = _materialise(cfg, torch.bfloat16, torch.device("cuda"))
    init_random_weights(model, 0)
    pools = [KVPool.for_model(cfg, 400, 16, torch.bfloat16, "cuda") for _ in range(2)]
    backends = [
        FlashInferBackend.from_pool(p, cfg.num_q_heads, fuse_rope_kv_write=f)
        for p, f in zip(pools, (False, True), strict=True)
    ]
    assert backends[1].fuses_rope and not backends[0].fuses_rope
    rng = random.Random(0)

    def batch(specs, is_decode=False):  # type: ignore[no-untyped-def]
        ids, pos, seqs = [], [], []
        for ctx, n, kept, blocks in specs:
            seqs.append(SeqSlice(len(ids), n, ctx, kept, blocks))
            ids += [rng.randrange(5, 30000) for _ in range(n)]
            pos += range(ctx, ctx + n)
        rows = [s.query_start + s.num_query_tokens - 1 for s in seqs]
        t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
        return ForwardBatch(t(ids), t(pos), seqs, t(rows), is_decode)

    a, b, c = list(range(0, 40)), list(range(40, 80)), list(range(80, 120))
    steps = [
        ([(0, 300, 300, a), (0, 200, 200, b)], False),  # ragged: fresh prompts
        ([(300, 100, 400, a), (200, 50, 250, b)], False),  # paged: cached context
        ([(300, 60, 300, a), (0, 90, 90, c)], False),  # gather: a discarded suffix + context
        ([(400, 1, 401, a), (250, 1, 251, b), (90, 1, 91, c)], True),  # decode
    ]
    with torch.inference_mode():
        for specs, is_decode in steps:
            fb = batch(specs, is_decode)
            outs = []
            for be in backends:
                be.plan(fb)
                outs.append(model(fb.input_ids, fb.positions, be))
            err = _rel_err(outs[1], outs[0])
            assert err < 1e-2, (specs, err)
        for layer in range(cfg.num_layers):
            assert _rel_err(pools[1].k[layer], pools[0].k[layer]) < 1e-2
            assert torch.equal(pools[1].v[layer], pools[0].v[layer]) or (
                _rel_err(pools[1].v[layer], pools[0].v[layer]) < 1e-2
            )


def test_engine_with_fused_rope_scores_like_without() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench.gpu_partition import Sink
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.request import Request, RequestKind, SamplingParams

    rng = random.Random(4)
    profile = [rng.randrange(5, 30000) for _ in range(500)]
    items = [[rng.randrange(5, 30000) for _ in range(rng.randrange(20, 150))] for _ in range(5)]
    chats = [[rng.randrange(5, 30000) for _ in range(rng.randrange(30, 300))] for _ in range(4)]
    results = []
    for fuse in (False, True):
        sink = Sink()
        eng = Engine(
            EngineConfig(
                model="random:qwen2.5-3b",
                attention_backend="flashinfer",
                num_kv_blocks=1200,
                max_num_seqs=16,
                max_model_len=4096,
                prefill_policy="fcfs",
                fused_rope_kv_write=fuse,
            ),
            sink,
        )
        assert eng.backend.fuses_rope is fuse
        assert eng.runner.prefill_graphs is not None
        assert eng.runner.prefill_graphs.rotate_in_attention is fuse
        eng.start()
        try:
            reqs = [
                Request(
                    f"chat{i}",
                    RequestKind.GENERATE,
                    c,
                    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
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
            results.append({r.request_id: sink.done[r.request_id] for r in reqs})
            lens = {r.request_id: len(sink.tokens.get(r.request_id, [])) for r in reqs[:4]}
            assert all(n == 12 for n in lens.values()), lens
        finally:
            eng.shutdown(0)
    for rid, out in results[0].items():
        if rid.startswith("s"):
            assert results[1][rid].label_probs == pytest.approx(out.label_probs, abs=2e-2), rid
