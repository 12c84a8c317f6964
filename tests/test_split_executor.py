"""CPU tests of the split executor (runtime/executor/split.py) with fake streams and events, driven
by the engine's own step loop: a request moves to decode only after its prefill completes,
decode keeps running meanwhile, no token is lost or duplicated (same greedy tokens as the serial
executor), an abort during an in-flight prefill frees its KV only once the device is done
and launches none of its remaining slices,
time-slicing runs as one step, the JCT model learns from whole-GPU prefills only."""

from __future__ import annotations

import contextlib
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.executor.base import StepFailed, StepInterrupted
from runtime.executor.split import SplitExecutor
from runtime.partition import SplitChoice, SplitDecision
from runtime.partition.cost_model import ControllerConfig
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams
from runtime.runner import ModelRunner


class FakeEvent:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.recorded = False
        self.done = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.done = not self.dev.hold
        if not self.done:
            self.dev.pending.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if self.dev.auto_complete_on_sync:
            self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0


class FakeDevice:
    """Streams are labels; events stay pending while `hold` until `release()`."""

    def __init__(self) -> None:
        self.hold = False
        self.auto_complete_on_sync = False
        self.pending: list[FakeEvent] = []
        self.waits: list[tuple[Any, Any]] = []

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.waits.append((stream, other))

    def current_stream(self) -> Any:
        return "default"

    def allocator_counts(self) -> dict[str, int] | None:
        return None

    def release(self) -> None:
        for e in self.pending:
            e.done = True
        self.pending.clear()


def torch_runner(eng: Engine) -> ModelRunner:
    """A runner over `eng`'s model and pool with separate torch backends for prefill and
    decode, as split mode has (the CPU stand-in of the two FlashInfer instances)."""
    pool = eng.kv_pool
    return ModelRunner(
        eng.config,
        eng.model,
        eng.model_config,
        pool,
        TorchAttentionBackend(pool),
        TorchAttentionBackend(pool),
        num_token_slots=eng.scheduler.slots.num_slots,
    )


class RecordingPartition:
    """What the engine uses of GreenContextPartition in split mode: the mode, the disabled
    splits and `disable_split`, the cost model's error (for stats) and decode prediction (none:
    uncalibrated), the whole-GPU decode steps it is taught in off (kept in `whole_decodes`),
    the controller's config (no TBT target: auto plans every step whole and `choose` decides
    at launch)."""

    def __init__(self) -> None:
        self.mode = "auto"
        self.disabled: dict[int, str] = {}
        self.controller = SimpleNamespace(config=ControllerConfig())
        self.whole_decodes: list[tuple[object, float]] = []

    def observe_whole_decode(self, decode: object, measured_ms: float) -> None:
        self.whole_decodes.append((decode, measured_ms))

    def disable_split(self, prefill_sms: int, reason: str) -> None:
        self.disabled[prefill_sms] = reason

    def cost_model_mape(self) -> float | None:
        return None

    def cost_model_errors(self) -> dict[str, float]:
        return {}

    def predict_decode_ms(self, decode: object) -> float | None:
        return None


def split_engine(
    device: Any,
    choose: Any,
    *,
    observe: Any = None,
    score: Any = None,
    runner: ModelRunner | None = None,
    **cfg: Any,
) -> tuple[Engine, SplitExecutor, RecordingPartition]:
    """An engine (not started: the test drives its steps) whose executor is a split executor
    over `device` with `choose(prefill_plan, decode_plan) -> SplitChoice`."""
    config = EngineConfig(
        **{
            "model": "random:tiny",
            "prefill_policy": "fcfs",
            "block_size": 4,
            "num_kv_blocks": 128,
            "pd_slice_tokens": 1,
            "pd_max_queued_slices": 1,
            **cfg,
        }
    )
    eng = Engine(config, lambda outs: None)
    green = RecordingPartition()
    # The pacer (auto's capacity, the split choice, the TBT cut) reads both too.
    eng.runner = eng.pacer.runner = runner or torch_runner(eng)
    eng._green = eng.pacer.green = green
    ex = SplitExecutor(
        config,
        eng.runner,
        device,
        choose,
        observe,
        split_usable=lambda sms: sms not in green.disabled,
        score=score,
    )
    eng.split = ex
    eng.stream_device = device
    return eng, ex, green


def split_step(eng: Engine) -> list[EngineOutput]:
    """One iteration of the engine's loop that never blocks on the device (the fake device's
    events complete only when the test releases them)."""
    ex = eng.split
    assert ex is not None
    eng.executor = ex
    sched = eng.scheduler
    outs = sched.take_pending_outputs()
    plan = sched.schedule(ex.capacity())
    outs += sched.take_pending_outputs()
    if not plan.is_empty:
        ex.launch(plan)
    for r in ex.results(block=False):
        outs += eng._apply(r)
    return outs


def finish(eng: Engine, dev: Any) -> list[EngineOutput]:
    """Release every event and run to the end."""
    dev.hold = False
    outs: list[EngineOutput] = []
    for _ in range(1000):
        dev.release()
        if not eng.scheduler.has_work() and not eng.split.busy:
            break
        outs += split_step(eng)
    assert not eng.scheduler.has_work() and not eng.split.busy
    return outs


