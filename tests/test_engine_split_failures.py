"""The engine's handling of a failed split-mode step, on CPU: the split executor runs on a host
stand-in whose streams are labels, and a stand-in partition manager records what the engine
asks of it.

Seen on the H200: cuBLAS failed on a 12-SM decode partition. The engine must then re-run the
step's requests on the whole GPU and, when they all run fine there, take the split out of
service; when a request is at fault instead, fail that request and leave the split alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from test_split_executor import RecordingPartition, gen, split_engine

from runtime.engine import Engine
from runtime.executor.streams import HostStreamDevice
from runtime.partition import SplitChoice, SplitDecision
from runtime.request import EngineOutput

SPLIT = 64


class LabelledStreams(HostStreamDevice):
    """Host stand-in that remembers which stream label work is being issued on."""

    def __init__(self) -> None:
        self.current: Any = "host"

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        @contextlib.contextmanager
        def on() -> Iterator[None]:
            prev, self.current = self.current, stream
            try:
                yield
            finally:
                self.current = prev

        return on()


def split_mode_engine(fail_when: Any) -> tuple[Engine, RecordingPartition]:
    """An engine whose steps go through a split executor that puts every prefill and decode on
    split SPLIT (streams "P"/"D"); `fail_when(device, plan)` says when a launch raises."""
    device = LabelledStreams()
    green_ref: list[RecordingPartition] = []

    def choose(p: Any, d: Any) -> SplitChoice:
        # Like the real manager: a disabled split is never chosen again.
        if SPLIT in green_ref[0].disabled:
            return SplitChoice(SplitDecision(0), "host", "host", 132)
        return SplitChoice(SplitDecision(SPLIT), "P", "D", 132 - SPLIT)

    eng, ex, green = split_engine(device, choose)
    green_ref.append(green)
    runner = eng.runner
    launch, outputs_from_hidden = runner.launch, runner.outputs_from_hidden

    def guarded_launch(plan: Any, **kw: Any) -> Any:
        if fail_when(device, plan):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED (stand-in)")
        return launch(plan, **kw)

    def guarded_outputs(hidden: Any, wanting: Any, pending: Any) -> Any:
        # A split prefill's sampling runs on its prefill stream, outside `launch`.
        if fail_when(device, SimpleNamespace(seqs=wanting)):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED (stand-in)")
        return outputs_from_hidden(hidden, wanting, pending)

    runner.launch = guarded_launch  # type: ignore[method-assign]
    runner.outputs_from_hidden = guarded_outputs  # type: ignore[method-assign]
    return eng, green


def run_until_done(eng: Engine, max_steps: int = 300) -> list[EngineOutput]:
    outs: list[EngineOutput] = []
    for _ in range(max_steps):
        if not eng.scheduler.has_work() and not eng.executor.num_in_flight:
            break
        outs += eng._step()
    return outs


def test_a_split_that_fails_while_the_requests_run_fine_alone_is_disabled() -> None:
    eng, green = split_mode_engine(lambda dev, plan: dev.current == "D")
    reqs = [gen("a", 12, 5, seed=1), gen("b", 20, 5, seed=2)]
    for r in reqs:
        eng.scheduler.add(r)
    outs = run_until_done(eng)
    assert list(green.disabled) == [SPLIT]
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in green.disabled[SPLIT]
    # Nobody failed: the re-run on the whole GPU carried both requests to the end.
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {"a", "b"}
    assert all(o.error is None for o in finished.values())
    assert all(r.num_output_tokens == 5 for r in reqs)
    assert eng._num_failed_requests == 0 and eng._num_failed_steps == 1  # one, then no more


def test_a_request_at_fault_fails_alone_and_the_split_stays() -> None:
    def poisoned(dev: Any, plan: Any) -> bool:
        return any(s.request.request_id == "bad" for s in plan.seqs)

    eng, green = split_mode_engine(poisoned)
    eng.scheduler.add(gen("good", 12, 4, seed=1))
    eng.scheduler.add(gen("bad", 10, 4, seed=3))
    outs = run_until_done(eng)
    assert green.disabled == {}
    finished = {o.request_id: o for o in outs if o.finished}
    assert finished["bad"].error and "internal error" in finished["bad"].error
    assert finished["good"].error is None
    assert eng._num_failed_requests == 1
    eng._publish_stats()  # what /metrics exports (greenlane_engine_num_failed_requests)
    assert eng.stats()["num_failed_requests"] == 1
    assert eng.stats()["partition_disabled_splits"] == 0
