"""auto's chunked time-slicing (issue 13): the split controller weighs "time-slice with the
prefill cut into chunks sized to the TBT target" against the splits and layer slices, and the
engine plans the step with the chosen chunk as its prefill token cap. CPU only: the toy cost
model of tests/test_cost_model.py, and GreenContextPartition over the stand-in pairs of
tests/test_partition_manager.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from test_cost_model import SPLITS, TOTAL, truth
from test_partition_manager import manager  # noqa: F401 - the fixture
from test_scheduler import LinearCost, _decoding, _prefill_sizes, cap
from test_split_executor import FakeDevice, FakeEvent, gen, split_engine

from policies.jct import JCTModel
from runtime.partition import SplitDecision
from runtime.partition.corrections import CorrectedCost, MixedPrefill
from runtime.partition.cost_model import (
    DECODE,
    PREFILL,
    TIME_SLICE,
    ChunkInput,
    ControllerConfig,
    CostModel,
    DecodeShape,
    PrefillShape,
    SaturationCurve,
    SplitController,
)
from runtime.partition.pacing import SLICE_TAIL_FLOOR
from runtime.request import Request, RequestKind
from runtime.scheduler import MIN_TBT_CHUNK_TOKENS, tbt_chunk_tokens

# --------------------------------------------------------------------------- the controller
P = PrefillShape.from_seqs([(0, 8192)], num_layers=32)
D = DecodeShape(64, 64 * 2048, 32)


def _model() -> CostModel:
    return truth(kappa_d=0.05, kappa_p=0.02, decode_r_sat=0.3)


def _consistent_cost(m: CostModel) -> LinearCost:
    """A marginal prefill cost that agrees with the cost model's whole-GPU prefill of P (the
    two prefill models of today, made to agree so the comparison is about the options)."""
    return LinearCost(m.predict(PREFILL, P, TOTAL) / P.num_tokens / 1e3)


def _choose(splits: list[int], target_ms: float, chunkable: bool = True, **cfg: Any):
    m = _model()
    ctl = SplitController(
        m,
        splits,
        ControllerConfig(tbt_slo_ms=target_ms, min_gain=0.0, hysteresis_sms=0, **cfg),
    )
    chunk = ChunkInput(_consistent_cost(m), 0, target_ms) if chunkable else None
    return ctl, ctl.choose(P, D, kv_usage=0.2, chunk=chunk)


def test_chunks_when_the_cost_model_says_the_split_loses() -> None:
    """Only small prefill splits (a larger decode floor): each meets the target but its prefill
    runs on few SMs; cutting the prefill into chunks on the whole GPU finishes it sooner."""
    m = _model()
    td = m.predict(DECODE, D, TOTAL)
    target = 2.5 * td
    ctl, dec = _choose([32, 64], target)
    assert dec.prefill_sms == TIME_SLICE and dec.chunk_tokens is not None
    assert dec.layers_per_slice is None
    assert dec.reason == "chunks finish the prefill before split 64"
    # What it was weighed against: the split the rule picks for the whole prefill.
    _, whole = _choose([32, 64], target, chunkable=False)
    assert whole.prefill_sms == 64 and whole.predicted_decode_ms <= target
    assert dec.predicted_prefill_ms < whole.predicted_prefill_ms
    assert ctl.current == TIME_SLICE  # hysteresis starts over from the time-slice


def test_chunk_size_meets_the_target_per_the_model_and_is_the_schedulers_cut() -> None:
    m = _model()
    cost = _consistent_cost(m)
    td = m.predict(DECODE, D, TOTAL)
    target = 2.5 * td
    _, dec = _choose([32, 64], target)
    n = dec.chunk_tokens
    assert n is not None and MIN_TBT_CHUNK_TOKENS < n < P.num_tokens
    # The decodes plus one chunk meet the target; one token more would not.
    assert td + cost.marginal_s(n) * 1e3 <= target < td + cost.marginal_s(n + 1) * 1e3
    assert dec.predicted_decode_ms == pytest.approx(td + cost.marginal_s(n) * 1e3)
    # Finishing the prefill: its whole marginal cost plus a decode step per chunk step.
    steps = -(-P.num_tokens // n)
    assert dec.predicted_prefill_ms == pytest.approx(steps * td + cost.marginal_s(8192) * 1e3)
    # The scheduler's --tbt-slo-ms cut, given the same cost, target and decode step, plans
    # exactly that chunk.
    s = _decoding(budget=8192)
    s.add(gen_prompt("long", 3 * n))
    plan = s.schedule(cap(s, tbt_s=target / 1e3, decode_step_s=td / 1e3, prefill_cost=cost))
    assert _prefill_sizes(plan) == {"long": n}


def test_the_cap_on_a_step_with_decodes_bounds_the_chunk_and_counts_its_steps() -> None:
    """`ChunkInput.max_chunk_tokens` (the engine's `--mixed-step-token-budget` less the
    decodes): below the room, the chunk is the cap, its decode wait is the cap's, and the
    prefill takes a step per cap's worth of tokens."""
    m = _model()
    cost = _consistent_cost(m)
    td = m.predict(DECODE, D, TOTAL)
    target = 2.5 * td
    ctl = SplitController(m, [32, 64], ControllerConfig(tbt_slo_ms=target))
    room = ctl._chunked(P, D, ChunkInput(cost, 0, target)).chunk_tokens
    assert room is not None and room > 1000
    capped = ctl._chunked(P, D, ChunkInput(cost, 0, target, max_chunk_tokens=1000))
    assert capped.chunk_tokens == 1000
    assert capped.predicted_decode_ms == pytest.approx(td + cost.marginal_s(1000) * 1e3)
    steps = -(-P.num_tokens // 1000)
    assert capped.predicted_prefill_ms == pytest.approx(steps * td + cost.marginal_s(8192) * 1e3)
    # A cap above the room changes nothing.
    loose = ctl._chunked(P, D, ChunkInput(cost, 0, target, max_chunk_tokens=room + 1))
    assert loose.chunk_tokens == room


def test_the_chunked_prediction_walks_the_chunks_the_cut_makes_as_the_context_grows() -> None:
    """With a context term (every chunk reads its whole context again: `CorrectedCost`) the
    cut's chunks shrink as a long prompt fills in, and their steps add up: the prediction
    follows the chunks the scheduler's cut makes, step by step, within a few per cent, where
    one whole marginal (as until 2026-12-06) fell ~30 % short on the H100's fitted costs and
    auto chose chunks over faster layer slices."""
    jct = JCTModel(a_s=0.005882, b_s_per_token=1.628e-05, k_s_per_pair=1.109e-09)  # 8B, H100
    cost = CorrectedCost(
        jct, offset_s=0.0005, token_scale=1.196, pair_scale=1.196, context_s_per_token=0.668e-6
    )
    m = _model()
    ctl = SplitController(m, [32, 64], ControllerConfig(tbt_slo_ms=67.0))
    d = DecodeShape(10, 10 * 400, 32)
    for n, ctx in ((40_283, 0), (59_454, 0), (8_000, 30_000)):
        chunk = ChunkInput(cost, ctx, 67.0, decode_step_ms=7.0, max_chunk_tokens=2038)
        dec = ctl._chunked(PrefillShape.from_seqs([(ctx, n)], 32), d, chunk)
        room_s = ctl.chunk_room_ms(d, chunk) / 1e3
        decode_ms = 67.0 - room_s * 1e3
        done, steps, prefill_s = ctx, 0, 0.0  # the cut, chunk by chunk
        while done < ctx + n:
            t = min(tbt_chunk_tokens(cost, room_s, done), 2038, ctx + n - done)
            prefill_s += cost.marginal_s(t, done)
            done, steps = done + t, steps + 1
        walked_ms = steps * decode_ms + prefill_s * 1e3
        assert dec.predicted_prefill_ms == pytest.approx(walked_ms, rel=0.05), n
        if ctx == 0:
            assert steps > 1.3 * -(-n // 2038)  # the chunks shrank well below the cap
            one_marginal_ms = -(-n // 2038) * decode_ms + cost.marginal_s(n, 0) * 1e3
            assert dec.predicted_prefill_ms > 1.25 * one_marginal_ms


def gen_prompt(rid: str, n: int) -> Request:
    from runtime.request import SamplingParams

    return Request(
        rid, RequestKind.GENERATE, list(range(100, 100 + n)), SamplingParams(max_tokens=1)
    )


def test_the_split_is_taken_when_predicted_to_win() -> None:
    """Every split: the largest prefill split meeting the target finishes the prefill before
    chunks small enough for the target would (their decode steps add up)."""
    m = _model()
    target = 3 * m.predict(DECODE, D, TOTAL)
    ctl, dec = _choose(SPLITS, target)
    assert dec.prefill_sms != TIME_SLICE and dec.chunk_tokens is None
    assert dec.predicted_decode_ms <= target and dec.reason == "TBT target"
    chunks = ctl._chunked(P, D, ChunkInput(_consistent_cost(m), 0, target))
    assert chunks.predicted_decode_ms <= target  # chunks would meet it too, only slower
    assert chunks.predicted_prefill_ms > dec.predicted_prefill_ms
    # Demanding a 2x predicted gain of the split (min_split_speedup) flips it to chunks.
    _, dec = _choose(SPLITS, target, min_split_speedup=2.0)
    assert dec.chunk_tokens is not None


def test_unchunkable_prefill_takes_the_split_and_a_split_missing_the_target_never_wins() -> None:
    m = _model()
    target = 2.5 * m.predict(DECODE, D, TOTAL)
    # A whole-prompt scoring prefill (no KV room to chunk it): no chunk option; the split.
    _, dec = _choose([32, 64], target, chunkable=False)
    assert dec.prefill_sms == 64 and dec.chunk_tokens is None
    # The only split left starves decode past the target: chunks.
    probe = SplitController(m, [120], ControllerConfig(allow_time_slice=False))
    assert probe._eval(120, P, D)[1] > target
    _, dec = _choose([120], target)
    assert dec.chunk_tokens is not None and "split 120 misses the TBT target" in dec.reason


def test_a_prefill_that_fits_one_step_runs_whole_cut_to_the_target() -> None:
    m = _model()
    p = PrefillShape.from_seqs([(0, 512)], num_layers=32)
    ctl = SplitController(m, SPLITS, ControllerConfig(tbt_slo_ms=1e3))
    dec = ctl.choose(p, D, 0.2, chunk=ChunkInput(_consistent_cost(m), 0, 1e3))
    assert dec.prefill_sms == TIME_SLICE and dec.chunk_tokens is not None
    assert dec.chunk_tokens >= 512 and dec.reason == "the prefill fits the TBT target in one step"
    assert dec.evaluations == 1  # no split was evaluated


def test_above_the_kv_switch_a_split_stays_but_a_whole_time_slice_is_cut() -> None:
    m = _model()
    target = 3 * m.predict(DECODE, D, TOTAL)
    cost = _consistent_cost(m)
    # A split predicted faster at all is taken here (the default margin is not the subject).
    cfg = ControllerConfig(tbt_slo_ms=target, min_gain=0.0, min_split_speedup=1.0)
    ctl = SplitController(m, SPLITS, cfg)
    # Decode favoured: Nexus's rule picks a split for decode; chunks do not override it.
    whole = SplitController(m, SPLITS, cfg)
    want = whole.choose(P, D, kv_usage=0.9).prefill_sms
    assert want != TIME_SLICE
    assert ctl.choose(P, D, kv_usage=0.9, chunk=ChunkInput(cost, 0, target)).prefill_sms == want
    # Where the rule would time-slice the whole prefill (split predicted slower), it is cut.
    ts = SplitController(m, SPLITS, ControllerConfig(tbt_slo_ms=target, min_split_speedup=100.0))
    assert ts.choose(P, D, kv_usage=0.9).prefill_sms == TIME_SLICE
    dec = ts.choose(P, D, kv_usage=0.9, chunk=ChunkInput(cost, 0, target))
    assert dec.chunk_tokens is not None and "whole prefill cut" in dec.reason


def test_uncalibrated_auto_chunks_with_the_measured_decode_step() -> None:
    ctl = SplitController(CostModel(TOTAL), SPLITS, ControllerConfig(tbt_slo_ms=50.0))
    cost = LinearCost(1e-4)  # 0.1 ms per token
    dec = ctl.choose(P, D, 0.2, chunk=ChunkInput(cost, 0, 50.0, decode_step_ms=10.0))
    assert dec.prefill_sms == TIME_SLICE and dec.chunk_tokens == 400  # (50 - 10) / 0.1
    assert dec.reason == "cost model uncalibrated: chunked time-slicing"
    assert ctl.choose(P, D, 0.2).chunk_tokens is None  # unchunkable: a whole time-slice


def test_a_chunk_is_cut_on_the_decode_base_its_offset_was_fitted_against() -> None:
    """The step offset is learned as a mixed step's time beyond the engine's decode base
    (`CorrectedCost`, `StepPacer.decode_base_s`), so the room a chunk gets is the aim less that
    base and the offset, as the scheduler's `--tbt-slo-ms` cut computes it; the controller's
    own decode prediction is used only when the engine passes no base. On another base,
    whatever the offset held of the difference would count twice."""
    m = _model()
    predicted_ms = m.predict(DECODE, D, TOTAL)
    target, cost = 2.5 * predicted_ms, _consistent_cost(m)
    # No split may win here: the subject is the chunk's size.
    ctl = SplitController(m, SPLITS, ControllerConfig(tbt_slo_ms=target, min_split_speedup=100.0))
    measured_ms, offset_ms = 0.7 * predicted_ms, 0.3 * predicted_ms  # the batch grew since
    chunk = ChunkInput(cost, 0, target, decode_step_ms=measured_ms, step_offset_ms=offset_ms)
    room_ms = target - measured_ms - offset_ms  # 1.5x the prediction, not 1.2x
    assert ctl.chunk_room_ms(D, chunk) == pytest.approx(room_ms)
    dec = ctl.choose(P, D, 0.2, chunk=chunk)
    assert dec.chunk_tokens == cost.max_tokens_within(room_ms / 1e3)
    # Its prediction for the planned step is on the same base.
    step_ms = ctl.chunked_step_ms([(dec.chunk_tokens, 0)], D, chunk)
    assert step_ms == pytest.approx(target, rel=1e-3)
    unmeasured = dataclasses.replace(chunk, decode_step_ms=0.0)
    assert ctl.chunk_room_ms(D, unmeasured) == pytest.approx(target - predicted_ms - offset_ms)


def test_without_time_slicing_allowed_there_are_no_chunks() -> None:
    _, dec = _choose([32, 64], 2.5 * _model().predict(DECODE, D, TOTAL), allow_time_slice=False)
    assert dec.prefill_sms == 64 and dec.chunk_tokens is None


# ------------------------------------------------------------------------ partition manager
def test_a_decision_asked_before_planning_is_counted_only_when_carried_out(manager) -> None:  # noqa: F811
    m = manager.cost_model
    target = 2.5 * m.predict(DECODE, D, TOTAL)
    manager.controller.config = dataclasses.replace(
        manager.controller.config, tbt_slo_ms=target, hysteresis_sms=0
    )
    manager.controller.splits = [32, 64]
    chunk = ChunkInput(_consistent_cost(m), 0, target)
    choice = manager.decide(P, D, 0.2, chunk=chunk, record=False)
    assert choice.chunk_tokens is not None and choice.prefill_sms == TIME_SLICE
    assert choice.prefill_stream is choice.decode_stream is manager._whole
    assert manager.state().choice_counts == {}
    manager.record(choice.decision)
    assert manager.state().choice_counts == {"chunked": 1}  # the admin page's key


# ------------------------------------------------------------------------------ the engine
def _flat_model() -> CostModel:
    """Per layer: prefill 1 ms per 1,000 tokens, decode 1 ms; both linear in SMs, no
    contention. With 2 layers (random:tiny): 2 us a prefill token, 2 ms a decode step."""
    m = CostModel(TOTAL, calibrated=True, source="test")
    m.base = {PREFILL: [0.0, 1.0, 0.0], DECODE: [1.0, 0.0, 0.0]}
    m.curve = {PREFILL: SaturationCurve(1.0, 1.0), DECODE: SaturationCurve(1.0, 1.0)}
    return m


TARGET_MS = 2.7  # the 2 ms decode step + 350 prefill tokens; split 16's decode (2.28 ms) meets it
CHUNK = 350


class _HeldCost(CorrectedCost):
    """The engine's corrected prefill cost with its online correction held (what it was
    asked to learn is kept in `seen`)."""

    def observe(self, prefill: MixedPrefill, extra_s: float) -> None:
        self.seen = [*getattr(self, "seen", []), (prefill, extra_s)]


DECODE_MEASURED_MS = 1.5  # what `_ClockedDevice` times the decode-only steps of off-tbt at


class _ClockedEvent(FakeEvent):
    def elapsed_time(self, end: FakeEvent) -> float:
        return self.dev.step_ms  # type: ignore[attr-defined]


class _ClockedDevice(FakeDevice):
    """A fake device whose every step (and idle gap) lasts `step_ms`: a test's lesson for the
    cost model that does not depend on how fast the machine runs the CPU model."""

    def __init__(self, step_ms: float) -> None:
        super().__init__()
        self.step_ms = step_ms

    def event(self) -> _ClockedEvent:
        return _ClockedEvent(self)


def _auto_engine(manager, **cfg: Any):  # noqa: F811
    """An engine in auto whose split executor asks `manager` (GreenContextPartition over
    stand-ins) through the engine's own `StepPacer.choose_split`; a JCT model agreeing with the
    cost model; only split 16 (its prefill on 16 SMs is slow, its decode meets the target)."""
    dev = FakeDevice()
    eng, ex, _ = split_engine(dev, None, **{"num_kv_blocks": 512, **cfg})
    manager.set_cost_model(_flat_model())
    manager.controller.splits = [16]
    manager.controller.config = ControllerConfig(tbt_slo_ms=TARGET_MS, hysteresis_sms=0)
    eng._green = eng.pacer.green = manager
    ex.choose = eng.pacer.choose_split
    ex.split_usable = lambda sms: sms not in manager.disabled
    jct = eng.jct_model
    jct.a_s, jct.b_s_per_token, jct.k_s_per_pair = 0.0, 2e-6, 0.0
    # Chunks sized at the target itself: a tail already read as on time (a new engine aims
    # below the target by the tail factor's bound until it has seen 32 steps).
    eng.pacer.tbt_tail.factor = 1.0
    # The fake device times every step at 1 ms, which says nothing of a step's cost: the online
    # correction of the cut stays where it starts (its own tests: tests/test_scheduler.py).
    eng.pacer.prefill_cost = _HeldCost(eng.jct_model)
    launched: list[Any] = []
    launch = ex.launch

    def spy(plan: Any) -> None:
        launched.append(plan)
        launch(plan)

    ex.launch = spy  # type: ignore[method-assign]
    return eng, ex, launched


def _run(eng, until: Any, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if until():
            return
        eng._step()
    raise AssertionError("did not get there")


def _decoding_chat(eng) -> None:
    eng.scheduler.add(gen("chat", 8, 200, seed=1))
    _run(eng, lambda: eng.scheduler.running and eng.scheduler.running[0].num_output_tokens > 0)
    eng._green.set_mode("auto")  # count from here (the chat's prefill ran alone: "0")


def test_auto_caps_the_steps_prefill_at_the_chosen_chunk(manager) -> None:  # noqa: F811
    eng, ex, launched = _auto_engine(manager)
    _decoding_chat(eng)
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    eng._step()
    plan = launched[0]
    assert _sizes(plan) == {"long": CHUNK}
    assert [s.request.request_id for s in plan.decode] == ["chat"]  # one whole-GPU step
    assert manager.state().choice_counts == {"chunked": 1}
    _run(eng, lambda: eng.scheduler.get("long") is None)
    assert [_sizes(p).get("long") for p in launched if p.prefill] == [CHUNK, CHUNK, 300]
    assert ex.num_split_prefills == 0 and ex.num_layer_sliced_prefills == 0
    assert manager.state().choice_counts == {"chunked": 3}


def test_auto_runs_a_head_it_sends_to_the_split_whole_not_by_the_budget(manager) -> None:  # noqa: F811
    """A split (or layer slices) is chosen for the whole head of the queue, so the step
    carries the whole head, not the split executor's budget's worth: launched by pieces, each
    would be weighed and run alone (on an H100, 40-44k-token scoring prompts ran as five
    8,192-token pieces on 96 SMs, 3.3 s where layer slices take ~1.9 s)."""
    eng, ex, launched = _auto_engine(manager, prefill_token_budget=256)
    _decoding_chat(eng)
    decide = manager.decide

    def split_wins(p: Any, d: Any, kv_usage: float, **kw: Any) -> Any:
        # Before planning, the split is predicted to win (no chunk option weighed).
        return decide(p, d, kv_usage, **{**kw, "chunk": None})

    manager.decide = split_wins
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    eng._step()
    assert _sizes(launched[0]) == {"long": 1000}
    assert ex.num_split_prefills == 1
    # Longer than the activation reserve was sized for, it goes by the budget as before.
    eng.pacer.max_score_tokens = 500
    eng.scheduler.add(gen("longer", 800, 1, seed=3))
    _run(eng, lambda: any("longer" in _sizes(p) for p in launched))
    assert [_sizes(p)["longer"] for p in launched if "longer" in _sizes(p)][0] == 256


def test_auto_holds_its_chunks_to_the_cap_on_a_step_with_decodes(manager) -> None:  # noqa: F811
    """The serial executor's cap on a step with decodes (`--mixed-step-token-budget`, set
    while serving) bounds auto's chunks too, the decode included: 201 tokens with one decode
    leaves 200 where the room holds 350."""
    eng, _, launched = _auto_engine(manager)
    _decoding_chat(eng)
    eng.serial.set_mixed_step_token_budget(201)
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    _run(eng, lambda: eng.scheduler.get("long") is None)
    assert [_sizes(p).get("long") for p in launched if p.prefill] == [200] * 5
    assert all(p.num_prefill_tokens + len(p.decode) <= 201 for p in launched)
    assert manager.state().choice_counts == {"chunked": 5}


@pytest.mark.parametrize(
    ("share", "chunks"),
    [
        (0.9, [200] * 5),  # the fixed part's chunk (111 tokens) is under the cap: the cap
        # 2 ms x 0.2 / 0.8 = 0.5 ms at 2 us a token: past the cap (250, floored to 249 in
        # floating point; the last 4 tokens in a step of their own)
        (0.8, [249] * 4 + [4]),
        (0.5, [CHUNK, CHUNK, 300]),  # 1,000 tokens' worth: the TBT target's room bounds it
    ],
)
def test_auto_grows_its_chunk_past_the_cap_until_the_fixed_part_is_its_share(
    manager,  # noqa: F811
    share: float,
    chunks: list[int],
) -> None:
    """`--chunk-fixed-share s`: auto's chunk beside decodes may pass the cap on a step with
    decodes until the step's fixed part (the flat model's 2-ms decode base, no offset yet) is
    s of the step, within the target's room and the prefill budget; the step's plan keeps
    to the raised cap, decodes included."""
    eng, _, launched = _auto_engine(manager, chunk_fixed_share=share)
    _decoding_chat(eng)
    eng.serial.set_mixed_step_token_budget(201)
    assert eng.pacer.prefill_cost.offset_s == 0.0
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    _run(eng, lambda: eng.scheduler.get("long") is None)
    assert [_sizes(p).get("long") for p in launched if p.prefill] == chunks
    assert all(len(p.decode) == 1 for p in launched if p.prefill)


def test_the_fixed_share_changes_at_run_time(manager) -> None:  # noqa: F811
    """Set while serving (`set_prefill_limits`, the admin API's path), the share applies from
    the next step as if started with it (the 0.8 case above), and None returns to the cap."""
    eng, _, launched = _auto_engine(manager)
    _decoding_chat(eng)
    budget = eng.serial.prefill_token_budget

    def set_limits(share: float | None, long_id: str, seed: int) -> list[int | None]:
        eng.set_prefill_limits(budget, None, 201, share)
        items = list(eng._inbox)
        eng._inbox.clear()
        for kind, payload in items:  # as the engine thread's loop does before a step
            eng._handle(kind, payload)
        launched.clear()
        eng.scheduler.add(gen(long_id, 1000, 1, seed=seed))  # (another seed: no prefix hit)
        _run(eng, lambda: eng.scheduler.get(long_id) is None)
        return [_sizes(p).get(long_id) for p in launched if p.prefill]

    assert set_limits(0.8, "a", 2) == [249] * 4 + [4]
    assert set_limits(None, "b", 3) == [200] * 5


def test_the_fixed_part_counts_the_cached_prefixs_read(manager) -> None:  # noqa: F811
    """A cached prefix's read (`CorrectedCost.context_s_per_token`) is paid whatever the
    chunk: fixed. 10k cached tokens at 0.1 us: 1 ms beside the 2-ms decode base, so s = 0.8
    leaves the chunk 0.75 ms, 375 tokens at 2 us (376 with the decode)."""
    from runtime.scheduler import StepOutlook

    eng, _, _ = _auto_engine(manager, chunk_fixed_share=0.8)
    _decoding_chat(eng)
    eng.serial.set_mixed_step_token_budget(201)
    look = StepOutlook(1000, 10_000, True, 1, 8)
    base_s = eng.pacer.decode_base_s(1, 8)  # the flat model's 2 ms
    pacer = eng.pacer
    assert pacer.auto_step_cap(look, base_s, 8192) == pytest.approx(251, abs=1)  # no prefix read
    pacer.prefill_cost.context_s_per_token = 1e-7
    assert pacer.auto_step_cap(look, base_s, 8192) == pytest.approx(376, abs=1)
    assert pacer.auto_step_cap(look, base_s, 300) == 300  # never past the prefill budget


def test_the_fixed_share_never_passes_the_prefill_budget(manager) -> None:  # noqa: F811
    eng, _, launched = _auto_engine(manager, chunk_fixed_share=0.5, prefill_token_budget=256)
    _decoding_chat(eng)
    eng.serial.set_mixed_step_token_budget(201)
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    _run(eng, lambda: eng.scheduler.get("long") is None)
    assert [_sizes(p).get("long") for p in launched if p.prefill] == [255] * 3 + [235]


def test_auto_cuts_and_corrects_on_the_models_decode_for_the_batch(manager) -> None:  # noqa: F811
    """Under auto with a calibrated cost model, a mixed step's decode part is the model's
    prediction for its batch, both where the chunk is cut and where the step offset is
    learned; the average of decode-only steps (measured at other batches, and stale under
    load) is the base only without one."""
    eng, _, launched = _auto_engine(manager)
    _decoding_chat(eng)
    eng.pacer.decode_step_avg_s = 0.5e-3  # decode-only steps at another batch, long ago
    assert eng.pacer.decode_base_s(1, 8) == pytest.approx(2e-3)  # the flat model: 1 ms a layer
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    eng._step()
    assert _sizes(launched[0]) == {"long": CHUNK}  # (2.7 - 2) ms at 2 us a token, not 1,100
    while not getattr(eng.pacer.prefill_cost, "seen", None):
        eng._step()
    # The fake device times the step at 1 ms: 1 ms beyond the model's decode, not 0.5.
    assert eng.pacer.prefill_cost.seen[0][1] == pytest.approx(1e-3 - 2e-3)
    manager.set_cost_model(CostModel(TOTAL))  # uncalibrated: no prediction to stand on
    assert eng.pacer.decode_base_s(1, 8) == pytest.approx(eng.pacer.decode_step_avg_s)


def test_off_with_a_tbt_target_cuts_on_the_models_decode_and_teaches_it(manager) -> None:  # noqa: F811
    """`off --tbt-slo-ms` cuts its chunks on the same decode base as auto: the cost model's
    prediction for the batch, not the decode-only average (on the H200 that average, stale
    under load, let off-tbt's step offset read 19.6 ms and its steps shrink). In off the
    split executor does not run, so the serial executor's decode-only steps refine the
    model's decode."""
    eng, _, _ = _auto_engine(manager)
    manager.set_mode("off")
    eng.pacer.tbt_s = TARGET_MS / 1e3
    plans: list[Any] = []
    launch = eng.serial.launch

    def spy(plan: Any) -> None:
        plans.append(plan)
        launch(plan)

    eng.serial.launch = spy  # type: ignore[method-assign]
    eng.scheduler.add(gen("chat", 8, 200, seed=1))
    _run(eng, lambda: eng.scheduler.running and eng.scheduler.running[0].num_output_tokens > 0)
    assert eng.executor is eng.serial
    # From here the serial executor's steps read 1.5 ms on a fake clock: on the host's own
    # clock the lesson was this CPU's speed, and a fast CI machine cut 567 tokens (a flake).
    assert eng.serial.num_in_flight == 0  # nothing left to time on the host's clock
    eng.serial.device = _ClockedDevice(DECODE_MEASURED_MS)
    eng.serial._last_end = None  # a host event cannot time the gap to a fake one
    observed = manager.cost_model_errors().get("num_decode_alone", 0)
    for _ in range(3):
        eng._step()  # decode-only steps on the serial executor
    assert manager.cost_model_errors()["num_decode_alone"] == observed + 3
    eng.pacer.decode_step_avg_s = 0.5e-3  # as if decode-only steps had run at a small batch
    plans.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    eng._step()
    mixed = next(p for p in plans if p.prefill)
    # Room: 2.7 ms less the model's decode as taught (1.5 ms), at 2 us a token: 600 tokens.
    # Untaught (the model's 2 ms) it would be 350; on the stale 0.5 ms average, all 1,000.
    assert _sizes(mixed)["long"] == pytest.approx(600, abs=2)
    # The cap on a step with decodes stays under the target: it can only cut shorter.
    eng.serial.set_mixed_step_token_budget(101)
    plans.clear()
    eng._step()  # "long" goes on in a chunk of the cap less the decode
    assert _sizes(plans[0]) == {"long": 100} and len(plans[0].decode) == 1


def test_auto_times_every_prefill_it_adds_behind_the_chunked_head(manager) -> None:  # noqa: F811
    """auto sizes the chunk for the head of the queue; the prefills planned behind it in the
    same step are held to the same TBT time, not only to its tokens. On the H200 (3B, scoring
    next to chat, `96bc96d`) a token cap alone let 24-39 scoring suffixes with 10-15k cached
    tokens each into steps predicted at 85-120 ms for an 80 ms target: their attention over the
    cached prefix costs more per token than the head's chunk."""
    eng, _, launched = _auto_engine(manager, num_kv_blocks=1024)
    eng.jct_model.k_s_per_pair = 1e-9  # attention: 1 ns a query-key pair
    _decoding_chat(eng)
    shared = gen("first", 2000, 1, seed=7).prompt_token_ids
    eng.scheduler.add(Request("first", RequestKind.SCORE, shared + [5], label_token_ids=[1]))
    _run(eng, lambda: eng.scheduler.get("first") is None)
    launched.clear()
    eng.scheduler.add(gen("head", 100, 1, seed=3))
    eng.scheduler.add(Request("behind", RequestKind.SCORE, shared + [6] * 200, label_token_ids=[1]))
    eng._step()
    plan = launched[0]
    assert plan.decode and _sizes(plan)["head"] == 100
    cost, left_s = eng.pacer.prefill_cost, (TARGET_MS - 2.0) / 1e3  # the flat model's decode: 2 ms
    spent = sum(cost.marginal_s(s.num_new_tokens, s.num_context_tokens) for s in plan.prefill)
    # The head's 100 tokens leave room for 250 more tokens but not for the 200 behind it
    # (each attends 2,000 cached tokens): they wait for a step of their own time.
    assert spent <= left_s + 1e-12
    assert _sizes(plan).get("behind", 0) < 200


def test_auto_runs_an_unchunkable_scoring_prompt_on_the_split(manager) -> None:  # noqa: F811
    """No room in the KV pool for the scoring prompt's KV: it runs whole (hybrid prefill), so
    there is no chunk option; a whole time-slice would miss the target, split 16 meets it."""
    eng, ex, launched = _auto_engine(manager)
    _decoding_chat(eng)
    launched.clear()
    bm = eng.block_manager
    bm.allocate("hog", 200)  # KV usage stays below the switch (prefill favoured)
    assert bm.num_free_blocks < 1600 // 4 and bm.num_used_blocks / bm.num_blocks < 0.7
    prompt = list(range(100, 1700))
    eng.scheduler.add(Request("sc", RequestKind.SCORE, prompt, label_token_ids=[1]))
    usage_at_launch: list[float] = []
    launch = ex.launch

    def spy(plan: Any) -> None:
        usage_at_launch.append(bm.num_used_blocks / bm.num_blocks)
        launch(plan)

    ex.launch = spy  # type: ignore[method-assign]
    eng._step()
    assert _sizes(launched[0]) == {"sc": 1600}
    # Admitted, it took every free block to cache its prefix; judged at the usage from before
    # the step was planned (its own blocks are not decode pressure), it gets the split.
    assert usage_at_launch[0] > 0.9
    assert ex.num_split_prefills == 1
    assert manager.state().choice_counts == {"16": 1}
    # With room for its KV the same prompt is chunked like a chat prompt.
    bm.free("hog")
    _run(eng, lambda: eng.scheduler.get("sc") is None)
    launched.clear()
    eng.scheduler.add(Request("sc2", RequestKind.SCORE, prompt[::-1], label_token_ids=[1]))
    eng._step()
    assert _sizes(launched[0]) == {"sc2": CHUNK}


def test_the_kv_switch_does_not_count_a_running_scoring_prompts_own_blocks(manager) -> None:  # noqa: F811
    """A whole scoring prompt takes every free block to cache its prefix and gives them back
    when its prefill ends: while it is in flight the next prefill must not be judged in the
    decode-favoured regime because of them. The chat's blocks and the hog's do count."""
    eng, ex, _ = _auto_engine(manager)
    _decoding_chat(eng)
    bm = eng.block_manager
    chat_blocks = bm.num_used_blocks
    bm.allocate("hog", 200)
    at_launch: list[tuple[float, float]] = []  # (the pool's share in use, the switch's read)
    launch = ex.launch

    def spy(plan: Any) -> None:
        at_launch.append((bm.num_used_blocks / bm.num_blocks, eng.pacer.kv_usage()))
        launch(plan)

    ex.launch = spy  # type: ignore[method-assign]
    prompt = list(range(100, 1700))
    eng.scheduler.add(Request("sc", RequestKind.SCORE, prompt, label_token_ids=[1]))
    eng._step()
    assert ex.num_split_prefills == 1
    used, pressure = at_launch[0]
    assert used > 0.9  # admitted, holding the pool
    # The chat's blocks (it may have taken one more since) and the hog's.
    assert pressure == pytest.approx((chat_blocks + 200) / bm.num_blocks, abs=1.01 / 512)
    assert pressure < manager.controller.config.kv_switch
    # A generation's blocks are decode pressure whatever its phase.
    _run(eng, lambda: eng.scheduler.get("sc") is None)
    at_launch.clear()
    eng.scheduler.add(gen("chat2", 300, 4, seed=2))
    eng._step()
    assert [r.request_id for r in eng.scheduler.running] == ["chat", "chat2"]
    assert at_launch[0][1] == at_launch[0][0] > (chat_blocks + 200) / bm.num_blocks


def test_auto_holds_what_it_admits_behind_a_whole_scoring_head_to_the_room(manager) -> None:  # noqa: F811
    """Scoring prompts not chunked (`--chunk-scoring-prefill false`): the head of the queue
    runs whole, and what is admitted behind it is held to the room the target leaves after
    the decode step. On the H200 (3B, plan z at 8c86337) 20-23 scoring suffixes that waited
    on one shared prefix went in as one 83-86-ms step for an 80-ms target."""
    eng, _, launched = _auto_engine(manager, num_kv_blocks=1024, chunk_scoring_prefill=False)
    _decoding_chat(eng)
    launched.clear()
    for i in range(6):  # 150 tokens each, no prefix shared: 0.3 ms each at 2 us a token
        prompt = list(range(1000 + 200 * i, 1150 + 200 * i))
        eng.scheduler.add(Request(f"s{i}", RequestKind.SCORE, prompt, label_token_ids=[1]))
    eng._step()
    plan = launched[0]
    assert plan.decode
    # Room: 2.7 ms - the flat model's 2 ms decode = 350 tokens: the head and one more (a
    # third would need 450), each whole; the rest wait for steps of their own.
    assert sorted(_sizes(plan).values()) == [150, 150]
    _run(eng, lambda: all(eng.scheduler.get(f"s{i}") is None for i in range(6)))
    assert all(sum(_sizes(p).values()) <= 300 for p in launched if p.prefill and p.decode)
    # A head too long for the room still runs (whole), with nothing behind it.
    launched.clear()
    eng.scheduler.add(
        Request("big", RequestKind.SCORE, list(range(3000, 3600)), label_token_ids=[1])
    )
    eng.scheduler.add(
        Request("small", RequestKind.SCORE, list(range(4000, 4050)), label_token_ids=[1])
    )
    eng._step()
    assert _sizes(launched[0]) == {"big": 600}


def test_auto_uses_the_partition_target_unless_tbt_slo_ms_is_given(manager) -> None:  # noqa: F811
    from runtime.config import EngineConfig
    from runtime.partition.setup import controller_config_from

    eng, _, _ = _auto_engine(manager)
    assert eng.pacer.chunk_tbt_ms() == TARGET_MS  # --partition-tbt-slo-ms
    eng.pacer.tbt_s = 0.05  # --tbt-slo-ms (or the admin page's TBT target)
    assert eng.pacer.chunk_tbt_ms() == pytest.approx(50.0)
    # --tbt-slo-ms alone also becomes the controller's target; with both, each keeps its own.
    assert controller_config_from(EngineConfig(tbt_slo_ms=60.0)).tbt_slo_ms == 60.0
    both = EngineConfig(tbt_slo_ms=60.0, partition_tbt_slo_ms=80.0)
    assert controller_config_from(both).tbt_slo_ms == 80.0


def test_without_a_target_auto_plans_as_before(manager) -> None:  # noqa: F811
    eng, ex, launched = _auto_engine(manager)
    manager.controller.config = ControllerConfig()
    _decoding_chat(eng)
    launched.clear()
    eng.scheduler.add(gen("long", 1000, 1))
    eng._step()
    assert _sizes(launched[0]) == {"long": 1000}  # whole: the controller decides at launch
    assert "chunked" not in manager.state().choice_counts


def _sizes(plan: Any) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in plan.prefill}


def test_split_decision_has_one_type() -> None:
    dec = SplitDecision(TIME_SLICE, chunk_tokens=512)
    assert dec.chunk_tokens == 512 and dec.layers_per_slice is None


def test_steps_on_a_split_teach_neither_the_jct_model_nor_the_decode_average() -> None:
    """Both model the whole GPU and size the chunks; a split's partition runs slower."""
    from runtime.executor.base import StepResult
    from runtime.scheduler import RunnerOutput, StepPlan

    eng, _, _ = split_engine(FakeDevice(), None)
    seq = SimpleNamespace(num_new_tokens=512, num_context_tokens=0, num_kept_tokens=512)
    dseq = SimpleNamespace(num_new_tokens=1, num_context_tokens=64, num_kept_tokens=65)
    prefill, decode = StepPlan(1, prefill=[seq]), StepPlan(2, decode=[dseq])
    for plan in (prefill, decode):
        eng._observe(StepResult(plan, RunnerOutput(), 0.5, None, on_split=True))
    assert eng.jct_model.num_observed == 0 and eng.pacer.decode_step_avg_s == 0.0
    assert eng._num_decode_steps == 1  # still a decode step of the device's
    eng._observe(StepResult(prefill, RunnerOutput(), 0.05))
    eng._observe(StepResult(decode, RunnerOutput(), 0.01))
    assert eng.jct_model.num_observed == 1 and eng.pacer.decode_step_avg_s == pytest.approx(0.01)


def test_one_prefill_model_whole_gpu_prefill_comes_from_the_jct_model(manager) -> None:  # noqa: F811
    """Once the JCT model is fitted to the device, the cost model predicts a prefill's
    whole-GPU latency with it (and adds what SM shares change), also after a new cost model
    is installed; with the JCT fallback default it keeps its own fit."""
    eng, _, _ = _auto_engine(manager)
    eng.pacer.share_prefill_model()
    p = PrefillShape.from_seqs([(0, 1000)], num_layers=2)
    assert manager.cost_model.predict(PREFILL, p, TOTAL) == pytest.approx(2.0)  # its own fit
    jct = eng.jct_model
    jct.a_s, jct.b_s_per_token, jct.k_s_per_pair = 1e-3, 1e-5, 0.0
    jct.source = "calibration:test"
    for _ in range(2):
        m = manager.cost_model
        whole_ms = jct.predict_s(1000, 0) * 1e3
        assert whole_ms == pytest.approx(11.0)
        assert m.predict(PREFILL, p, TOTAL) == pytest.approx(whole_ms)
        assert m.predict(PREFILL, p, 66) == pytest.approx(2 * whole_ms)  # linear in SMs
        # One of the model's two layers (a row piece's shape): half the whole forward.
        one = PrefillShape.from_seqs([(0, 1000)], num_layers=1)
        assert m.predict(PREFILL, one, TOTAL) == pytest.approx(whole_ms / 2)
        assert m.predict(DECODE, D, TOTAL) == pytest.approx(32.0)  # decode: its own fit
        manager.set_cost_model(_flat_model())  # e.g. after the start-up profile


def _sliced_scoring_engine(manager) -> tuple[Any, Any, list[Any]]:  # noqa: F811
    """An auto engine whose whole scoring prompts stream their rows (hybrid chunk 8, past a
    16-token budget) and may run in layer slices, its prefill priced by the JCT model it
    shares once fitted to the device, a chat decoding; and the list its choices are
    recorded in."""
    eng, ex, _ = _auto_engine(
        manager, prefill_token_budget=16, prefill_chunk_tokens=8, chunk_scoring_prefill=False
    )
    manager.controller.config = ControllerConfig(
        tbt_slo_ms=TARGET_MS, hysteresis_sms=0, layer_slicing=True
    )
    eng.jct_model.source = "calibration:test"  # fitted to the device: shared
    eng.pacer.share_prefill_model()
    _decoding_chat(eng)
    choices: list[Any] = []
    choose = ex.choose

    def spy(p: Any, d: Any) -> Any:
        choices.append(choose(p, d))
        return choices[-1]

    ex.choose = spy
    return eng, ex, choices


def test_a_fitted_jct_model_prices_row_pieces_as_one_layer(manager) -> None:  # noqa: F811
    """Through the engine: a whole scoring prompt that streams its rows, no layer of which
    fits the room beside a decoding chat, runs in row pieces priced by the JCT model the
    engine shares once it is fitted to the device. 1,000 tokens on the 2-layer model: a layer
    1 ms (1 us a token), the room 2.7 - 2 ms: slices of whole 8-token chunks, each as many as
    fit, make three (as pieces of equal rows, two a slice, did before slices were cut by
    cost). Priced as
    whole forwards (before `cfb80db`), each piece cost both layers: more pieces here, and on
    the H100 none at all (none of a 53-56k-token prompt fitted)."""
    eng, ex, choices = _sliced_scoring_engine(manager)
    prompt = [(7 * i) % 300 + 5 for i in range(1000)]
    eng.scheduler.add(Request("s", RequestKind.SCORE, prompt, label_token_ids=[10, 20, 30]))
    _run(eng, lambda: eng.scheduler.get("s") is None, max_steps=400)
    (sliced,) = [c for c in choices if c.decision.slice_ends]
    dec = sliced.decision
    # 125 chunks of 8 a layer, 250 in all; each slice as many as fit the room: 87 chunks
    # (696 rows, 0.696 ms), 87 (across the layer's end), and the rest.
    assert (dec.layers_per_slice, dec.slice_ends) == (1, (87, 174, 250))
    assert ex.num_sub_layer_sliced_prefills == 1
    # A decode waits the heaviest slice and its own step.
    assert dec.predicted_decode_ms == pytest.approx(0.696 + 2.0)


def test_decodes_behind_slices_teach_the_slices_own_tail_which_then_sizes_them(
    manager,  # noqa: F811
) -> None:
    """Through the engine: each decode step behind a layer slice feeds the slices' own tail
    (what it waited, gap and step, over the wait promised). Until that tail is measured,
    slices are sized to the chunks' aim; once it is, to the target over it, whatever the
    chunks' tail: the fake device's waits (2 ms) are under the promise, so the slices'
    tail reads its floor (SLICE_TAIL_FLOOR, for the delivery after the device) where the
    chunks' reads 1.2."""
    eng, ex, choices = _sliced_scoring_engine(manager)

    def score(rid: str, seed: int) -> Any:
        prompt = [(7 * i + seed) % 300 + 5 for i in range(1000)]
        eng.scheduler.add(Request(rid, RequestKind.SCORE, prompt, label_token_ids=[10, 20, 30]))
        _run(eng, lambda: eng.scheduler.get(rid) is None, max_steps=400)
        (sliced,) = [c.decision for c in choices if c.decision.slice_ends]
        choices.clear()
        return sliced

    first = score("s0", 0)
    behind = [st for st in eng.step_trace() if st["slice_promised_ms"] is not None]
    assert behind and all(st["slice_promised_ms"] == first.predicted_decode_ms for st in behind)
    # Those with a gap measured (the first decode step on the split executor has none).
    ratios = eng.pacer.slice_tail._ratios
    assert len(ratios) == sum(st["decode_gap_ms"] is not None for st in behind)
    assert ratios
    # (1 ms of gap and a 1-ms step, as the fake device times every event pair)
    assert list(ratios) == pytest.approx([2.0 / first.predicted_decode_ms] * len(ratios))
    assert eng.pacer.slice_aim_ms() is None  # not yet measured (32 waits)
    eng.pacer.tbt_tail.factor = 1.2  # the chunks' tail
    by_chunks = score("s1", 1)
    assert by_chunks.predicted_decode_ms <= TARGET_MS / 1.2
    for _ in range(32):  # waits under their promise (as the fake device's)
        eng.pacer.slice_tail.observe(0.0025, 0.002, TARGET_MS / 1e3)
    assert eng.pacer.slice_aim_ms() == pytest.approx(TARGET_MS / SLICE_TAIL_FLOOR)
    own = score("s2", 2)
    assert TARGET_MS / 1.2 < own.predicted_decode_ms <= TARGET_MS / SLICE_TAIL_FLOOR
    eng._publish_stats()
    assert eng.stats()["slice_tail_factor"] == SLICE_TAIL_FLOOR


def test_chunked_steps_are_scored_against_their_prediction(manager) -> None:  # noqa: F811
    """The issue's per-kind error: each chunked step's predicted time (its decodes plus its
    chunk's marginal cost) against the measured one (the fake device: 1 ms a step)."""
    eng, _, launched = _auto_engine(manager)
    _decoding_chat(eng)
    eng.scheduler.add(gen("long", 1000, 1))
    _run(eng, lambda: eng.scheduler.get("long") is None)
    errors = manager.cost_model_errors()
    # 2 ms decode + 350 tokens x 2 us = 2.7 ms predicted for the first two chunks, 2.6 for
    # the last; each measured 1 ms.
    want = (2 * (2.7 - 1) / 1 + (2.6 - 1) / 1) / 3
    assert errors["mape_chunked_step"] == pytest.approx(want)
    assert eng.pacer._chunked_predicted_ms == {}
    stats = eng.fresh_stats()
    assert stats["cost_model_errors"]["mape_chunked_step"] == pytest.approx(want)
    # The step trace carries each chunked step's prediction (a replay attributes the error),
    # and only theirs.
    traced = [(st["num_prefill_tokens"], st["chunked_predicted_ms"]) for st in eng.step_trace()]
    chunked = [(n, ms) for n, ms in traced if ms is not None]
    assert [n for n, _ in chunked] == [CHUNK, CHUNK, 300]
    assert [ms for _, ms in chunked] == pytest.approx([2.7, 2.7, 2.6])
    assert all(ms is None for n, ms in traced if n == 0)
    # ... and the rest of the head its decision predicted: steps x the 2 ms decode plus 2 us
    # a token (1000, 650, 300 tokens left: 3, 2, 1 steps).
    heads = [st["chunked_head_predicted_ms"] for st in eng.step_trace()]
    assert [ms for ms in heads if ms is not None] == pytest.approx([8.0, 5.3, 2.6])
    assert all(
        st["chunked_head_predicted_ms"] is None
        for st in eng.step_trace()
        if not st["num_prefill_tokens"]
    )


def test_a_fallback_jct_model_is_scaled_to_the_partition_cost_model(manager) -> None:  # noqa: F811
    """The JCT fallback (an 8B model's guess) sizes the chunks until fitted: the engine starts
    its online correction at the ratio of the cost model's whole-GPU prefill to it."""
    eng, _, _ = _auto_engine(manager)
    jct = eng.jct_model
    jct.b_s_per_token = 4e-6  # twice the flat model's 2 us a token (2 layers x 1 us)
    eng.pacer.share_prefill_model()
    cost = eng.pacer.prefill_cost
    assert (cost.token_scale, cost.pair_scale) == pytest.approx((0.5, 0.5))
    assert cost.max_tokens_within(0.7e-3) == 350  # as the cost model says
    # A JCT model fitted to the device is not second-guessed.
    cost.seed_scale(1.0)
    jct.source = "calibration:test"
    eng.pacer.share_prefill_model()
    assert (cost.token_scale, cost.pair_scale) == (1.0, 1.0)


def test_a_split_must_win_by_more_than_its_measured_error() -> None:
    """The split's predictions are the least accurate the controller makes (12-20 % for a
    split's prefill on the H200): once its kind has measured errors, a split must be predicted
    to finish the prefill sooner by more than that error, and its decode step must meet the
    target with its own measured error added; chunks are taken otherwise."""
    m = _model()
    target = 3 * m.predict(DECODE, D, TOTAL)

    def choose_with(errors: dict[str, float], n: int = 8) -> SplitDecision:
        model = _model()
        for key, e in errors.items():
            for _ in range(n):
                model.score(key, 1.0 + e, 1.0)  # |predicted - measured| / measured = e
        ctl = SplitController(
            model, SPLITS, ControllerConfig(tbt_slo_ms=target, min_gain=0.0, hysteresis_sms=0)
        )
        return ctl.choose(P, D, kv_usage=0.2, chunk=ChunkInput(_consistent_cost(m), 0, target))

    split = choose_with({})
    assert split.prefill_sms != TIME_SLICE  # predicted to win (the test above)
    chunks = SplitController(m, SPLITS, ControllerConfig(tbt_slo_ms=target))._chunked(
        P, D, ChunkInput(_consistent_cost(m), 0, target)
    )
    gain = chunks.predicted_prefill_ms / split.predicted_prefill_ms  # > min_split_speedup
    slack = target / split.predicted_decode_ms  # > 1: the split's decode meets the target
    # Errors below the predicted gain and the decode slack: the split stands.
    assert choose_with({"prefill/concurrent": gain - 1.02}).prefill_sms == split.prefill_sms
    # Its prefill prediction's error above the gain: chunks.
    dec = choose_with({"prefill/concurrent": gain - 0.98})
    assert dec.chunk_tokens is not None and dec.reason.startswith("chunks finish the prefill")
    # Too few measurements are not evidence yet.
    assert choose_with({"prefill/concurrent": gain}, n=7).prefill_sms == split.prefill_sms
    # Its decode step's error eats the slack: that split would miss the target, so the search
    # bounds the splits' decode by the target less that error (`_split_decode_ok`), as the
    # choice against chunks does; a split with more decode SMs is taken if it still wins.
    err = slack - 0.98
    dec = choose_with({"decode/concurrent": err})
    assert dec.prefill_sms < split.prefill_sms and dec.chunk_tokens is None
    assert dec.predicted_decode_ms * (1.0 + err) <= target
    # An error no split's decode meets the target with: chunks.
    probe = SplitController(m, SPLITS, ControllerConfig(allow_time_slice=False))
    fewest_ms = min(probe._eval(s, P, D)[1] for s in SPLITS)
    dec = choose_with({"decode/concurrent": target / fewest_ms - 0.98})
    assert dec.chunk_tokens is not None and "misses the TBT target" in dec.reason
