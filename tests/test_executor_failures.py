"""A step that fails when collected after other steps were collected in the same call: both
executors hand out the steps before it first and raise its failure with the next call, so no
finished step's outputs are lost (its requests would hang and keep their KV blocks)."""

from __future__ import annotations

from typing import Any

import pytest
from test_split_executor import FakeDevice, fixed_split, gen, split_engine, split_step

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.executor.base import StepFailed
from runtime.executor.serial import SerialExecutor
from runtime.executor.streams import HostStreamDevice
from runtime.request import Request, RequestKind
from runtime.scheduler import StepPlan


class _Pending:
    """A finished step's output; `result()` raises for a failing one (as a device error found
    when collecting)."""

    def __init__(self, step_id: int, fails: bool) -> None:
        self.step_id, self.fails = step_id, fails

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def result(self) -> Any:
        if self.fails:
            raise RuntimeError(f"device error in step {self.step_id}")
        return f"output {self.step_id}"


class _Runner:
    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def launch(self, plan: StepPlan, interruptible: bool = False) -> _Pending:
        return _Pending(plan.step_id, plan.step_id in self.failing)


def _serial(failing: set[int], num_steps: int) -> SerialExecutor:
    ex = SerialExecutor(EngineConfig(model="random:tiny"), _Runner(failing), HostStreamDevice())
    for step_id in range(1, num_steps + 1):
        ex.launch(StepPlan(step_id))
    return ex


def test_serial_results_hand_out_the_steps_before_a_failure_first() -> None:
    ex = _serial({2}, 3)
    assert [r.plan.step_id for r in ex.results(block=False)] == [1]
    assert ex.num_in_flight == 2  # the held failure and step 3
    with pytest.raises(StepFailed) as failed:
        ex.results(block=False)
    assert failed.value.plan.step_id == 2 and not failed.value.rerun_ok
    assert [r.plan.step_id for r in ex.results(block=True)] == [3]
    assert ex.num_in_flight == 0


def test_serial_drain_hands_out_the_steps_before_a_failure_first() -> None:
    ex = _serial({3}, 3)
    assert [r.plan.step_id for r in ex.drain()] == [1, 2]
    assert ex.num_in_flight == 1
    with pytest.raises(StepFailed) as failed:
        ex.drain()
    assert failed.value.plan.step_id == 3 and ex.num_in_flight == 0


def test_a_failing_first_step_raises_at_once() -> None:
    ex = _serial({1}, 2)
    with pytest.raises(StepFailed) as failed:
        ex.results(block=True)
    assert failed.value.plan.step_id == 1
    assert [r.plan.step_id for r in ex.results(block=True)] == [2]


def test_split_results_hand_out_the_steps_before_a_failure_first() -> None:
    """Two decode steps on the split executor, both finished; the second fails when collected."""
    eng, ex, _ = split_engine(FakeDevice(), fixed_split())
    eng.scheduler.add(gen("a", 6, 8))
    split_step(eng)  # a's prefill, collected: a decodes from here
    plans = []
    for _ in range(2):  # two decode steps in flight (the second reads the first's token slot)
        plans.append(eng.scheduler.schedule(ex.capacity()))
        ex.launch(plans[-1])
    assert all(p.decode and not p.prefill for p in plans)
    collect = ex._collect

    def failing(f: Any) -> Any:
        if f.plan.step_id == plans[1].step_id:
            raise StepFailed(f.plan, RuntimeError("device error"), rerun_ok=False)
        return collect(f)

    ex._collect = failing  # type: ignore[method-assign]
    assert [r.plan.step_id for r in ex.results(block=False)] == [plans[0].step_id]
    assert ex.num_in_flight == 1
    with pytest.raises(StepFailed) as failed:
        ex.drain()
    assert failed.value.plan.step_id == plans[1].step_id and ex.num_in_flight == 0


def test_the_engine_applies_the_steps_before_a_failure_then_fails_only_its_requests() -> None:
    """The engine's drain (before re-running a failed launch, or switching executors) with two
    finished steps whose second fails: the first one's answer goes out, the second's request
    fails, and every KV block is back."""
    eng = Engine(
        EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64, prefill_token_budget=40),
        lambda outs: None,
    )
    runner_launch = eng.runner.launch

    class Failing:
        def __init__(self, pending: Any) -> None:
            self.pending = pending

        def __getattr__(self, name: str) -> Any:
            return getattr(self.pending, name)

        def result(self) -> Any:
            raise RuntimeError("device error")

    def launch(plan: StepPlan, interruptible: bool = False) -> Any:
        pending = runner_launch(plan, interruptible)
        return Failing(pending) if any(s.request.request_id == "s2" for s in plan.seqs) else pending

    eng.runner.launch = launch  # type: ignore[method-assign]
    for rid, seed in (("s1", 1), ("s2", 2)):
        ids = gen(rid, 30, 1, seed=seed).prompt_token_ids
        eng.scheduler.add(Request(rid, RequestKind.SCORE, ids, label_token_ids=[5, 6]))
    for _ in range(2):  # one request a step (40-token budget), both in flight
        eng.serial.launch(eng.scheduler.schedule(eng.serial.capacity()))
    assert eng.serial.num_in_flight == 2
    outs = {o.request_id: o for o in eng._drain()}
    assert outs["s1"].finished and outs["s1"].label_probs is not None
    assert outs["s2"].finish_reason == "error"
    assert eng.serial.num_in_flight == 0 and not eng.scheduler.has_work()
    eng.block_manager.check_integrity()