def launch_order(ex: SplitExecutor, method: str, label: Any) -> list[str]:
    """What the executor launches, in order: the model's `method` as `label(args)` (None:
    not recorded) and the runner's decode steps as "decode"."""
    order: list[str] = []
    forward, launch = getattr(ex.model, method), ex.runner.launch

    def spy_forward(*a: Any, **k: Any) -> Any:
        name = label(a)
        if name is not None:
            order.append(name)
        return forward(*a, **k)

    def spy_launch(plan: Any) -> Any:
        order.append("decode")
        return launch(plan)

    setattr(ex.model, method, spy_forward)
    ex.runner.launch = spy_launch  # type: ignore[method-assign]
    return order


def fixed_split(
    prefill_sms: int = 64,
    layers_per_slice: int | None = None,
    predicted_prefill_ms: float = 5.0,
    slice_ends: tuple[int, ...] | None = None,
    predicted_decode_ms: float = math.nan,
) -> Any:
    choices: list[tuple[bool, bool]] = []

    def choose(p, d) -> SplitChoice:
        choices.append((p is not None, d is not None))
        if p is not None and layers_per_slice:  # time-slicing by layers
            dec = SplitDecision(
                0,
                layers_per_slice=layers_per_slice,
                predicted_prefill_ms=predicted_prefill_ms,
                slice_ends=slice_ends,
                predicted_decode_ms=predicted_decode_ms,
            )
            return SplitChoice(dec, "whole", "whole", 132)
        if p is None or prefill_sms == 0:
            return SplitChoice(SplitDecision(0), "whole", "whole", 132)
        dec = SplitDecision(prefill_sms, predicted_prefill_ms=predicted_prefill_ms)
        return SplitChoice(dec, "P", "D", 132 - prefill_sms)

    choose.choices = choices  # type: ignore[attr-defined]
    return choose


