"""`SerialExecutor`: every step on the whole device (GPU, or the CPU), overlapped.

A launch enqueues the step on the engine's stream and returns at once; its sampled tokens
stay on the device, where the next step's decodes read them (runtime/runner.py token slots).
The engine keeps one step queued ahead of the one it collects, so while the GPU runs step N
the host applies step N-1's results and plans and launches step N+1. Two timing events per
step measure the device time of each step and the device's idle time between steps (the
engine publishes their totals: HTTP inter-token latency vs the device's own step time).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

from runtime.config import EngineConfig
from runtime.executor.base import HeldFailure, StepFailed, StepInterrupted, StepResult
from runtime.executor.streams import EventLike, StreamDevice
from runtime.model.llama import ForwardInterrupted
from runtime.runner import ModelRunner, PendingOutput
from runtime.scheduler import RunnerOutput, StepCapacity, StepPlan


@dataclass(slots=True)
class _Launched:
    plan: StepPlan
    pending: PendingOutput
    start: EventLike
    end: EventLike


class SerialExecutor:
    name = "serial"
    launch_parts_ms: dict[str, float] | None = None  # not timed by parts
    launch_detail: dict[str, Any] | None = None  # no starts to detail

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        device: StreamDevice,
        mixed_step_token_budget: int | None = None,
    ) -> None:
        """`mixed_step_token_budget`: the cap on a step that carries decodes
        (`EngineConfig.mixed_step_tokens` for the engine's device); None: the budget alone."""
        self.config = config
        self.runner = runner
        self.device = device
        self._capacity = StepCapacity(
            prefill_token_budget=config.prefill_token_budget,
            decodes_share_budget=True,
            hold_prefills=False,
            chunk_scoring=config.chunk_scoring_prefill,
            mixed_step_token_budget=mixed_step_token_budget,
        )
        self._inflight: deque[_Launched] = deque()
        self._held = HeldFailure()
        self._last_end: EventLike | None = None  # end event of the last collected step

    def capacity(self) -> StepCapacity:
        return self._capacity

    @property
    def prefill_token_budget(self) -> int:
        return self._capacity.prefill_token_budget

    def set_prefill_token_budget(self, num_tokens: int) -> None:
        self._capacity = dataclasses.replace(self._capacity, prefill_token_budget=num_tokens)

    @property
    def mixed_step_token_budget(self) -> int | None:
        return self._capacity.mixed_step_token_budget

    def set_mixed_step_token_budget(self, num_tokens: int | None) -> None:
        self._capacity = dataclasses.replace(self._capacity, mixed_step_token_budget=num_tokens)

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight) + self._held.count

    def launch(self, plan: StepPlan) -> None:
        start, end = self.device.event(), self.device.event()
        start.record()
        try:
            pending = self.runner.launch(plan, interruptible=True)
        except ForwardInterrupted as e:
            raise StepInterrupted(plan, e.layer) from e
        except Exception as e:  # noqa: BLE001 - the engine contains it to the culprit
            raise StepFailed(plan, e) from e
        end.record()
        self._inflight.append(_Launched(plan, pending, start, end))

    def results(self, block: bool) -> list[StepResult]:
        self._held.raise_held()
        out: list[StepResult] = []
        while self._inflight:
            head = self._inflight[0]
            if not head.pending.ready():
                if not block or out:
                    break
                head.pending.wait()
            self._inflight.popleft()
            try:
                out.append(self._result(head))
            except StepFailed as e:
                self._held.hold(e, out)  # raises unless steps before it go out now
                break
        return out

    def _result(self, f: _Launched) -> StepResult:
        try:
            output = f.pending.result()
        except Exception as e:  # noqa: BLE001 - an asynchronous device error
            raise StepFailed(f.plan, e, rerun_ok=False) from e
        f.end.synchronize()
        device_s = f.start.elapsed_time(f.end) / 1e3
        idle_s = None
        if self._last_end is not None:
            idle_s = max(0.0, self._last_end.elapsed_time(f.start) / 1e3)
        self._last_end = f.end
        return StepResult(f.plan, output, device_s, idle_s)

    def drain(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self.num_in_flight:
            try:
                out += self.results(block=True)
            except StepFailed as e:
                self._held.hold(e, out)
                break
        return out

    def run_alone(self, plan: StepPlan) -> RunnerOutput:
        self._last_end = None  # the idle gap before the next step is not the loop's
        return self.runner.run(plan)

    def stream(self) -> Any:
        return self.device.current_stream()
