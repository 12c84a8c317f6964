"""`overlap_max_step_ms`: with overlapped scheduling the engine launches step N+1 while step N
runs, except around a prefill-only step the JCT model predicts that long, which runs alone: the
steps in flight are answered before it is launched (its launch holds the engine thread until
near its end), and it is answered before the next step is planned (so a request arriving while
it runs can be chosen next). A prefill the runner gates for aborts (`ModelRunner.holds_host`)
is launched with nothing in flight whatever the limit, and overlapped after."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from test_split_executor import gen

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.executor.base import StepFailed
from runtime.request import Request, RequestKind

MS_PER_TOKEN = 1.0  # the JCT model the tests hold: a prefill of n new tokens takes n ms


class _HeldSerial:
    """The engine's serial executor on a device whose steps end only when the host waits for
    them (a long step as the host sees it): `results(block=False)` collects nothing and a
    blocking call one step. Everything else is the real executor's."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.ended: deque[Any] = deque()
        self.failing: set[str] = set()  # request ids whose step fails when collected
        self.num_launches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def launch(self, plan: Any) -> None:
        self.num_launches += 1
        self.real.launch(plan)
        self.ended.extend(self.real.results(True))  # the CPU runs it at once; held here

    @property
    def num_in_flight(self) -> int:
        return len(self.ended)

    def drain(self) -> list[Any]:
        out: list[Any] = []
        while self.ended:
            out += self.results(True)
        return out

    def results(self, block: bool) -> list[Any]:
        if not (block and self.ended):
            return []
        result = self.ended.popleft()
        if any(s.request.request_id in self.failing for s in result.plan.seqs):
            # As a device error found when collecting (runtime/executor/serial.py).
            raise StepFailed(result.plan, RuntimeError("device error"), rerun_ok=False)
        return [result]


class _Sink:
    """The engine's output sink: each output delivered, with the launches made before it."""

    def __init__(self) -> None:
        self.delivered: list[tuple[Any, int]] = []
        self.held: _HeldSerial | None = None

    def __call__(self, outs: list[Any]) -> None:
        assert self.held is not None
        self.delivered += [(o, self.held.num_launches) for o in outs]

    def launches_before(self, request_id: str) -> int:
        """How many steps had been launched when `request_id`'s last output was delivered."""
        return [n for o, n in self.delivered if o.request_id == request_id][-1]


def _step(eng: Engine) -> dict[str, Any]:
    """One loop iteration's outputs by request id: those `_step` returns and those it delivered
    before a launch that holds the engine thread."""
    sink: _Sink = eng._sink  # type: ignore[assignment]
    first = len(sink.delivered)
    returned = eng._step()
    outs = {o.request_id: o for o, _ in sink.delivered[first:]}
    outs.update({o.request_id: o for o in returned})
    return outs


def _engine(overlap_max_step_ms: float | None, **cfg: Any) -> tuple[Engine, list[tuple[str, int]]]:
    """An engine (not started: the test drives its steps) whose serial executor is held, whose
    JCT model prices a prefill at MS_PER_TOKEN a token and learns nothing, and which records,
    for each step it plans, the first request's id and the steps in flight at that moment."""
    config = EngineConfig(
        model="random:tiny",
        prefill_policy="srjf",
        block_size=4,
        num_kv_blocks=256,
        overlap_max_step_ms=overlap_max_step_ms,
        **{"prefill_token_budget": 256, **cfg},
    )
    sink = _Sink()
    eng = Engine(config, sink)
    held = sink.held = _HeldSerial(eng.serial)
    eng.serial = eng.executor = held  # type: ignore[assignment]
    jct = eng.jct_model
    jct.a_s, jct.b_s_per_token, jct.k_s_per_pair = 0.0, MS_PER_TOKEN / 1e3, 0.0
    jct.observe_batch = lambda items, device_s: None  # type: ignore[method-assign]
    planned: list[tuple[str, int]] = []
    schedule = eng.scheduler.schedule

    def spy(capacity: Any) -> Any:
        in_flight = held.num_in_flight
        plan = schedule(capacity)
        seqs = plan.prefill or plan.decode
        if seqs:
            planned.append((seqs[0].request.request_id, in_flight))
        return plan

    eng.scheduler.schedule = spy  # type: ignore[method-assign]
    return eng, planned


def _count_in_flight_at_launch(eng: Engine) -> list[int]:
    """The steps in flight at each launch from now on (appended as they come)."""
    counts: list[int] = []
    launch = eng.executor.launch

    def spy(plan: Any) -> None:
        counts.append(eng.executor.num_in_flight)
        launch(plan)

    eng.executor.launch = spy  # type: ignore[method-assign]
    return counts