def gen(rid: str, n_prompt: int, max_tokens: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(
        rid,
        RequestKind.GENERATE,
        [rng.randrange(100, 4000) for _ in range(n_prompt)],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def tokens_by_id(outs: list[EngineOutput]) -> dict[str, list[int]]:
    d: dict[str, list[int]] = {}
    for o in outs:
        d.setdefault(o.request_id, []).extend(o.new_token_ids)
    return d


def serial_tokens(reqs: list[Request]) -> dict[str, list[int]]:
    """The same requests through the serial executor (the engine's own loop)."""
    eng = Engine(
        EngineConfig(model="random:tiny", prefill_policy="fcfs", block_size=4, num_kv_blocks=128),
        lambda outs: None,
    )
    for r in reqs:
        eng.scheduler.add(r)
    outs: list[EngineOutput] = []
    while eng.scheduler.has_work() or eng.executor.num_in_flight:
        outs += eng._step()
    return tokens_by_id(outs)


def make_reqs() -> list[Request]:
    return [gen(f"r{i}", n, m, seed=i) for i, (n, m) in enumerate([(37, 6), (9, 9), (60, 4)])]


@pytest.mark.parametrize("prefill_sms", [64, 0])
def test_same_tokens_as_serial_no_loss_no_duplicates(prefill_sms: int) -> None:
    ref = serial_tokens(make_reqs())
    dev = FakeDevice()
    observed: list[tuple] = []
    eng, ex, _ = split_engine(dev, fixed_split(prefill_sms), observe=lambda *a: observed.append(a))
    rng = random.Random(1)
    reqs = make_reqs()
    outs: list[EngineOutput] = []
    eng.scheduler.add(reqs[0])
    for i in range(400):
        if i == 2:
            eng.scheduler.add(reqs[1])
        if i == 5:
            eng.scheduler.add(reqs[2])
        dev.hold = rng.random() < 0.6  # events complete late, at random
        outs += split_step(eng)
        if rng.random() < 0.5:
            dev.release()
        if not eng.scheduler.has_work() and not ex.busy and i > 5:
            break
    outs += finish(eng, dev)
    got = tokens_by_id(outs)
    assert got == ref  # every token once, in order, identical to the serial executor
    assert all(sum(o.finished for o in outs if o.request_id == r) == 1 for r in ref)
    assert eng.block_manager.num_used_blocks == 0  # every block freed (or cached-idle)
    eng.block_manager.check_integrity()
    if prefill_sms:
        assert ex.num_split_prefills >= 1
        assert any(o[0] == "prefill" and o[2] == prefill_sms for o in observed)
        # The JCT model (whole-GPU prefill) does not learn from prefills on a split's
        # partition (they ran slower than the whole GPU would).
        assert eng.jct_model.num_observed == 0
        # The step trace says which partition each step ran on (the cost model's replay
        # reads it): the split prefill on its SMs, whole-GPU steps on 0.
        trace = eng.step_trace()
        assert any(st["on_split"] and st["sms"] == prefill_sms for st in trace)
        assert all(st["sms"] == 0 and st["other_sms"] == 0 for st in trace if not st["on_split"])
        assert all(st["other_sms"] in (0, 132 - st["sms"]) for st in trace if st["on_split"])
        # A prefill on the split carries the prediction the choice weighed; nothing else does.
        split_prefills = [st for st in trace if st["on_split"] and st["num_prefill_tokens"]]
        assert split_prefills and all(st["split_predicted_ms"] == 5.0 for st in split_prefills)
        assert all(st["split_predicted_ms"] is None for st in trace if st not in split_prefills)
    else:
        assert ex.num_split_prefills == 0
        # Time-sliced prefill-only steps on the whole GPU teach it (device time, events).
        assert eng.jct_model.num_observed >= 1


def test_time_slicing_by_layers_interleaves_decode_steps_on_one_stream() -> None:
    """Layer-sliced time-slicing: the prefill is in flight one layer-slice at a time on the
    whole GPU's stream, a decode step runs between slices on that same stream, tokens are
    those of the serial executor, and no prefill latency is fed to the cost model: the
    prefill's span (its slices and the decode steps between them) is scored against the
    completion the controller predicted for the choice, per kind."""
    ref = serial_tokens(make_reqs())
    dev = FakeDevice()
    observed: list[tuple] = []
    scored: list[tuple] = []
    eng, ex, _ = split_engine(
        dev,
        fixed_split(layers_per_slice=1, predicted_prefill_ms=7.5),
        observe=lambda *a: observed.append(a),
        score=lambda *a: scored.append(a),
    )  # tiny has 2 layers: 2 slices
    # (h, residual, positions, backend, start, end, ...)
    order = launch_order(
        ex,
        "forward_layers",
        lambda a: f"slice{a[4]}" if a[3] is ex.runner.prefill_backend else None,
    )
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    outs = split_step(eng)  # r0's prefill alone: 2 slices
    outs += split_step(eng)  # its first token
    eng.scheduler.add(reqs[1])
    eng.scheduler.add(reqs[2])
    dev.hold = True  # slice events stay pending: the loop must alternate slice / decode
    for _ in range(3):
        outs += split_step(eng)
    assert ex.busy and ex.num_layer_sliced_prefills == 2 and ex.num_split_prefills == 0
    # One slice queued ahead at most; r0 decodes between the new batch's slices.
    assert order[:2] == ["slice0", "slice1"]
    i = order.index("slice0", 2)
    assert order[i + 1 : i + 3] == ["decode", "decode"]
    outs += finish(eng, dev)
    assert tokens_by_id(outs) == ref
    # Only the whole GPU's stream is used (it waited once on the loop's starting stream).
    assert {s for s, _ in dev.waits} == {"whole"} and {o for _, o in dev.waits} == {"default"}
    assert not [o for o in observed if o[0] == "prefill"]
    assert [o for o in observed if o[0] == "decode"]
    assert len(scored) == 2  # both prefills, against the decision's 7.5 ms
    assert {(k, p) for k, p, _ in scored} == {("prefill/layer_sliced", 7.5)}
    assert all(m > 0 for _, _, m in scored)
    # The step trace shows each layer-sliced prefill's span and its prediction (no device time:
    # the span holds the decode steps between its slices); other steps have neither.
    trace = eng.step_trace()
    sliced = [st for st in trace if st["layer_sliced_span_ms"] is not None]
    assert len(sliced) == 2
    assert all(st["device_ms"] is None and st["num_prefill_tokens"] > 0 for st in sliced)
    assert [st["layer_sliced_predicted_ms"] for st in sliced] == [7.5, 7.5]
    assert [st["layer_sliced_span_ms"] for st in sliced] == [m for _, _, m in scored]
    rest = [st for st in trace if st["layer_sliced_span_ms"] is None]
    assert rest and all(st["layer_sliced_predicted_ms"] is None for st in rest)
    eng.block_manager.check_integrity()


def test_a_decode_step_follows_the_last_layer_slice_before_new_prefill() -> None:
    """Layer slices promise a decode waits at most one slice. A decode step launched after the
    last slice keeps that; if the prefill finishes before one is (the host planned none), the
    next step is decode-only, once (with no decodes to plan the step after takes prefill)."""
    ref = serial_tokens(make_reqs())
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, fixed_split(layers_per_slice=1))  # tiny: 2 layers, 2 slices
    budget = ex.prefill_token_budget
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    outs = split_step(eng) + split_step(eng)  # r0 prefilled alone, then decoding
    eng.scheduler.add(reqs[1])
    dev.hold = True
    outs += split_step(eng)  # r1's first slice, r0's decode before it
    dev.release()
    outs += split_step(eng)  # r0 decodes; then the last slice is queued
    assert ex.prefill is not None and ex.prefill.done_event is not None
    dev.release()
    outs += [o for r in ex.results(block=False) for o in eng._apply(r)]  # r1 done, no decode
    assert ex.prefill is None
    assert ex.capacity().prefill_token_budget == 0  # owed: a decode-only step
    assert ex.capacity().prefill_token_budget == budget  # once
    # A decode step launched after the last slice settles it: no extra step.
    eng.scheduler.add(reqs[2])
    outs += split_step(eng)  # r2's first slice
    dev.release()
    outs += split_step(eng)  # decodes; the last slice queued
    assert ex.prefill is not None and ex.prefill.done_event is not None
    outs += split_step(eng)  # capacity 0 (in flight): a decode step behind the last slice
    dev.release()
    outs += [o for r in ex.results(block=False) for o in eng._apply(r)]
    assert ex.prefill is None and ex.capacity().prefill_token_budget == budget
    outs += finish(eng, dev)
    assert tokens_by_id(outs) == ref
    eng.block_manager.check_integrity()


def test_request_moves_to_decode_only_after_prefill_completes() -> None:
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, fixed_split())
    sched = eng.scheduler
    a = gen("a", 12, 20, seed=1)
    sched.add(a)
    outs = split_step(eng)  # a's prefill completes at once (hold off)
    assert [o.request_id for o in outs] == ["a"] and outs[0].new_token_ids
    b = gen("b", 40, 4, seed=2)
    sched.add(b)
    dev.hold = True
    n_a_before = a.num_output_tokens
    out1 = split_step(eng)  # b's prefill launched (slice 1 pending); a decodes on "D"
    assert ex.busy and sched.is_held("b")
    assert {o.request_id for o in out1} == {"a"}
    for _ in range(3):  # b's events still pending: a keeps decoding, b gets nothing
        outs = split_step(eng)
        assert {o.request_id for o in outs} == {"a"}
        assert b.num_output_tokens == 0 and b.num_output_placeholders == 1
    assert a.num_output_tokens == n_a_before + 4
    # Decode ran on the pair's decode stream while b was in flight; never made to wait on "P".
    assert ("D", "P") not in dev.waits and ("P", "D") not in dev.waits
    while ex.prefill is not None or sched.is_held("b"):
        dev.release()
        split_step(eng)
    assert b.num_output_tokens == 1
    outs = split_step(eng)
    assert "b" in {o.request_id for o in outs}  # now decoding
    assert b.num_output_tokens == 2


