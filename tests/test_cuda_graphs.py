"""CPU tests of decode graphs per stream (runtime/graphs/decode.py `DecodeGraphRegistry`, the
runner's per-stream selection and the split executor's lazy capture), with fake streams and a fake
graph set that replays eagerly with real padding (pad rows write only the pool's pad block).
The CUDA-graph kernels themselves are covered by tests/gpu/test_split_graphs.py."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch
from test_split_executor import gen, split_engine, split_step, torch_runner

from runtime.attention.base import ForwardBatch
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.executor.streams import HostEvent, HostStreamDevice
from runtime.graphs.decode import (
    SPLIT_BATCH_SIZES,
    DecodeGraphRegistry,
    bucket_for,
    graph_batch_sizes,
    pad_seqs,
)
from runtime.partition import SplitChoice, SplitDecision
from runtime.request import EngineOutput, Request
from runtime.runner import ModelRunner
from runtime.scheduler import StepCapacity, StepPlan


class FakeSet:
    """Stands in for `DecodeGraphs`: `capture` counts, `run` pads the batch to the captured
    size exactly as the graphs do (pad rows -> the pad block) and runs the model eagerly."""

    def __init__(
        self, stream: str, batch_sizes: tuple[int, ...], runner: Any = None, fail: bool = False
    ) -> None:
        self.stream = stream
        self.batch_sizes = batch_sizes
        self.capture_s: dict[int, float] = {}
        self.runner = runner
        self.fail = fail
        self.num_captures = 0
        self.replays: list[tuple[int, int]] = []  # (live rows, padded size)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def capture(self) -> None:
        self.num_captures += 1
        if self.fail:
            raise torch.cuda.OutOfMemoryError("fake: no memory for the graphs")

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.num_captures == 1, "replayed before (or after a second) capture"
        n = len(batch.seqs)
        bs = bucket_for(n, self.batch_sizes)
        self.replays.append((n, bs))
        r = self.runner
        pad = r.kv_pool.pad_block_id
        ids = torch.cat([batch.input_ids, torch.zeros(bs - n, dtype=torch.int64)])
        pos = torch.cat([batch.positions, torch.zeros(bs - n, dtype=torch.int64)])
        padded = ForwardBatch(ids, pos, pad_seqs(batch.seqs, bs, pad), torch.arange(bs), True)
        be = TorchAttentionBackend(r.kv_pool)
        be.plan(padded)
        return r.model(ids, pos, be)[:n]


def registry(
    sets: dict[str, FakeSet],
    whole: FakeSet | None,
    current: list[str],
    runner: Any = None,
    fail: tuple[str, ...] = (),
) -> DecodeGraphRegistry:
    def make(stream: str, label: str) -> FakeSet:
        s = FakeSet(stream, graph_batch_sizes(256, SPLIT_BATCH_SIZES), runner, fail=stream in fail)
        sets[stream] = s
        return s

    ticks = iter(range(1000))
    return DecodeGraphRegistry(
        make,
        whole,
        key=lambda s: s,
        current_stream=lambda: current[0],
        clock=lambda: float(next(ticks)),
    )


# ---- the registry ----------------------------------------------------------------------------
def test_unregistered_streams_use_the_whole_gpu_set() -> None:
    whole = FakeSet("w", (1, 2))
    made: dict[str, FakeSet] = {}
    reg = registry(made, whole, ["default"])
    assert reg.for_stream("default") is whole
    assert reg.for_stream("some other ordinary stream") is whole
    assert reg.for_stream("w") is whole
    assert not made  # nothing captured for ordinary streams


def test_split_stream_is_captured_once_on_first_use_on_that_stream() -> None:
    whole = FakeSet("w", (1, 2))
    made: dict[str, FakeSet] = {}
    reg = registry(made, whole, ["default"])
    reg.register("D96", "96/36")
    reg.register("D64", "64/68")
    assert not made  # lazy: registering captures nothing
    assert reg.is_split_stream("D96") and not reg.is_split_stream("default")
    got = reg.for_stream("D96")
    assert got is made["D96"] and got.num_captures == 1 and got.stream == "D96"
    assert "D64" not in made  # only the stream that decoded
    for _ in range(3):
        assert reg.for_stream("D96") is got
    reg.register("D96", "96/36")  # registering again keeps the captured set
    assert reg.for_stream("D96") is got and got.num_captures == 1
    assert reg.for_stream("D64") is made["D64"] is not got
    assert reg.for_stream("default") is whole
    summary = reg.summary()
    assert summary["96/36"]["captured"] and summary["96/36"]["capture_s"] == 1.0
    assert summary["whole GPU"]["captured"]


def test_capture_for_streams_is_eager_with_progress_and_skips_captured() -> None:
    made: dict[str, FakeSet] = {}
    reg = registry(made, None, ["x"])
    reg.register("D1", "8/124")
    reg.for_stream("D1")
    seen: list[tuple[int, int, str]] = []
    reg.capture_for_streams(
        {"8/124": "D1", "16/116": "D2", "24/108": "D3"},
        progress=lambda i, n, label, s: seen.append((i, n, label)),
    )
    assert seen == [(1, 3, "8/124"), (2, 3, "16/116"), (3, 3, "24/108")]
    assert {k: s.num_captures for k, s in made.items()} == {"D1": 1, "D2": 1, "D3": 1}
    assert reg.for_stream("D3") is made["D3"]
    assert reg.for_stream("elsewhere") is None  # no whole-GPU set: eager


def test_failed_capture_falls_back_to_eager_and_is_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    whole = FakeSet("w", (1,))
    made: dict[str, FakeSet] = {}
    reg = registry(made, whole, ["D"], fail=("D",))
    reg.register("D", "120/12")
    with caplog.at_level(logging.WARNING, logger="greenlane.cuda_graphs"):
        assert reg.for_stream("D") is None  # eager on that split, never the whole-GPU set
    assert "FALLBACK" in caplog.text and "120/12" in caplog.text
    assert reg.for_stream("D") is None and made["D"].num_captures == 1
    assert not reg.summary()["120/12"]["captured"]


def test_split_batch_sizes_are_bucketed_per_split() -> None:
    sizes = graph_batch_sizes(100, SPLIT_BATCH_SIZES)
    assert sizes == (1, 8, 16, 32, 64, 100)
    got = [bucket_for(n, sizes) for n in (1, 2, 9, 16, 33, 65, 100)]
    assert got == [1, 8, 16, 16, 64, 100, 100]


# ---- the runner and the PD loop --------------------------------------------------------------
class StreamDevice(HostStreamDevice):
    """Host stand-in whose `context(stream)` makes `stream` current (as torch.cuda.stream)."""

    def __init__(self) -> None:
        self.current = ["default"]
        self.waits: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def context(self, stream: Any):  # type: ignore[no-untyped-def]
        prev = self.current[0]
        self.current[0] = stream
        try:
            yield
        finally:
            self.current[0] = prev

    def event(self) -> Any:
        return HostEvent()

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.waits.append((stream, other))

    def current_stream(self) -> Any:
        return self.current[0]

    def allocator_counts(self) -> dict[str, int] | None:
        return None


def build(dev: StreamDevice | None, split_sms: int, max_num_seqs: int = 256):
    config = EngineConfig(
        model="random:tiny",
        prefill_policy="fcfs",
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=max_num_seqs,
    )
    eng = Engine(config, lambda o: None)  # not started: used for its model, pool, scheduler
    runner = torch_runner(eng)
    eng.runner = runner
    assert runner.graph_registry is None  # CPU: no graphs, eager decode as before
    current = dev.current if dev is not None else ["default"]
    made: dict[str, FakeSet] = {}
    whole = FakeSet("whole-graphs", graph_batch_sizes(max_num_seqs), runner)
    whole.num_captures = 1  # captured at start-up
    runner.graph_registry = registry(made, whole, current, runner)
    runner.decode_graphs = whole
    return eng, runner, made, whole


def reqs() -> list[Request]:
    return [gen(f"r{i}", n, m, seed=i) for i, (n, m) in enumerate([(37, 6), (9, 9), (21, 5)])]


CAP = StepCapacity(prefill_token_budget=8192)


def tokens(outs: list[EngineOutput]) -> dict[str, list[int]]:
    d: dict[str, list[int]] = {}
    for o in outs:
        d.setdefault(o.request_id, []).extend(o.new_token_ids)
    return d


def eager_tokens() -> dict[str, list[int]]:
    eng, runner, _, _ = build(None, 0)
    runner.graph_registry = None
    runner.decode_graphs = None
    for r in reqs():
        eng.scheduler.add(r)
    outs: list[EngineOutput] = []
    while eng.scheduler.has_work():
        plan = eng.scheduler.schedule(CAP)
        outs += eng.scheduler.update(plan, runner.run(plan))
    return tokens(outs)


def test_runner_picks_the_set_of_the_current_stream() -> None:
    ref = eager_tokens()
    eng, runner, made, whole = build(None, 0)
    runner.graph_registry.register("D", "64/68")  # type: ignore[union-attr]
    current = ["default"]
    runner.graph_registry.current_stream = lambda: current[0]  # type: ignore[union-attr]
    for r in reqs():
        eng.scheduler.add(r)
    outs: list[EngineOutput] = []
    step = 0
    while eng.scheduler.has_work():
        plan = eng.scheduler.schedule(CAP)
        current[0] = "D" if step % 2 else "default"  # alternate split and ordinary streams
        outs += eng.scheduler.update(plan, runner.run(plan))
        step += 1
    assert tokens(outs) == ref  # padded replays on either set decode the same tokens
    assert whole.replays and made["D"].replays  # both sets were used
    assert made["D"].num_captures == 1
    # per-split sizes: 3 live sequences replay the split's 8-row graph, the whole set's 4-row
    assert {bs for n, bs in made["D"].replays if n == 3} == {8}
    assert {bs for n, bs in whole.replays if n == 3} == {4}


def test_batch_beyond_the_largest_graph_decodes_eagerly() -> None:
    eng, runner, made, whole = build(None, 0, max_num_seqs=2)
    for r in reqs():
        eng.scheduler.add(r)
    plan = eng.scheduler.schedule(CAP)
    for _ in range(10):  # until two sequences decode together (max_num_seqs caps it at 2)
        eng.scheduler.update(plan, runner.run(plan))
        plan = eng.scheduler.schedule(CAP)
        if len(plan.decode) == 2:
            break
    assert len(plan.decode) == 2
    whole.replays.clear()
    runner.run(StepPlan(plan.step_id, [], plan.decode))
    assert whole.replays == [(2, 2)]
    whole.batch_sizes = (1,)  # a set without a graph for 2 rows: eager, no replay
    runner.run(StepPlan(plan.step_id, [], plan.decode))
    assert whole.replays == [(2, 2)]


def test_split_executor_decodes_on_the_splits_own_graphs_captured_once() -> None:
    ref = eager_tokens()
    dev = StreamDevice()
    _, runner, made, whole = build(dev, 64)
    splits: list[int] = []

    def choose(p: Any, d: Any) -> SplitChoice:
        # Prefill batches split 64/68; decode alone alternates whole-GPU and 96/36 split.
        if p is not None:
            return SplitChoice(SplitDecision(64), "P64", "D64", 68)
        splits.append(len(splits) % 2)
        return (
            SplitChoice(SplitDecision(96), "P96", "D96", 36)
            if splits[-1]
            else SplitChoice(SplitDecision(0), "whole", "whole", 132)
        )

    eng, ex, _ = split_engine(dev, choose, runner=runner, max_num_seqs=256)
    rs = reqs()
    eng.scheduler.add(rs[0])
    outs: list[EngineOutput] = []
    for i in range(300):
        if i == 2:
            eng.scheduler.add(rs[1])
        if i == 4:
            eng.scheduler.add(rs[2])
        outs += split_step(eng)
        if not eng.scheduler.has_work() and not ex.busy and i > 4:
            break
    assert tokens(outs) == ref
    assert ex.num_overlapped_decode_steps >= 1
    # decode on each split replayed graphs captured on that split's stream, captured once
    assert set(made) <= {"D64", "D96"} and "D96" in made
    assert all(s.num_captures == 1 and s.replays for s in made.values())
    assert whole.replays  # the whole-GPU stream used the whole-GPU set
    # prefill streams never get decode graphs
    assert not any(k.startswith("P") for k in made)
    assert runner.graph_registry.summary()["96/36"]["captured"]  # type: ignore[union-attr]


# ---- the device benchmark's graphs_split section, dry run ------------------------------------
def test_bench_graphs_split_section_runs_on_host_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/gpu_partition.py `split_graphs_check` end to end with torch.cuda stand-ins and
    fake graph sets: catches Python errors before device time (not a kernel check)."""
    import itertools
    import time as _time
    from types import SimpleNamespace

    import bench.gpu_partition as gp

    handles = itertools.count(1)

    class Stream:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.cuda_stream = next(handles)

        def synchronize(self) -> None:
            return None

    cur = [Stream()]

    @contextlib.contextmanager
    def stream_ctx(s: Any):  # type: ignore[no-untyped-def]
        prev, cur[0] = cur[0], s
        try:
            yield
        finally:
            cur[0] = prev

    class Event:
        def __init__(self, **k: Any) -> None:
            self.t_s = 0.0

        def record(self, *a: Any) -> None:
            self.t_s = _time.perf_counter()

        def synchronize(self) -> None:
            return None

        def elapsed_time(self, other: Event) -> float:
            return (other.t_s - self.t_s) * 1e3

    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    config = EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=300, max_num_seqs=16)
    eng = Engine(config, lambda o: None)
    pool = eng.kv_pool
    runner = ModelRunner(
        config,
        eng.model,
        eng.model_config,
        pool,
        TorchAttentionBackend(pool),
        TorchAttentionBackend(pool),
    )
    whole = FakeSet(Stream(), graph_batch_sizes(16), runner)  # type: ignore[arg-type]
    whole.num_captures = 1
    made: list[FakeSet] = []

    def make(stream: Any, label: str) -> FakeSet:
        made.append(FakeSet(stream, graph_batch_sizes(16, SPLIT_BATCH_SIZES), runner))
        return made[-1]

    runner.graph_registry = DecodeGraphRegistry(make, whole, current_stream=lambda: cur[0])
    runner.decode_graphs = whole  # type: ignore[assignment]
    eng.runner = runner
    pairs = {n: SimpleNamespace(decode=SimpleNamespace(stream=Stream())) for n in (64, 96)}
    eng._green = SimpleNamespace(
        layout=SimpleNamespace(total_sms=132), pairs=pairs, splits=list(pairs)
    )
    res = gp.split_graphs_check(eng, batches=(3, 9), ctx_tokens=20, iters=1)
    assert res["ok"], [c for c in res["checks"] if not c["ok"]]
    assert [r["split"] for r in res["rows"]] == ["whole GPU"] * 2 + ["64/68"] * 2 + ["96/36"] * 2
    assert len(made) == 2 and all(s.replays for s in made)
    assert "| 96/36 | 9 |" in gp.graphs_split_table(res)


