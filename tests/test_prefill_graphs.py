"""CPU tests of the piecewise prefill graphs (runtime/graphs/prefill.py): the segments, their
shared static buffers and the padding give the eager forward's hidden states, and an engine
whose prefill parts replay them gives the eager engine's greedy tokens and label scores.

On CPU the "graphs" are stand-ins that run their segment directly (`EagerGraph`); what a
captured CUDA graph adds (recording, replay) is covered by tests/gpu/test_prefill_graphs_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import Collector

from runtime.attention.base import ForwardBatch, SeqSlice, load_rope_kv_write
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.graphs.prefill import (
    PrefillGraphs,
    dominated_buckets,
    prefill_graph_bytes,
    prefill_graph_max_tokens,
    prefill_graph_sizes,
)
from runtime.request import Request, RequestKind, SamplingParams


class EagerGraph:
    """Stands in for one captured segment: `replay` runs the segment on the static buffers."""

    def __init__(self, pg: PrefillGraphs, segment: int, num_tokens: int, log: list) -> None:
        self.pg, self.segment, self.num_tokens, self.log = pg, segment, num_tokens, log

    def replay(self) -> None:
        self.log.append((self.num_tokens, self.segment))
        self.pg._segment(self.segment, self.num_tokens)


def eager_capture(pg: PrefillGraphs) -> list[tuple[int, int]]:
    log: list[tuple[int, int]] = []
    pg.graphs = {
        n: [EagerGraph(pg, s, n, log) for s in range(pg.num_segments)] for n in pg.token_sizes
    }
    return log


def tiny_engine(**overrides) -> tuple[Engine, Collector]:
    sink = Collector()
    cfg = EngineConfig(
        model="random:tiny", prefill_policy="fcfs", block_size=4, num_kv_blocks=128, **overrides
    )
    eng = Engine(cfg, sink)
    # random:tiny's norms start at ones, alike in every layer: make them differ (seeded, the
    # same in every engine) so a segment that used the wrong layer's norm would show.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in eng.model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return eng, sink


def test_buckets_and_the_largest_one() -> None:
    assert prefill_graph_sizes(0, 0.5) == ()
    assert prefill_graph_sizes(100, 0.125) == (16, 32, 64, 96, 100)
    assert prefill_graph_sizes(2048, 0.125)[-1] == 2048
    # padding 0.5 is the first ladder up to 1,024; finer padding bounds every part from 256 on
    assert prefill_graph_sizes(1024, 0.5) == (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    for padding in (0.5, 0.25, 0.125, 0.0625):
        sizes = prefill_graph_sizes(2048, padding)
        assert sizes[:7] == (16, 32, 64, 96, 128, 192, 256) and sizes[-1] == 2048
        for lo, hi in zip(sizes[6:], sizes[7:], strict=False):
            assert hi > lo and (hi - (lo + 1)) / (lo + 1) <= padding  # worst part: lo + 1
    assert len(prefill_graph_sizes(1024, 0.125)) == 23  # 11 at 0.5
    with pytest.raises(ValueError, match="prefill_graph_padding"):
        EngineConfig(prefill_graph_padding=0.01)
    cfg = EngineConfig(prefill_graph_max_tokens=4096, prefill_token_budget=8192)
    assert prefill_graph_max_tokens(cfg) == 2048  # cut at the hybrid-prefill chunk
    cfg = EngineConfig(prefill_graph_max_tokens=4096, prefill_token_budget=1000)
    assert prefill_graph_max_tokens(cfg) == 1000  # ... and at the step budget
    assert prefill_graph_max_tokens(EngineConfig(prefill_graph_max_tokens=0)) == 0
    assert prefill_graph_max_tokens(EngineConfig()) == 1024  # the default
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)


# Three steps both graph tests replay, as `_batch` specs (context, new tokens, kept tokens,
# blocks) per sequence.
STEPS = [
    # two fresh prompts: 15 tokens in the 16 bucket
    [(0, 9, 9, [0, 1, 2]), (0, 6, 6, [3, 4])],
    # a continuation over cached context, and a prompt whose suffix KV is discarded (scoring:
    # it keeps 12 of its 20): 25 tokens in the 32 bucket, rows 25..31 hold nothing of this step
    [(9, 5, 14, [0, 1, 2, 3]), (0, 20, 12, [5, 6, 7])],
    # 3 tokens after larger steps: the padding rows hold their leftovers (and, with the
    # graphs writing the KV, the step before's slots until reset)
    [(14, 3, 17, [0, 1, 2, 3, 8])],
]


def _batch(rng: random.Random, specs: list[tuple[int, int, int, list[int]]]) -> ForwardBatch:
    """A prefill batch of (context, new, kept, block ids) sequences with random token ids."""
    ids, pos, seqs = [], [], []
    for ctx, n, kept, blocks in specs:
        seqs.append(SeqSlice(len(ids), n, ctx, kept, blocks))
        ids += [rng.randrange(5, 500) for _ in range(n)]
        pos += range(ctx, ctx + n)
    rows = torch.tensor([s.query_start + s.num_query_tokens - 1 for s in seqs])
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), seqs, rows, False)


class _OutBackend(TorchAttentionBackend):
    """The torch backend declaring `writes_out` (FlashInfer's way): it is handed `out=`."""

    def __init__(self, pool) -> None:  # type: ignore[no-untyped-def]
        super().__init__(pool)
        self.writes_out = True
        self.outs: list[int] = []

    def forward(self, layer_idx, q, k, v, rope=None, out=None):  # type: ignore[no-untyped-def]
        self.outs.append(-1 if out is None else out.data_ptr())
        return super().forward(layer_idx, q, k, v, rope=rope, out=out)


@pytest.mark.parametrize("writes_out", [False, True])
def test_segments_with_padding_match_the_eager_forward(writes_out: bool) -> None:
    eng, _ = tiny_engine()
    model, pool = eng.model, eng.kv_pool
    pg = PrefillGraphs(model, pool.device, pool.k[0].dtype, (4, 16, 32))
    log = eager_capture(pg)
    assert pg.bucket_for(17) == 32 and pg.bucket_for(33) is None and pg.bucket_for(0) is None
    rng = random.Random(0)

    for specs in STEPS:
        b = _batch(rng, specs)
        eager_be = TorchAttentionBackend(pool)
        graph_be = _OutBackend(pool) if writes_out else TorchAttentionBackend(pool)
        eager_be.plan(b)
        want = model(b.input_ids, b.positions, eager_be)
        graph_be.plan(b)
        got = pg.run(b.input_ids, b.positions, graph_be)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if writes_out:  # every layer's attention went straight into the graphs' input buffer
            assert graph_be.outs == [pg.attn_out.data_ptr()] * model.num_layers
            graph_be.outs.clear()
    # Each step replayed one bucket's segments, in order.
    segs = model.num_layers + 1
    assert log == [(n, s) for n in (16, 32, 4) for s in range(segs)]
    with pytest.raises(ValueError, match="no captured prefill graph for 40 tokens"):
        pg.run(torch.zeros(40, dtype=torch.int64), torch.arange(40), TorchAttentionBackend(pool))


def test_a_bucket_slower_than_a_larger_one_is_dropped() -> None:
    """A bucket a larger one replays faster (beyond the 2 % margin) serves no part: its parts
    pad to the next kept bucket, and the output is the eager forward's. Within the margin,
    both stay; the largest always stays."""
    assert dominated_buckets({}) == []
    # 448's GEMMs slower than 480's (the H100's 8B); 96 vs 128 a tie within the margin.
    ms = {64: 1.0, 96: 1.2, 128: 1.19, 416: 24.0, 448: 28.0, 480: 25.0, 512: 27.0}
    assert dominated_buckets(ms) == [448]
    assert dominated_buckets({16: 5.0, 32: 4.0, 64: 3.0}) == [16, 32]  # the largest stays
    assert dominated_buckets({16: 1.0, 32: 2.0, 64: 3.0}) == []

    eng, _ = tiny_engine()
    model, pool = eng.model, eng.kv_pool
    pg = PrefillGraphs(model, pool.device, pool.k[0].dtype, (4, 16, 32))
    log = eager_capture(pg)
    pg.bucket_ms = {4: 1.0, 16: 3.0, 32: 2.5}
    pg.drop_dominated()
    assert pg.token_sizes == (4, 32) and pg.dropped == {16: 3.0}
    assert pg.bucket_for(5) == 32 and pg.bucket_for(16) == 32 and pg.bucket_for(4) == 4
    b = _batch(random.Random(3), [(0, 12, 12, [0, 1, 2])])
    eager_be, graph_be = TorchAttentionBackend(pool), TorchAttentionBackend(pool)
    eager_be.plan(b)
    want = model(b.input_ids, b.positions, eager_be)
    graph_be.plan(b)
    got = pg.run(b.input_ids, b.positions, graph_be)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {n for n, _ in log} == {32}  # 12 tokens replayed bucket 32, not the dropped 16


def test_graphs_that_write_the_kv_leave_the_pool_as_the_eager_forward_does() -> None:
    """With `kv_write` the graphs rotate q/k and write the kept k/v themselves (the fused
    kernel, interpreted on CPU) and attention runs alone between them: the hidden states and
    the pool must be the eager forward's. Rows not kept (a scoring suffix) and padding rows,
    including rows a larger earlier step filled, write nothing."""
    eng, _ = tiny_engine()
    model, pool = eng.model, eng.kv_pool
    write = load_rope_kv_write(True, pool.device, model.cfg.head_dim)
    assert write is not None  # the Triton interpreter (tests/conftest.py) runs it on CPU
    layers = range(model.num_layers)
    pg = PrefillGraphs(
        model,
        pool.device,
        pool.k[0].dtype,
        (16, 32),
        rotate_in_attention=True,
        kv_write=(write, [pool.flat_k(i) for i in layers], [pool.flat_v(i) for i in layers]),
    )
    eager_capture(pg)
    rng = random.Random(1)

    for specs in STEPS:
        b = _batch(rng, specs)
        before = [t.clone() for t in (*pool.k, *pool.v)]
        eager_be = TorchAttentionBackend(pool)
        eager_be.plan(b)
        want = model(b.input_ids, b.positions, eager_be).clone()
        want_pool = [t.clone() for t in (*pool.k, *pool.v)]
        for t, saved in zip((*pool.k, *pool.v), before, strict=True):
            t.copy_(saved)  # the graph path starts from the same pool
        graph_be = TorchAttentionBackend(pool)
        graph_be.plan(b)
        got = pg.run(b.input_ids, b.positions, graph_be)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for t, w in zip((*pool.k, *pool.v), want_pool, strict=True):
            torch.testing.assert_close(t, w, rtol=1e-5, atol=1e-5)  # RoPE rounding
    assert pg.slots[3:].eq(-1).all()  # the last step's padding rows were cleared


def _gen(rid: str, tokens: list[int], max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(rid, RequestKind.GENERATE, tokens, sp)


def _workload() -> list[Request]:
    rng = random.Random(1)
    profile = [rng.randrange(5, 4000) for _ in range(30)]
    reqs = [
        _gen("a", profile + [rng.randrange(5, 4000) for _ in range(7)], 12),
        _gen("b", profile[:17] + [rng.randrange(5, 4000) for _ in range(5)], 9),
        _gen("long", [rng.randrange(5, 4000) for _ in range(90)], 6),  # in budget-sized chunks
        _gen("c", [rng.randrange(5, 4000) for _ in range(3)], 10),
    ]
    for i in range(3):
        item = [rng.randrange(5, 4000) for _ in range(4 + i)]
        reqs.append(Request(f"s{i}", RequestKind.SCORE, profile + item, label_token_ids=[10, 20]))
    # Prompt logprobs (echo): read from the hidden states the graphs leave in a static buffer.
    sp = SamplingParams(
        max_tokens=3, ignore_eos=True, temperature=0.0, logprobs=2, prompt_logprobs=2
    )
    prompt = [rng.randrange(5, 4000) for _ in range(9)]
    reqs.append(Request("echo", RequestKind.GENERATE, prompt, sp))
    return reqs


def test_engine_with_prefill_graphs_gives_the_eager_engines_tokens_and_scores() -> None:
    results = []
    for graphs in (False, True):
        # Budget 24: prompts are chunked, so parts land in several buckets next to decodes.
        # Separate forwards: this compares prefill parts through the graphs with eager ones
        # (merged steps: tests/test_merged_steps.py).
        eng, sink = tiny_engine(prefill_token_budget=24, max_num_seqs=4, merge_mixed_steps=False)
        log: list[tuple[int, int]] = []
        if graphs:
            pg = PrefillGraphs(eng.model, eng.kv_pool.device, eng.kv_pool.k[0].dtype, (8, 16, 24))
            log = eager_capture(pg)
            eng.runner.prefill_graphs = pg
        eng.start()
        try:
            reqs = _workload()
            for r in reqs:
                eng.add(r)
            sink.wait(*(r.request_id for r in reqs))
        finally:
            eng.shutdown(0)
        gens = {
            r.request_id: sink.tokens(r.request_id) for r in reqs if r.kind is RequestKind.GENERATE
        }
        echo = sink.outs["echo"]
        gens["echo prompt logprobs"] = [
            None if t is None else (t.token_id, round(t.logprob, 4))
            for t in echo[0].prompt_logprobs
        ]
        gens["echo logprobs"] = [
            (t.token_id, round(t.logprob, 4)) for o in echo for t in o.new_logprobs
        ]
        assert len(gens["echo prompt logprobs"]) == 9 and len(gens["echo logprobs"]) == 3
        scores = {
            r.request_id: sink.last(r.request_id).label_probs
            for r in reqs
            if r.kind is RequestKind.SCORE
        }
        results.append((gens, scores))
        if graphs:
            assert {n for n, _ in log} >= {8, 24}, "the graphs served prefill parts"
    (g0, s0), (g1, s1) = results
    assert g1 == g0
    assert all(len(t) > 0 for t in g1.values())
    for rid, probs in s0.items():
        assert s1[rid] == pytest.approx(probs, rel=1e-4, abs=1e-6)


def test_reserved_bytes_grow_with_the_largest_bucket() -> None:
    eng, _ = tiny_engine()
    small = prefill_graph_bytes(eng.model, 256, torch.bfloat16)
    large = prefill_graph_bytes(eng.model, 2048, torch.bfloat16)
    assert prefill_graph_bytes(eng.model, 0, torch.bfloat16) == 0
    assert large == 8 * small > 0


def test_writing_the_kv_in_the_graphs_says_when_it_cannot(caplog: pytest.LogCaptureFixture) -> None:
    """`prefill_graphs_write_kv` needs the prefill graphs (CUDA): asked for on the CPU, the
    runner says it has no effect rather than ignoring it silently."""
    with caplog.at_level("WARNING", logger="greenlane.runner"):
        eng, _ = tiny_engine(prefill_graphs_write_kv="true")
    assert eng.runner.prefill_graphs is None
    assert "prefill_graphs_write_kv has no effect here" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="greenlane.runner"):
        tiny_engine()  # the default (auto): off where it cannot run, and nothing to say
    assert "prefill_graphs_write_kv" not in caplog.text
    with pytest.raises(ValueError, match="prefill_graphs_write_kv must be auto, true or false"):
        tiny_engine(prefill_graphs_write_kv="yes")