def test_abort_during_inflight_prefill_frees_kv_after_completion() -> None:
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, fixed_split(), enable_prefix_cache=False)
    sched, bm = eng.scheduler, eng.block_manager
    free0 = bm.num_free_blocks
    dev.hold = True
    sched.add(gen("x", 50, 4))
    split_step(eng)
    assert ex.busy and sched.is_held("x")
    held = free0 - bm.num_free_blocks
    assert held == bm.num_blocks_for(50)
    out = sched.abort("x")
    assert out is not None and out.finished
    assert bm.num_free_blocks == free0 - held  # the device may still write them: kept
    outs = finish(eng, dev)
    assert not outs  # nothing more for an aborted request
    assert bm.num_free_blocks == free0
    assert not sched.has_work()


def test_a_prefill_in_flight_whose_requests_are_all_aborted_launches_no_more_slices() -> None:
    """A client gone mid-prefill: the slices already queued run out, no further one is
    launched, the plan comes back with no output, its KV is freed then, and nothing of it
    teaches the cost model; the next request gets the serial executor's tokens."""
    dev = FakeDevice()
    observed: list[tuple] = []
    eng, ex, _ = split_engine(
        dev, fixed_split(), observe=lambda *a: observed.append(a), enable_prefix_cache=False
    )  # pd_slice_tokens=1: one layer a slice, one slice queued (tiny has 2 layers)
    sched, bm = eng.scheduler, eng.block_manager
    free0 = bm.num_free_blocks
    slices: list[int] = []
    forward_layers = ex.model.forward_layers

    def spy_layers(*a: Any, **k: Any) -> Any:
        if a[3] is ex.runner.prefill_backend:
            slices.append(a[4])
        return forward_layers(*a, **k)

    ex.model.forward_layers = spy_layers  # type: ignore[method-assign]
    dev.hold = True
    sched.add(gen("x", 50, 4))
    split_step(eng)
    assert ex.busy and slices == [0]  # the second slice waits for the first
    eng._handle("abort", ["x"])  # as the engine applies an abort from its inbox
    outs = finish(eng, dev)
    assert slices == [0] and ex.num_abandoned_prefills == 1
    assert not outs and bm.num_free_blocks == free0 and not sched.has_work()
    assert not [o for o in observed if o[0] == "prefill"]
    eng._publish_stats()  # (the engine is not started: rebuild the snapshot by hand)
    assert eng.stats()["num_interrupted_steps"] == 1
    # The pool and the executor serve the next request as if nothing had happened.
    ref = serial_tokens([gen("y", 37, 5, seed=3)])
    sched.add(gen("y", 37, 5, seed=3))
    assert tokens_by_id(finish(eng, dev)) == ref


