"""GPU: decode CUDA graphs captured per split (issue 6 item 1). On green-context decode streams
the graphs give the eager decode's logits, the runner picks each stream's own set (the
whole-GPU set only on ordinary streams), and the engine's PD loop captures a split's set the
first time it decodes there. The checks live in bench/gpu_partition.py (`split_graphs_check`)
so the device benchmark and pytest share them.

Model: random:qwen2.5-3b with a small KV pool: head_dim 128, whose FlashInfer kernels the
device run has cached (random:tiny's head_dim 32 would need a JIT build of several minutes)."""

from __future__ import annotations

import random

import pytest
from gpu_engines import small_engine

pytestmark = pytest.mark.gpu


def _engine(**kw):  # type: ignore[no-untyped-def]
    # The checks compare a graph with the eager forward on the same kernels (FlashInfer +
    # cuBLAS). The fused decode (Triton kernels, default up to 64 rows) rounds differently:
    # tests/gpu/test_fused_decode_gpu.py judges it against an fp32 forward instead.
    kw.setdefault("fused_decode_max_batch", 1)
    eng, sink = small_engine(max_num_seqs=64, **kw)
    if eng._green is None:
        pytest.skip(f"green contexts unavailable: {eng.partition.state().reason}")
    assert eng.runner.graph_registry is not None, "no decode graphs (FlashInfer missing?)"
    return eng, sink


@pytest.mark.gpu
def test_split_graphs_match_eager_and_are_picked_per_stream() -> None:
    from bench.gpu_partition import split_graphs_check

    eng, _ = _engine()
    try:
        splits = eng._green.splits
        total = eng._green.layout.total_sms
        # The smallest decode partitions (12 SMs on the H200) fail in cuBLAS and are taken
        # out of service at start-up (docs/partition.md): pick the largest split below them.
        usable = [s for s in splits if total - s >= 20]
        chosen = [usable[len(usable) // 2], usable[-1]]
        res = split_graphs_check(eng, splits=chosen, batches=(5, 33), ctx_tokens=200, iters=1)
        failed = [c for c in res["checks"] if not c["ok"]]
        assert not failed, failed
        # per split: selection + 2 batch sizes; the whole GPU too; plus one capture per split
        assert len(res["checks"]) == 3 * (len(chosen) + 1) + len(chosen)
    finally:
        eng.shutdown(0)


@pytest.mark.gpu
def test_pd_loop_captures_the_splits_graphs_on_first_decode() -> None:
    from runtime.graphs.decode import cuda_stream_key
    from runtime.request import Request, RequestKind, SamplingParams

    eng, sink = _engine()
    try:
        split = eng._green.splits[len(eng._green.splits) // 2]
        eng.partition.set_mode(f"static:{split}")
        decode_stream = eng._green.pairs[split].decode.stream
        reg = eng.runner.graph_registry
        assert not reg.is_split_stream(decode_stream)  # nothing captured up front
        eng.start()
        rng = random.Random(3)
        ids = []
        for i, n in enumerate((300, 40, 900)):
            rid = f"g{i}"
            ids.append(rid)
            eng.add(
                Request(
                    rid,
                    RequestKind.GENERATE,
                    [rng.randrange(100, 30000) for _ in range(n)],
                    sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                )
            )
        assert sink.wait(ids, 120), "requests timed out"
        assert all(len(sink.tokens.get(r, [])) == 12 for r in ids)
        got = reg.sets.get(cuda_stream_key(decode_stream))
        assert got is not None and got is not eng.runner.decode_graphs
        assert got.graphs, "the split's set holds no captured graph"
    finally:
        eng.shutdown(0)
