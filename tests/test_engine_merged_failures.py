"""The engine's fallback when steps that merge prefill parts with decodes keep failing while
their requests run fine alone (on CPU: a stand-in launch that raises on merged plans only).

Seen on the H200: FlashInfer's FA2 plan for some merged batches of the Qwen2.5-3B shape asked
for more workspace than the backend had; each such step was re-run one request at a time (77
in a 48-stream chat run, a third of its throughput) and nothing said so but the log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from test_split_executor import gen, serial_tokens, tokens_by_id

from runtime.config import EngineConfig
from runtime.engine import MERGED_STEP_FAILURES_BEFORE_FALLBACK, Engine
from runtime.request import EngineOutput


def engine_failing_when(fails: Callable[[Any, Any], str | None]) -> Engine:
    """A tiny CPU engine (not started: the test drives its steps) whose launches raise
    RuntimeError(message) when `fails(runner, plan)` returns a message."""
    eng = Engine(
        EngineConfig(model="random:tiny", prefill_policy="fcfs", block_size=4, num_kv_blocks=128),
        lambda outs: None,
    )
    runner = eng.runner
    launch = runner.launch

    def guarded(plan: Any, **kw: Any) -> Any:
        message = fails(runner, plan)
        if message:
            raise RuntimeError(message)
        return launch(plan, **kw)

    runner.launch = guarded  # type: ignore[method-assign]
    return eng


def test_merged_steps_that_keep_failing_fall_back_to_separate_forwards() -> None:
    merged_launches: list[int] = []

    def when_merged(runner: Any, plan: Any) -> str | None:
        if not runner.merges(plan):
            return None
        merged_launches.append(plan.step_id)
        return "Buffer overflow when allocating memory for tmp_v (stand-in)"

    eng = engine_failing_when(when_merged)
    reqs = [gen(f"r{i}", 10 + 3 * i, 12, seed=i) for i in range(6)]
    outs: list[EngineOutput] = []
    eng.scheduler.add(reqs[0])
    for r in reqs[1:]:  # each arrives while the earlier ones decode: a mixed step each
        for _ in range(3):
            outs += eng._step()
        eng.scheduler.add(r)
    for _ in range(300):
        if not eng.scheduler.has_work() and not eng.executor.num_in_flight:
            break
        outs += eng._step()

    # Three merged steps failed and were re-run one request at a time; then merging stopped,
    # so the later arrivals' mixed steps ran as separate forwards and nothing failed.
    assert len(merged_launches) == MERGED_STEP_FAILURES_BEFORE_FALLBACK == 3
    assert eng._num_failed_steps == 3 and eng._num_failed_requests == 0
    eng._publish_stats()  # the engine thread publishes at a fixed rate; this test drives it
    # what /admin/api/state shows
    reason = eng.stats()["fallbacks"].get("merged steps")
    assert reason is not None and "3 merged steps failed" in reason and "tmp_v" in reason
    assert reason.startswith(eng.runner.merge_off_reason)
    assert reason.endswith("run as separate forwards from now on (slower)")  # and what instead
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {r.request_id for r in reqs}
    assert all(o.error is None for o in finished.values())
    # The re-runs and the separate forwards gave the tokens of an engine that never failed.
    fresh = [gen(f"r{i}", 10 + 3 * i, 12, seed=i) for i in range(6)]
    assert tokens_by_id(outs) == serial_tokens(fresh)


def test_a_merged_step_failing_for_one_request_keeps_merging() -> None:
    """A request at fault fails alone (it fails alone too): merging is not to blame."""
    eng = engine_failing_when(
        lambda runner, plan: (
            "stand-in fault of one request"
            if any(s.request.request_id == "bad" for s in plan.seqs)
            else None
        )
    )
    runner = eng.runner
    eng.scheduler.add(gen("good", 12, 8, seed=1))
    outs: list[EngineOutput] = []
    for _ in range(3):
        outs += eng._step()
    eng.scheduler.add(gen("bad", 10, 8, seed=2))
    for _ in range(100):
        if not eng.scheduler.has_work() and not eng.executor.num_in_flight:
            break
        outs += eng._step()
    assert eng._num_failed_requests == 1 and runner.merge_off_reason is None
    finished = {o.request_id: o for o in outs if o.finished}
    assert finished["bad"].error is not None and finished["good"].error is None