def test_a_time_sliced_whole_step_of_aborted_requests_stops_between_layers() -> None:
    """Time-slicing runs the plan as one step on the whole GPU, as the serial executor does:
    it stops before its next layer when its requests are all being aborted."""
    eng, ex, _ = split_engine(FakeDevice(), fixed_split(prefill_sms=0), enable_prefix_cache=False)
    eng.runner.interrupt = eng._should_interrupt  # (split_engine swapped the runner in)
    sched, bm = eng.scheduler, eng.block_manager
    free0 = bm.num_free_blocks
    sched.add(gen("x", 50, 4))
    plan = sched.schedule(ex.capacity())
    eng._aborting.add("x")  # its abort is in the inbox
    with pytest.raises(StepInterrupted) as info:
        ex.launch(plan)
    assert info.value.layer == 0 and info.value.plan is plan and not ex.busy
    outs = eng._interrupted(info.value)
    assert [o.finish_reason for o in outs] == ["abort"]
    assert bm.num_free_blocks == free0 and not sched.has_work()


def test_preemption_never_picks_an_inflight_request() -> None:
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, fixed_split(), enable_prefix_cache=False)
    sched, bm = eng.scheduler, eng.block_manager
    a = gen("a", 8, 200)
    sched.add(a)
    split_step(eng)
    dev.hold = True
    big = gen("big", 4 * (bm.num_free_blocks - 1), 1)
    sched.add(big)
    for _ in range(12):  # a decodes until it needs a block that only preemption could give
        split_step(eng)
    assert sched.is_held("big") and big.status.name == "RUNNING"
    assert a.num_preemptions >= 1  # it preempted itself, not the in-flight prefill
    finish(eng, dev)


def test_decode_leaves_a_split_taken_out_of_service_mid_prefill() -> None:
    """Seen on the H200: a split whose decode partition failed was disabled, but decode steps
    beside the prefill already in flight on it kept going to its decode stream (and failing)
    until that prefill finished. They must move to the whole GPU at once."""
    dev = FakeDevice()
    eng, ex, green = split_engine(dev, fixed_split())
    sched = eng.scheduler
    sched.add(gen("a", 12, 20, seed=1))
    split_step(eng)  # a prefilled
    split_step(eng)  # a's first token; it decodes from now on
    sched.add(gen("b", 40, 4, seed=2))
    dev.hold = True
    split_step(eng)  # b in flight on split 64; a decodes on its pair's stream "D"
    assert ex.busy and ex.last_split == 64
    green.disabled[64] = "failed"
    split_step(eng)  # b still in flight: a's decode must not use "D" any more
    assert ex.busy and ex.last_split == 0
    assert ("whole", "D") in dev.waits  # the whole-GPU stream waits for D's queued work


def test_a_time_sliced_step_is_never_blamed_on_the_previous_split() -> None:
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, fixed_split(64))
    eng.scheduler.add(gen("a", 12, 3, seed=1))
    split_step(eng)  # prefilled on split 64
    assert ex.last_split == 64
    ex.choose = lambda p, d: SplitChoice(SplitDecision(0), "whole", "whole", 132)  # now: time-slice
    eng.scheduler.add(gen("b", 20, 3, seed=2))
    ex.runner.launch = lambda plan: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(StepFailed) as info:
        split_step(eng)
    assert info.value.prefill_sms == 0


class ClockEvent(FakeEvent):
    """A fake event stamped with its device's clock (one tick per recorded event)."""

    def record(self, stream: Any = None) -> None:
        self.dev.clock += 1
        self.t = self.dev.clock
        super().record(stream)

    def elapsed_time(self, end: FakeEvent) -> float:
        return float(end.t - self.t)  # ms: one tick a ms


class ClockDevice(FakeDevice):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0

    def event(self) -> FakeEvent:
        return ClockEvent(self)


def test_decode_gap_is_what_continuing_decodes_waited_between_their_steps() -> None:
    """The step trace's `decode_gap_ms` (split executor): for a step whose decodes continue the
    previous decode-carrying step's, the device time from that step's end to this one's start.
    A layer slice between them widens it; a step whose requests all just started, and the
    first after a drain, have none."""
    dev = ClockDevice()
    eng, ex, _ = split_engine(dev, fixed_split(layers_per_slice=1))  # tiny: 2 layers, 2 slices
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    split_step(eng)  # r0's prefill (2 slices): no decodes
    split_step(eng)  # r0's first decode step: nothing before it to continue
    split_step(eng)  # r0 again: continues
    eng.scheduler.add(reqs[1])
    for _ in range(4):  # r1's slices interleave with r0's decodes
        split_step(eng)
    ex.drain()
    eng.scheduler.add(reqs[2])
    finish(eng, dev)
    trace = eng.step_trace()
    decodes = [st for st in trace if st["num_decodes"]]
    gaps = [st["decode_gap_ms"] for st in decodes]
    assert gaps[0] is None  # r0's first decode step
    assert all(g is None for st in trace if not st["num_decodes"] for g in [st["decode_gap_ms"]])
    seen = [g for g in gaps if g is not None]
    assert seen and all(g >= 1.0 for g in seen)
    # Back to back, a decode step's start follows the previous one's end by one tick; with a
    # slice between them, by more.
    assert min(seen) == 1.0 and max(seen) > 1.0
    assert sum(g is None for g in gaps) >= 2  # the first, and the first after the drain


