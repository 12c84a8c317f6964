"""GPU: the fused RoPE + K/V pool write (`--fused-rope-kv-write`) on the FlashInfer path. The
model's forward with a fusing backend gives the unfused forward's hidden states and pool in
every attention mode (fresh prompts, cached context, a discarded scoring suffix, decode), and
an engine with it on (decode graphs and prefill graphs included) scores like one with it off.

Model: random:qwen2.5-3b with a small KV pool (head_dim 128: FlashInfer's cached kernels)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from gpu_engines import chat_and_scoring, rel_err, run_to_end, small_engine

pytestmark = pytest.mark.gpu


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
            err = rel_err(outs[1], outs[0])
            assert err < 1e-2, (specs, err)
        for layer in range(cfg.num_layers):
            assert rel_err(pools[1].k[layer], pools[0].k[layer]) < 1e-2
            assert torch.equal(pools[1].v[layer], pools[0].v[layer]) or (
                rel_err(pools[1].v[layer], pools[0].v[layer]) < 1e-2
            )


def test_engine_with_fused_rope_scores_like_without() -> None:
    results = []
    # Unfused; fused in attention; fused inside the prefill graphs (`prefill_graphs_write_kv`).
    for fuse, write_kv in ((False, False), (True, False), (True, True)):
        eng, sink = small_engine(
            fused_rope_kv_write="true" if fuse else "false",
            prefill_graphs_write_kv="true" if write_kv else "false",
        )
        assert eng.backend.fuses_rope is fuse
        assert eng.runner.prefill_graphs is not None
        assert eng.runner.prefill_graphs.rotate_in_attention is (fuse and not write_kv)
        assert (eng.runner.prefill_graphs.kv_write is not None) is write_kv
        # Fresh requests per engine (a request is mutable state), the same ones each time.
        reqs = chat_and_scoring(
            seed=4, profile_tokens=500, num_items=5, item_max=150, chat_max=300, max_tokens=12
        )
        done = run_to_end(eng, sink, reqs)
        lens = {rid: len(done[rid][1]) for rid in list(done)[:4]}
        assert all(n == 12 for n in lens.values()), lens
        results.append({rid: out for rid, (out, _) in done.items()})
    for rid, out in results[0].items():
        if rid.startswith("s"):
            for other in results[1:]:
                assert other[rid].label_probs == pytest.approx(out.label_probs, abs=2e-2), rid
