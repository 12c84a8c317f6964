"""Held launches: with overlapped scheduling the engine launches step N+1 while step N runs,
except that a prefill the runner gates for aborts (`ModelRunner.holds_host`: its launch holds
the engine thread until near its end) is launched with nothing in flight, the answers of the
steps drained before it delivered before its launch, and overlapped after. (The tests of
`overlap_max_step_ms`, which ran any long prefill-only step alone, went with the option in the
forty-fifth session.)"""

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


def _engine(**cfg: Any) -> tuple[Engine, list[tuple[str, int]]]:
    """An engine (not started: the test drives its steps) whose serial executor is held, whose
    JCT model prices a prefill at MS_PER_TOKEN a token and learns nothing, and which records,
    for each step it plans, the first request's id and the steps in flight at that moment."""
    config = EngineConfig(
        model="random:tiny",
        prefill_policy="srjf",
        block_size=4,
        num_kv_blocks=256,
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


def _gate_at(eng: Engine, min_tokens: int) -> None:
    """The engine sees launches of prefills of `min_tokens` or more hold the host
    (`ModelRunner.holds_host`), as gated ones do on CUDA; this CPU runner's forwards still run
    ungated (the gate's CUDA events need a GPU)."""

    def holds_host(plan: Any) -> bool:
        return sum(s.num_new_tokens for s in plan.prefill) >= min_tokens

    eng.runner.holds_host = holds_host  # type: ignore[method-assign]


def test_a_gated_launch_answers_the_steps_in_flight_first_and_keeps_the_overlap_after() -> None:
    """A prefill the runner gates (its launch holds the engine thread until near its end) is
    launched with nothing in flight, so the step before it is answered then; the step after it
    is still planned while it runs."""
    eng, planned = _engine(prefill_token_budget=210)
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


def test_ungated_steps_keep_the_overlap() -> None:
    eng, _ = _engine(prefill_token_budget=210)
    _gate_at(eng, 10_000)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()
    eng.scheduler.add(_score("long-a", 200, 2))
    eng._step()
    assert eng.executor.num_in_flight == 1
    assert eng.fresh_stats()["num_drains_before_held_launch"] == 0


@pytest.mark.parametrize("failing", ["short", "long"])
def test_a_failure_around_a_gated_launch_loses_no_other_answer(failing: str) -> None:
    """A device error in the step in flight, found when it is drained before the gated long
    step's launch, fails it and the planned long step (planned while it ran, as one launched
    behind it would); the engine goes on. One in the long step itself (collected the iteration
    after, the overlap kept) fails only the long step."""
    eng, _ = _engine(prefill_token_budget=210)
    _gate_at(eng, 150)
    eng.scheduler.add(_score("short", 30, 1))
    eng._step()
    assert eng.executor.num_in_flight == 1
    eng.executor.failing.add(failing)
    eng.scheduler.add(_score("long", 200, 2))
    outs = _step(eng)
    if failing == "short":
        assert outs["short"].finish_reason == "error"
    else:
        assert outs["short"].finished and outs["short"].label_probs is not None
        assert eng.executor.num_in_flight == 1  # long launched, still in flight
        outs.update(_step(eng))
    assert outs["long"].finish_reason == "error"
    assert eng.executor.num_in_flight == 0 and not eng.scheduler.has_work()
    eng.block_manager.check_integrity()
    # The engine goes on: a new request is served.
    eng.scheduler.add(_score("after", 20, 3))
    outs = {}
    for _ in range(3):
        outs.update(_step(eng))
    assert outs["after"].finished and outs["after"].label_probs is not None


def test_the_runner_gates_only_long_prefill_forwards_on_cuda() -> None:
    """`holds_host` follows the gate `_interrupt_for` applies: CUDA, a prefill forward of at
    least INTERRUPT_GATE_MIN_TOKENS tokens (decode rows counted when they merge into it)."""
    import torch

    from runtime import runner as runner_mod

    eng, _ = _engine()
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