def test_decodes_behind_layer_slices_carry_the_wait_promised_them() -> None:
    """A decode step launched while a layer-sliced prefill is in flight, and the one owed after
    its last slice, carry the wait the controller promised (`SplitDecision.
    predicted_decode_ms`: the heaviest slice and the step) beside their device gap, which the
    engine's slice tail reads; other decode steps carry none."""
    dev = ClockDevice()
    eng, ex, _ = split_engine(dev, fixed_split(layers_per_slice=1, predicted_decode_ms=7.5))
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    split_step(eng)  # r0's prefill (2 slices): no decodes
    split_step(eng)
    split_step(eng)  # r0 decodes: no slice in flight
    eng.scheduler.add(reqs[1])
    for _ in range(4):  # r1's slices interleave with r0's decodes
        split_step(eng)
    finish(eng, dev)
    decodes = [st for st in eng.step_trace() if st["num_decodes"]]
    promised = [st["slice_promised_ms"] for st in decodes]
    # r0's first decode (owed after its last slice), r0's next (none in flight), the decode
    # between r1's two slices and the one owed after them; none after that.
    assert promised[:4] == [7.5, None, 7.5, 7.5]
    assert all(p is None for p in promised[4:])
    # Behind r1's slices the gap is a slice wide (more than back to back: 1 ms a tick here).
    assert [st["decode_gap_ms"] for st in decodes[2:4]] == [2.0, 3.0]


def _start_beside_decodes(eng: Engine, ex: SplitExecutor, reqs: list[Request]) -> None:
    """Run the engine's own loop (its step trace) over r1, then r2 added while r1 decodes:
    r2's prefill starts beside r1's decodes."""
    eng.scheduler.add(reqs[1])
    for i in range(200):
        if i == 4:
            eng.scheduler.add(reqs[2])
        if i > 4 and not eng.scheduler.has_work() and not ex.busy:
            break
        eng._step()


def test_the_launch_that_starts_a_sliced_prefill_is_timed_by_part_in_the_step_trace() -> None:
    """The launch that starts a layer-sliced prefill records its host time by part (the
    decision, the batch's build, plan and embedding, the decode step beside it, the first
    slice) in the step trace, on the launch's first result; other launches record none. A
    long start is time the device may idle before the first slice (a 98-ms one on the H200
    came before a 136-ms wait behind a slice promised 72)."""
    dev = ClockDevice()
    eng, ex, _ = split_engine(dev, fixed_split(layers_per_slice=1, predicted_decode_ms=7.5))
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    split_step(eng)  # r0's prefill starts: no decodes beside it
    assert ex.launch_parts_ms is not None
    assert set(ex.launch_parts_ms) == {"choose", "build", "plan_embed", "decode", "first_slice"}
    split_step(eng)
    assert ex.launch_parts_ms is None  # no start in that launch
    finish(eng, dev)
    # The engine's own loop puts them in the trace: r2's prefill starts beside r1's decodes.
    _start_beside_decodes(eng, ex, reqs)
    timed = [st for st in eng.step_trace() if st["launch_parts_ms"] is not None]
    assert timed and any(st["num_decodes"] for st in timed)
    for st in timed:
        parts = st["launch_parts_ms"]
        assert set(parts) == {"choose", "build", "plan_embed", "decode", "first_slice"}
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) <= st["launch_ms"] + 1e-6


class CountingDevice(ClockDevice):
    """Allocator counts that grow by one malloc an event and one free a count read: the
    executor must report, per part of a start's launch, the growth inside that part."""

    def __init__(self) -> None:
        super().__init__()
        self.mallocs = 0
        self.frees = 0

    def event(self) -> FakeEvent:
        self.mallocs += 1
        return super().event()

    def allocator_counts(self) -> dict[str, int] | None:
        self.frees += 1
        return {"mallocs": self.mallocs, "frees": self.frees, "retries": 0, "syncs": 0}