def _score(rid: str, n: int, seed: int) -> Request:
    r = gen(rid, n, 1, seed=seed)
    return Request(rid, RequestKind.SCORE, r.prompt_token_ids, label_token_ids=[5, 6])


def test_a_long_prefill_is_collected_before_the_next_step_is_planned() -> None:
    # A budget of 210 tokens: one long prompt a step (a scoring prompt is not chunked here).
    eng, planned = _engine(overlap_max_step_ms=100.0, prefill_token_budget=210)
    eng.scheduler.add(_score("long-a", 200, 1))  # 200 ms predicted: long
    eng.scheduler.add(_score("long-b", 220, 2))
    eng._step()
    assert eng.executor.num_in_flight == 0  # collected: nothing planned ahead of it
    # A short request that arrived while long-a ran goes before long-b, under SRJF.
    eng.scheduler.add(_score("short", 20, 3))
    eng._step()
    assert planned == [("long-a", 0), ("short", 0)]
    stats = eng.fresh_stats()
    assert stats["num_steps_run_alone"] == 1  # "short" was planned ahead of
    assert stats["overlap_max_step_ms"] == 100.0


def test_without_a_limit_the_next_step_is_planned_while_a_long_one_runs() -> None:
    """The default: the step after long-a is chosen while long-a runs, before "short" came."""
    eng, planned = _engine(overlap_max_step_ms=None, prefill_token_budget=210)
    eng.scheduler.add(_score("long-a", 200, 1))
    eng.scheduler.add(_score("long-b", 220, 2))
    eng._step()
    assert eng.executor.num_in_flight == 1
    eng._step()  # plans long-b ahead, then waits for long-a
    eng.scheduler.add(_score("short", 20, 3))
    eng._step()
    assert [rid for rid, _ in planned] == ["long-a", "long-b", "short"]
    assert planned[1] == ("long-b", 1)
    assert eng.fresh_stats()["num_steps_run_alone"] == 0


def test_short_steps_are_still_planned_ahead() -> None:
    """Decode steps and prefills predicted under the limit keep the overlap."""
    eng, planned = _engine(overlap_max_step_ms=100.0)
    eng.scheduler.add(gen("chat", 30, 4, seed=1))  # a 30-ms prefill, then decodes
    for _ in range(4):
        eng._step()
        assert eng.executor.num_in_flight == 1
    assert all(rid == "chat" for rid, _ in planned)
    assert eng.fresh_stats()["num_steps_run_alone"] == 0


def test_no_limit_applies_without_overlap() -> None:
    eng, _ = _engine(overlap_max_step_ms=100.0, overlap_scheduling=False)
    eng.scheduler.add(_score("long-a", 200, 1))
    eng._step()
    assert eng.executor.num_in_flight == 0
    assert eng.fresh_stats()["num_steps_run_alone"] == 0  # nothing to undo


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="overlap_max_step_ms"):
        EngineConfig(model="random:tiny", overlap_max_step_ms=0.0)


def test_the_steps_in_flight_are_answered_before_a_long_step_is_launched() -> None:
    eng, _ = _engine(overlap_max_step_ms=100.0)
    in_flight_at_launch = _count_in_flight_at_launch(eng)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()  # a 30-ms step: overlapped, still in flight
    eng.scheduler.add(_score("long", 200, 2))
    outs = _step(eng)
    assert in_flight_at_launch == [0, 0]  # "short" was collected before "long" was launched
    assert outs["short"].finished and outs["long"].finished  # both answered in that iteration
    assert eng._sink.launches_before("short") == 1  # type: ignore[attr-defined]  (out first)
    assert eng.fresh_stats()["num_steps_run_alone"] == 1


def test_steps_with_decodes_never_run_alone() -> None:
    """A chat's steps keep the overlap whatever their size: their decodes read the tokens the
    step in flight samples."""
    eng, _ = _engine(overlap_max_step_ms=1e-3)  # every prefill counts as long
    eng.scheduler.add(gen("chat", 30, 6, seed=1))
    eng._step()  # its prefill alone: prefill-only, so it runs alone
    eng.scheduler.add(gen("chat-2", 30, 2, seed=2))
    eng._step()  # chat's decode with chat-2's prefill: overlapped
    assert eng.executor.num_in_flight == 1
    assert eng.fresh_stats()["num_steps_run_alone"] == 1


