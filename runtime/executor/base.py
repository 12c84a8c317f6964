"""The executor interface of the engine's one step loop:

    plan = scheduler.schedule(executor.capacity())
    executor.launch(plan)                       # enqueue on the device, do not wait
    for result in executor.results(block):      # launched steps whose outputs are in
        scheduler.update(result.plan, result.output)

A step's results arrive after later steps were launched (overlapped scheduling); an executor
returns every launched plan exactly once, as one result or as several results that split its
seqs (the split executor returns a prefill and its decodes separately), in launch order per
request. A launch that raises does so as `StepFailed`, naming the plan it covered; that plan
is not in flight and the engine re-runs its requests one at a time with `run_alone`. A launch
the runner's `interrupt` stopped part-way raises `StepInterrupted` (eager prefill forwards on
the whole GPU, either executor); that plan is not in flight either, and its requests are being
aborted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from runtime.scheduler import RunnerOutput, StepCapacity, StepPlan


@dataclass(slots=True)
class StepResult:
    plan: StepPlan
    output: RunnerOutput
    device_s: float | None = None  # device time of the step (events), when measured
    idle_before_s: float | None = None  # device idle between the previous step and this one
    # It ran on a split's SM partition, not the whole GPU: its time says nothing about the
    # whole-GPU models (JCT, the decode step average the TBT cut uses).
    on_split: bool = False
    sms: int = 0  # SMs of the partition it ran on (0: the whole GPU)
    other_sms: int = 0  # SMs of the phase running beside it on the other partition (0: none)
    # Split executor, a step carrying decodes that continue the previous such step's (a
    # request decoding in both): device time from that step's end to this one's start, i.e.
    # what those decodes waited beyond their own steps (a layer slice or a whole prefill on
    # their stream, the host). A diagnostic (the step trace's `decode_gap_ms`); None otherwise.
    decode_gap_s: float | None = None
    # Split executor, a step whose decodes waited behind a layer slice (or the last one): the
    # wait the controller promised them, the heaviest slice and the decode step
    # (`SplitDecision.predicted_decode_ms`), which the engine reads against decode_gap_s plus
    # device_s (`StepPacer.slice_tail`); None otherwise.
    slice_promised_s: float | None = None
    # Split executor, a prefill run in layer slices (its device_s is None: its span is not one
    # step's device time): start to last slice, the decode steps between included, and the
    # controller's prediction of that span (what `prefill/layer_sliced` is scored on). None
    # otherwise; the step trace's `layer_sliced_span_ms` / `layer_sliced_predicted_ms`.
    layer_sliced_span_s: float | None = None
    layer_sliced_predicted_s: float | None = None
    # Split executor, a prefill on a split's partition: the controller's predicted prefill
    # there when it chose the split (the step trace's `split_predicted_ms`); None otherwise.
    split_predicted_s: float | None = None

    @property
    def is_prefill_only(self) -> bool:
        return bool(self.plan.prefill) and not self.plan.decode


class StepFailed(Exception):
    """Launching (or finishing) a step raised; `plan` holds the requests it covered. Nothing
    of it is in flight any more. `prefill_sms` is the split its work ran on (0: none).
    `rerun_ok`: the failure was raised by the host while enqueueing (the device state is as
    before it), so its requests may be re-run; False for a device error found when collecting
    (later steps may have read its results)."""

    def __init__(
        self, plan: StepPlan, cause: BaseException, prefill_sms: int = 0, rerun_ok: bool = True
    ) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.plan = plan
        self.cause = cause
        self.prefill_sms = prefill_sms
        self.rerun_ok = rerun_ok


class HeldFailure:
    """A StepFailed met after an executor's call had already taken other steps off the device:
    those go out first and the failure with the next `results`/`drain` call, so a failure
    never loses results already collected (their requests would hang and keep their KV). An
    executor counts a held failure in `num_in_flight`, so loops that collect until nothing is
    in flight reach it."""

    def __init__(self) -> None:
        self._failure: StepFailed | None = None

    @property
    def count(self) -> int:
        return self._failure is not None

    def hold(self, failure: StepFailed, collected: list[StepResult]) -> None:
        """Keep `failure` for the next call when `collected` has steps; else raise it now."""
        if not collected:
            raise failure
        self._failure = failure

    def raise_held(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


class StepInterrupted(Exception):
    """A launch stopped before layer `layer` because the runner's `interrupt` said so (every
    request of `plan` is being aborted, or the engine's stop deadline passed). Nothing of it
    is in flight; the K/V it wrote lies in blocks its requests' abort frees."""

    def __init__(self, plan: StepPlan, layer: int) -> None:
        super().__init__(f"step {plan.step_id} interrupted before layer {layer}")
        self.plan = plan
        self.layer = layer


class Executor(Protocol):
    name: str
    # Host ms of the latest launch's parts where the executor times them, else None (the
    # split executor, a prefill's start: its decision, the batch's build, the attention plan
    # and embedding, the decode step beside it, the first slice). Diagnostics for the step
    # trace (`launch_parts_ms`).
    launch_parts_ms: dict[str, float] | None
    # Beside `launch_parts_ms`, what may explain a slow start (else None): "slowest_piece",
    # the first slice's forward call that took the most host time ({layer, row_start, rows,
    # host_ms, num_pieces}, or {layer, layers, ...} for whole layers), and "allocs", what the
    # memory allocator did with the driver before the first slice and in it
    # ({"to_first_slice" | "first_slice": {mallocs, frees, retries, syncs}},
    # `StreamDevice.allocator_counts`; absent without such an allocator). A first slice's
    # enqueue took 54-88 ms of host time in 5 of 39 starts on an H100 at edc1adc, once with
    # the device idle behind it.
    launch_detail: dict[str, Any] | None

    def capacity(self) -> StepCapacity:
        """What the next step may hold."""
        ...

    def launch(self, plan: StepPlan) -> None:
        """Enqueue `plan` (non-empty) on the device without waiting for it. Raises
        StepFailed."""
        ...

    def results(self, block: bool) -> list[StepResult]:
        """Launched steps whose outputs have reached the host, oldest first. With `block`,
        waits until at least one has (if any is in flight). Raises StepFailed; a step that
        fails after others were collected in the same call fails with the next call
        (`HeldFailure`)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Launched steps (or parts) whose results were not returned yet."""
        ...

    def drain(self) -> list[StepResult]:
        """Wait for everything in flight; return its results. Raises StepFailed as `results`
        does (a failure after collected steps is held for the next call)."""
        ...

    def run_alone(self, plan: StepPlan) -> RunnerOutput:
        """Run `plan` now on the whole device and wait (re-runs after a failure)."""
        ...