def test_a_starts_launch_details_its_slowest_piece_and_the_allocators_driver_calls() -> None:
    """Beside its host time by part, the launch that starts a layer-sliced prefill records
    its first slice's slowest forward call and what the memory allocator did (device mallocs
    and frees, retries, syncs) before the first slice and in it; the step trace carries it
    on the launch's first result; other launches record none, and a device without such an
    allocator records no counts."""
    dev = CountingDevice()
    eng, ex, _ = split_engine(dev, fixed_split(layers_per_slice=1, predicted_decode_ms=7.5))
    reqs = make_reqs()
    eng.scheduler.add(reqs[0])
    mallocs_before = dev.mallocs
    split_step(eng)  # r0's prefill starts: no decodes beside it
    detail = ex.launch_detail
    assert detail is not None and set(detail) == {"slowest_piece", "allocs"}
    # One layer a slice: the first slice is one forward call over layer 0.
    piece = detail["slowest_piece"]
    assert piece["layer"] == 0 and piece["layers"] == 1 and piece["num_pieces"] == 1
    assert 0 <= piece["host_ms"] <= ex.launch_parts_ms["first_slice"]
    allocs = detail["allocs"]
    assert set(allocs) == {"to_first_slice", "first_slice"}
    # The two parts hold every event of the launch after its decision (the start's slice
    # events among them); each part saw one count read of its own (the read that opens it).
    assert allocs["first_slice"]["mallocs"] >= 1  # the first slice records its event
    made = allocs["to_first_slice"]["mallocs"] + allocs["first_slice"]["mallocs"]
    assert 1 <= made <= dev.mallocs - mallocs_before
    assert allocs["to_first_slice"]["frees"] == allocs["first_slice"]["frees"] == 1
    assert allocs["first_slice"]["retries"] == allocs["first_slice"]["syncs"] == 0
    split_step(eng)
    assert ex.launch_detail is None  # no start in that launch
    finish(eng, dev)
    # The engine's own loop puts them in the trace: r2's prefill starts beside r1's decodes.
    _start_beside_decodes(eng, ex, reqs)
    started = [st for st in eng.step_trace() if st["launch_parts_ms"] is not None]
    assert started and all(st["launch_detail"] is not None for st in started)
    assert all(
        st["launch_detail"] is None for st in eng.step_trace() if st["launch_parts_ms"] is None
    )
    # No allocator to count (the CPU's stand-in, the fakes): the slowest piece, no counts.
    dev2 = ClockDevice()
    eng2, ex2, _ = split_engine(dev2, fixed_split(layers_per_slice=1))
    eng2.scheduler.add(make_reqs()[0])
    split_step(eng2)
    assert ex2.launch_detail is not None and set(ex2.launch_detail) == {"slowest_piece"}
    finish(eng2, dev2)


# A whole scoring prompt that streams its rows on random:tiny (2 layers): 37 rows past the
# prefill budget, hybrid chunk 8 (5 chunks).
ROW_STREAM_CFG: dict[str, Any] = dict(
    prefill_token_budget=16, prefill_chunk_tokens=8, chunk_scoring_prefill=False
)
ROW_STREAM_PROMPT = [(7 * i) % 300 + 5 for i in range(37)]


def _row_stream_score_req() -> Request:
    return Request("s", RequestKind.SCORE, list(ROW_STREAM_PROMPT), label_token_ids=[10, 20, 30])


def _serial_row_stream_probs() -> Any:
    """The row-stream prompt's label probabilities from the serial executor (the reference)."""
    ref_eng = Engine(
        EngineConfig(model="random:tiny", prefill_policy="fcfs", block_size=4,
                     num_kv_blocks=128, **ROW_STREAM_CFG),
        lambda outs: None,
    )  # fmt: skip
    ref_eng.scheduler.add(_row_stream_score_req())
    ref: list[EngineOutput] = []
    while ref_eng.scheduler.has_work() or ref_eng.executor.num_in_flight:
        ref += ref_eng._step()
    (probs,) = [o.label_probs for o in ref if o.label_probs is not None]
    return probs


def test_sub_layer_slices_run_each_layer_in_row_pieces_with_decodes_between() -> None:
    """`slice_ends` on a prefill that streams its rows (a whole scoring prompt past the
    prefill budget, hybrid chunk 8): each layer runs as row pieces of whole chunks (37 rows,
    5 chunks a layer; slices ending at chunks 3, 5, 8 and 10: rows 0-24 and 24-37 of each
    layer), one piece in flight at a time, the generation's decode steps between them; the
    scores are the serial executor's. (The generation's own 9-token prefill streams no rows:
    whole layers, with a warning.)"""
    cfg = ROW_STREAM_CFG
    ref_probs = _serial_row_stream_probs()

    dev = FakeDevice()
    eng, ex, _ = split_engine(
        dev, fixed_split(layers_per_slice=1, slice_ends=(3, 5, 8, 10)), **cfg
    )  # tiny has 2 layers
    # (h, residual, positions, attn, layer, s, e)
    order = launch_order(ex, "forward_layer_rows", lambda a: f"L{a[4]}:{a[5]}-{a[6]}")
    eng.scheduler.add(gen("g", 9, 12))
    outs = split_step(eng)  # g's prefill (9 tokens: whole layers, no pieces)
    outs += split_step(eng)
    eng.scheduler.add(_row_stream_score_req())
    dev.hold = True
    for _ in range(6):
        outs += split_step(eng)
    outs += finish(eng, dev)
    pieces = [o for o in order if o.startswith("L")]
    assert pieces == ["L0:0-24", "L0:24-37", "L1:0-24", "L1:24-37"]
    # While a piece is pending the generation keeps decoding; the next piece waits for it.
    i = order.index("L0:0-24")
    assert order[i + 1 : order.index("L0:24-37")] == ["decode"] * 6
    (probs,) = [o.label_probs for o in outs if o.label_probs is not None]
    assert probs == pytest.approx(ref_probs, rel=1e-5, abs=1e-7)
    assert ex.num_layer_sliced_prefills == 2 and ex.num_sub_layer_sliced_prefills == 1
    assert eng._partition_stats()["pd_sub_layer_sliced_prefills"] == 1
    eng.block_manager.check_integrity()