@pytest.mark.parametrize("failing", ["short", "long"])
def test_a_failure_around_a_step_that_runs_alone_loses_no_other_answer(failing: str) -> None:
    """A device error in the step in flight, found when it is collected before the long step's
    launch, fails it and the planned long step (planned while it ran, as one launched behind
    it would); the engine goes on. One in the long step itself fails only the long step."""
    eng, _ = _engine(overlap_max_step_ms=100.0)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()
    assert eng.executor.num_in_flight == 1
    eng.executor.failing.add(failing)
    eng.scheduler.add(_score("long", 200, 2))
    outs = _step(eng)
    assert outs["long"].finish_reason == "error"
    if failing == "short":
        assert outs["short"].finish_reason == "error"
    else:
        assert outs["short"].finished and outs["short"].label_probs is not None
    assert eng.executor.num_in_flight == 0 and not eng.scheduler.has_work()
    eng.block_manager.check_integrity()
    # The engine goes on: a new request is served.
    eng.scheduler.add(_score("after", 20, 3))
    outs = {}
    for _ in range(3):
        outs.update(_step(eng))
    assert outs["after"].finished and outs["after"].label_probs is not None


def _gate_at(eng: Engine, min_tokens: int) -> None:
    """The engine sees launches of prefills of `min_tokens` or more hold the host
    (`ModelRunner.holds_host`), as gated ones do on CUDA; this CPU runner's forwards still run
    ungated (the gate's CUDA events need a GPU)."""

    def holds_host(plan: Any) -> bool:
        return sum(s.num_new_tokens for s in plan.prefill) >= min_tokens

    eng.runner.holds_host = holds_host  # type: ignore[method-assign]


def test_a_gated_launch_answers_the_steps_in_flight_first_and_keeps_the_overlap_after() -> None:
    """Without a limit: a prefill the runner gates (its launch holds the engine thread until
    near its end) is launched with nothing in flight, so the step before it is answered then;
    the step after it is still planned while it runs."""
    eng, planned = _engine(overlap_max_step_ms=None, prefill_token_budget=210)
    _gate_at(eng, 150)
    in_flight_at_launch = _count_in_flight_at_launch(eng)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()  # not gated: overlapped, still in flight
    assert eng.executor.num_in_flight == 1
    eng.scheduler.add(_score("long-a", 190, 2))  # the shorter: first under SRJF
    eng.scheduler.add(_score("long-b", 200, 3))
    outs = _step(eng)
    assert outs["short"].finished
    # Delivered before long-a's launch, not with what follows it (that launch returns only
    # near the step's end on CUDA).
    assert eng._sink.launches_before("short") == 1  # type: ignore[attr-defined]
    assert in_flight_at_launch == [0, 0]
    assert eng.executor.num_in_flight == 1  # long-a not collected: the overlap after it stays
    eng._step()  # long-b planned while long-a is in flight (then gated: long-a answered first)
    assert planned[2] == ("long-b", 1)
    assert in_flight_at_launch == [0, 0, 0]
    stats = eng.fresh_stats()
    assert stats["num_drains_before_held_launch"] == 2
    assert stats["num_steps_run_alone"] == 0


def test_ungated_steps_keep_the_overlap() -> None:
    eng, _ = _engine(overlap_max_step_ms=None, prefill_token_budget=210)
    _gate_at(eng, 10_000)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()
    eng.scheduler.add(_score("long-a", 200, 2))
    eng._step()
    assert eng.executor.num_in_flight == 1
    assert eng.fresh_stats()["num_drains_before_held_launch"] == 0


def test_the_runner_gates_only_long_prefill_forwards_on_cuda() -> None:
    """`holds_host` follows the gate `_interrupt_for` applies: CUDA, a prefill forward of at
    least INTERRUPT_GATE_MIN_TOKENS tokens (decode rows counted when they merge into it)."""
    import torch

    from runtime import runner as runner_mod

    eng, _ = _engine(overlap_max_step_ms=None)
    runner = eng.runner
    assert not runner._gates(runner_mod.INTERRUPT_GATE_MIN_TOKENS)  # CPU: never
    cpu = runner.device
    try:
        runner.device = torch.device("cuda")  # only read for its type here
        assert runner._gates(runner_mod.INTERRUPT_GATE_MIN_TOKENS)
        assert not runner._gates(runner_mod.INTERRUPT_GATE_MIN_TOKENS - 1)
    finally:
        runner.device = cpu
    eng.runner._gates = lambda num_tokens: num_tokens >= 100  # type: ignore[method-assign]
    eng.scheduler.add(_score("long", 120, 1))
    eng.scheduler.add(_score("short", 40, 2))
    plan = eng.scheduler.schedule(eng.executor.capacity())
    assert runner.holds_host(plan) == (sum(s.num_new_tokens for s in plan.prefill) >= 100)
    interrupt = runner.interrupt
    runner.interrupt = None  # nothing to ask between layers: no gate
    try:
        assert not runner.holds_host(plan)
    finally:
        runner.interrupt = interrupt