# ---- decode attention's KV split in the graphs ------------------------------------------------


def test_one_chunk_rule_follows_flashinfers_tile_budget() -> None:
    """One chunk a request from FlashInfer's split budget on ((2 * SMs) // KV heads tiles: its
    split gives every request one chunk there, and the merge only copies), never below it;
    tensor-core decode (GQA >= 4) only."""
    from runtime.attention.flashinfer_backend import (
        one_chunk_decode_supported,
        one_chunk_min_rows,
        prefer_one_chunk,
    )

    assert one_chunk_min_rows(8, 132) == 33  # Llama-3.1-8B shape on the H200
    assert one_chunk_min_rows(2, 132) == 132  # Qwen2.5-3B shape
    assert one_chunk_min_rows(64, 16) == 1
    assert [prefer_one_chunk(b, 33) for b in (1, 16, 32, 33, 64)] == [False] * 3 + [True] * 2
    assert one_chunk_decode_supported(32, 8) and one_chunk_decode_supported(16, 2)
    assert not one_chunk_decode_supported(9, 3)  # SmolLM2-135M: CUDA-core decode


def test_decode_graphs_choose_one_chunk_per_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kv_split`: always -> never one chunk; never -> one chunk wherever tensor-core decode
    runs; auto -> from the tile budget on; a model on CUDA-core decode never; a typo is
    rejected. (The graphs themselves: tests/gpu/test_decode_kv_split_gpu.py.)"""
    from types import SimpleNamespace

    from runtime.graphs.decode import DecodeGraphs

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    caches = [torch.zeros(4, 16, 8, 4)]

    def graphs(q: int, kv: int, mode: str) -> DecodeGraphs:
        model = SimpleNamespace(cfg=SimpleNamespace(num_q_heads=q, num_kv_heads=kv))
        return DecodeGraphs(
            model, caches, caches, None, pad_block_id=3, max_blocks_per_seq=4,
            workspace=torch.empty(0), kv_split=mode,
        )  # fmt: skip

    sizes = (1, 16, 32, 33, 64, 256)
    assert [graphs(32, 8, "auto")._one_chunk(b) for b in sizes] == [False] * 3 + [True] * 3
    assert not any(graphs(32, 8, "always")._one_chunk(b) for b in sizes)
    assert all(graphs(32, 8, "never")._one_chunk(b) for b in sizes)
    assert not any(graphs(9, 3, mode)._one_chunk(256) for mode in ("auto", "never"))
    with pytest.raises(ValueError, match="kv_split"):
        graphs(32, 8, "off")
    with pytest.raises(ValueError, match="decode_kv_split"):
        EngineConfig(decode_kv_split="off")