@pytest.mark.parametrize(
    ("ends", "want"),
    [
        ((4, 7, 10), [["L0:0-32"], ["L0:32-37", "L1:0-16"], ["L1:16-37"]]),
        ((8, 10), [["L0:0-37", "L1:0-24"], ["L1:24-37"]]),
        ((1, 2, 5, 10), [["L0:0-8"], ["L0:8-16"], ["L0:16-37"], ["L1:0-37"]]),
    ],
)
def test_slices_of_whole_chunks_cross_a_layers_end_with_decodes_only_between_slices(
    ends: tuple[int, ...], want: list[list[str]]
) -> None:
    """A slice runs a piece of each layer it touches up to its end (`slice_ends`, chunks
    counted layer after layer), across a layer's end into the next (more than a layer's
    worth where asked), a decode step only between slices. 37 rows in chunks of 8 (5 a
    layer) over the 2 layers; slices of unequal rows, as cut by cost; the scores are the
    serial executor's."""
    cfg = ROW_STREAM_CFG
    ref_probs = _serial_row_stream_probs()

    dev = FakeDevice()
    eng, ex, _ = split_engine(
        dev,
        fixed_split(layers_per_slice=1, slice_ends=ends),
        **cfg,
    )
    order = launch_order(ex, "forward_layer_rows", lambda a: f"L{a[4]}:{a[5]}-{a[6]}")
    eng.scheduler.add(gen("g", 9, 12))
    outs = split_step(eng)
    outs += split_step(eng)
    eng.scheduler.add(_row_stream_score_req())
    dev.hold = True  # each slice stays pending for three steps, then completes
    details = []
    for _ in range(4):
        for _ in range(3):
            outs += split_step(eng)
            if ex.launch_detail is not None:
                details.append(ex.launch_detail)
        dev.release()
    outs += finish(eng, dev)
    # The start's launch names its first slice's slowest piece, one of that slice's pieces.
    (detail,) = details
    piece = detail["slowest_piece"]
    assert piece["num_pieces"] == len(want[0])
    assert f"L{piece['layer']}:{piece['row_start']}-{piece['row_start'] + piece['rows']}" in want[0]
    runs: list[list[str]] = []  # the pieces between decode steps
    for o in order[order.index(want[0][0]) :]:
        if o == "decode":
            if runs and runs[-1]:
                runs.append([])
        elif o.startswith("L"):
            runs[-1:] = [[*(runs[-1] if runs else []), o]]
    slices = [r for r in runs if r]
    assert slices == want
    (probs,) = [o.label_probs for o in outs if o.label_probs is not None]
    assert probs == pytest.approx(ref_probs, rel=1e-5, abs=1e-7)
    assert ex.num_sub_layer_sliced_prefills == 1
    eng.block_manager.check_integrity()


def test_slice_ends_that_do_not_match_the_prefill_run_whole_layers_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Slices whose last end is not the prefill's chunks over its layers (a controller that
    saw another row stream: a bug) run as whole-layer slices, logged, not as a failed
    prefill; the scores are the serial executor's."""
    ref_probs = _serial_row_stream_probs()
    dev = FakeDevice()
    eng, ex, _ = split_engine(
        dev, fixed_split(layers_per_slice=1, slice_ends=(3, 9)), **ROW_STREAM_CFG
    )
    order = launch_order(ex, "forward_layer_rows", lambda a: f"L{a[4]}:{a[5]}-{a[6]}")
    eng.scheduler.add(_row_stream_score_req())
    with caplog.at_level("WARNING", logger="greenlane"):
        outs = finish(eng, dev)
    assert not [o for o in order if o.startswith("L")]  # no row pieces
    assert any("has other chunks" in r.getMessage() for r in caplog.records)
    (probs,) = [o.label_probs for o in outs if o.label_probs is not None]
    assert probs == pytest.approx(ref_probs, rel=1e-5, abs=1e-7)
    assert ex.num_layer_sliced_prefills == 1 and ex.num_sub_layer_sliced_prefills == 0


def test_the_engine_tells_the_controller_which_prefills_stream_their_rows() -> None:
    """`StepPacer.row_stream`: one sequence past the hybrid chunk and the prefill budget (the
    row form's threshold) is a `RowStream` the controller may cut into row pieces; a batch of
    two, or one within the budget, is not; nor anything with hybrid prefill off."""
    from runtime.partition.cost_model import RowStream

    eng, _, _ = split_engine(
        FakeDevice(), fixed_split(), prefill_token_budget=16, prefill_chunk_tokens=8
    )
    assert eng.pacer.row_stream([(4, 37)]) == RowStream(4, 37, 8)
    assert eng.pacer.row_stream([(0, 16)]) is None  # within the budget: all rows at once
    assert eng.pacer.row_stream([(0, 37), (0, 20)]) is None
    off, _, _ = split_engine(
        FakeDevice(), fixed_split(), prefill_token_budget=16, hybrid_prefill=False
    )
    assert off.pacer.row_stream([(4, 37)]) is None
