"""Concurrent prefill/decode execution on a pair of SM partitions (split mode).

One engine-loop iteration (`PDLoop.step`):
  1. no prefill in flight: plan decodes, then a prefill batch (`Scheduler.schedule_prefill`,
     which marks its requests in flight); ask `choose(prefill_plan, decode_plan)` for a split.
     A time-slicing choice (prefill_sms == 0) runs both parts as one monolithic step on the
     whole-GPU stream (what `partition=off` does); a split embeds the batch on the prefill
     stream and makes it the in-flight prefill. Time-slicing by layers (`layers_per_slice`
     set, both streams the whole GPU's) also puts the prefill in flight: its slices and the
     decode steps then alternate on one stream, so a decode waits at most one slice.
  2. launch prefill layer slices on the prefill stream, at most `max_queued_slices` ahead of
     the device, `layers_per_slice = max(1, slice_tokens // batch_tokens)` layers each, so
     the CPU returns quickly and keeps decode fed; the last slice computes the logits rows and
     records the prefill's completion event.
  3. run one decode step on the decode stream (the pair's while a prefill is in flight, else
     the stream of the split chosen for decode alone) and apply it; on a split's decode
     stream the runner replays decode graphs captured on that stream (captured on its first
     decode step there, `runner.ensure_split_graphs`); with nothing to decode, wait for the
     oldest queued slice instead of spinning.
  4. when the completion event has fired (`query()`, no device-wide sync), sample / score on
     the prefill stream and hand the requests to decode (`end_prefill` + `update`): their KV is
     already in the shared pool, nothing is copied.
Streams: a phase that changes stream makes the new stream wait on the old one (events), so
KV written on one partition is visible to the next user; the two streams of a pair never wait
on each other while a prefill is in flight. Timings come from events on each stream and are
reported through `observe` (the cost model's online refinement).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime.attention.base import ForwardBatch
from runtime.cost_model import TIME_SLICE, DecodeShape, PrefillShape
from runtime.request import RequestOutput
from runtime.scheduler import RunnerOutput, Scheduler, StepPlan


class EventLike(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...


class StreamDevice(Protocol):
    """The stream operations the loop needs (CUDA, or a host stand-in for CPU and tests)."""

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def event(self) -> EventLike: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...
    def current_stream(self) -> Any: ...
    def gemm_sms(self, sms: int) -> None:
        """The next matrix products run on `sms` SMs (0: the whole GPU)."""


class CudaStreamDevice:
    def __init__(self, gemm_sm_target: Any = None) -> None:
        """gemm_sm_target: a `runtime.blas_sm_target.BlasSmTarget` (None: cuBLAS plans every
        product for the whole GPU)."""
        self.gemm_sm_target = gemm_sm_target

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def gemm_sms(self, sms: int) -> None:
        if self.gemm_sm_target is not None:
            self.gemm_sm_target.set(sms)

    def event(self) -> EventLike:
        return torch.cuda.Event(enable_timing=True)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()


class _HostEvent:
    """Completes when recorded (host work is synchronous); times with perf_counter."""

    def __init__(self) -> None:
        self.t_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t_s = time.perf_counter()

    def query(self) -> bool:
        return self.t_s is not None

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        assert self.t_s is not None and end.t_s is not None
        return (end.t_s - self.t_s) * 1e3


class HostStreamDevice:
    """CPU stand-in: streams are labels, work runs inline, events complete at once."""

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> EventLike:
        return _HostEvent()

    def wait_stream(self, stream: Any, other: Any) -> None:
        return None

    def current_stream(self) -> Any:
        return "host"

    def gemm_sms(self, sms: int) -> None:
        self.last_gemm_sms = sms  # what a CUDA device would have planned products for


@dataclass(slots=True)
class SplitChoice:
    prefill_sms: int  # TIME_SLICE (0) = no split: one monolithic step on `prefill_stream`
    decode_sms: int
    prefill_stream: Any
    decode_stream: Any
    # Time-slicing by layers (prefill_sms TIME_SLICE, both streams the whole GPU's): the
    # prefill runs in flight, this many layers per slice, one decode step between slices.
    layers_per_slice: int | None = None


@dataclass(slots=True)
class _Inflight:
    plan: StepPlan
    choice: SplitChoice
    batch: ForwardBatch
    h: torch.Tensor  # [T, H] hidden state between slices (lives on the prefill stream)
    residual: torch.Tensor | None
    layers_per_slice: int
    start_event: EventLike
    next_layer: int = 0
    hidden_rows: torch.Tensor | None = None  # [N, H] final-normed rows needing an output
    slice_events: list[EventLike] = field(default_factory=list)
    done_event: EventLike | None = None
    overlapped_decode: bool = False  # a decode step ran while it was in flight


class StepFailed(Exception):
    """A part of a split-mode step raised; `plan` holds the requests it covered (its
    prefill is no longer in flight), for the engine's one-by-one re-run."""

    def __init__(self, plan: StepPlan, cause: BaseException, prefill_sms: int = TIME_SLICE) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.plan = plan
        self.prefill_sms = prefill_sms  # the split the failing work ran on (0: time-sliced)


# observe(stage, shape, sms, measured_ms, other_sms): the cost model's online refinement.
Observe = Callable[[str, PrefillShape | DecodeShape, int, float, int], None]
Choose = Callable[[StepPlan | None, StepPlan | None], SplitChoice]


class PDLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Any,  # runtime.runner.ModelRunner (build_batch, run, model, prefill_backend,
        #               outputs_from_hidden, ensure_split_graphs)
        device: StreamDevice,
        choose: Choose,
        observe: Observe | None = None,
        *,
        slice_tokens: int = 32768,
        max_queued_slices: int = 2,
        chunk_tokens: int | None = None,
        split_usable: Callable[[int], bool] | None = None,
    ) -> None:
        """split_usable(prefill_sms): False once the partition manager has taken that split out
        of service; decode steps beside an in-flight prefill on it then use the whole GPU."""
        self.scheduler = scheduler
        self.runner = runner
        self.model = runner.model
        self.device = device
        self.choose = choose
        self.observe = observe
        self.slice_tokens = slice_tokens
        self.max_queued_slices = max_queued_slices
        self.chunk_tokens = chunk_tokens
        self.split_usable = split_usable or (lambda _sms: True)
        self.inflight: _Inflight | None = None
        cur = device.current_stream()
        self._last_stream: dict[str, Any] = {"prefill": cur, "decode": cur}
        self.num_prefill_batches = 0
        self.num_split_prefills = 0
        self.num_layer_sliced_prefills = 0
        self.last_split = TIME_SLICE  # the split of the latest prefill start or decode step
        self.num_overlapped_decode_steps = 0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def enter(self, stream: Any) -> None:
        """Monolithic work ran on `stream` (after `fence(stream)`): order the loop after it."""
        self._last_stream = {"prefill": stream, "decode": stream}

    def fence(self, stream: Any) -> None:
        """Make `stream` wait for everything the loop queued (before monolithic work), and
        plan the products that follow for the whole GPU again."""
        self.device.gemm_sms(0)
        seen: list[Any] = []
        for other in self._last_stream.values():
            if other is not stream and all(other is not x for x in seen):
                self.device.wait_stream(stream, other)
                seen.append(other)

    def _use(self, phase: str, stream: Any) -> None:
        """`phase` runs on `stream` next: if it changes stream, order after the old one."""
        prev = self._last_stream[phase]
        if prev is not stream:
            self.device.wait_stream(stream, prev)
        self._last_stream[phase] = stream

    # ---- one iteration -----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs = self.scheduler.take_pending_outputs()
        if self.inflight is None:
            dplan = self.scheduler.schedule_decode()
            pplan = self.scheduler.schedule_prefill()
            outputs += self.scheduler.take_pending_outputs()
            if pplan.prefill:
                self.num_prefill_batches += 1
                try:
                    choice = self.choose(pplan, dplan if dplan.decode else None)
                    if choice.prefill_sms == TIME_SLICE and not choice.layers_per_slice:
                        return outputs + self._run_monolithic(pplan, dplan, choice.prefill_stream)
                    self._start_prefill(pplan, choice)
                except Exception as e:
                    self.inflight = None
                    self.scheduler.end_prefill(pplan)
                    merged = StepPlan(pplan.step_id, pplan.prefill, dplan.decode)
                    raise StepFailed(merged, e, self.last_split) from e
        else:
            dplan = self.scheduler.schedule_decode()
        self._guarded_pump()
        if dplan.decode:
            try:
                outputs += self._run_decode(dplan)
            except Exception as e:
                raise StepFailed(dplan, e, self.last_split) from e
        elif self.inflight is not None and not self._done():
            self._wait_progress()
        self._guarded_pump()
        if self.inflight is not None and self._done():
            f = self.inflight
            try:
                outputs += self._finish_prefill()
            except Exception as e:
                raise StepFailed(f.plan, e, f.choice.prefill_sms) from e
        return outputs

    def _guarded_pump(self) -> None:
        f = self.inflight
        try:
            self._pump()
        except Exception as e:
            assert f is not None
            self.inflight = None
            self.scheduler.end_prefill(f.plan)
            raise StepFailed(f.plan, e, f.choice.prefill_sms) from e

    def drain(self) -> list[RequestOutput]:
        """Complete the in-flight prefill (a mode switch to off, or shutdown)."""
        outputs: list[RequestOutput] = []
        with torch.inference_mode():
            while self.inflight is not None:
                self._pump()
                if self._done():
                    outputs += self._finish_prefill()
                else:
                    self._wait_progress()
        return outputs

    # ---- prefill ----------------------------------------------------------------------------
    def _start_prefill(self, plan: StepPlan, choice: SplitChoice) -> None:
        if choice.layers_per_slice and choice.prefill_sms == TIME_SLICE:
            self.num_layer_sliced_prefills += 1
        else:
            self.num_split_prefills += 1
        self.last_split = choice.prefill_sms
        stream = choice.prefill_stream
        self._use("prefill", stream)
        start = self.device.event()
        with self.device.context(stream):
            start.record()
            batch = self.runner.build_batch(plan.prefill, False)
            self.runner.prefill_backend.plan(batch)
            h = self.model.embed(batch.input_ids)
        num_tokens = int(batch.input_ids.shape[0])
        per_slice = choice.layers_per_slice or self.slice_tokens // max(num_tokens, 1)
        per_slice = max(1, min(self.model.num_layers, per_slice))
        self.inflight = _Inflight(plan, choice, batch, h, None, per_slice, start)

    def _pump(self) -> None:
        """Launch prefill slices while fewer than `max_queued_slices` are pending."""
        f = self.inflight
        if f is None or f.done_event is not None:
            return
        pending = sum(1 for e in f.slice_events if not e.query())
        num_layers = self.model.num_layers
        # Time-sliced by layers, prefill and decode share one stream: a second queued slice
        # would sit between a decode step and the GPU, so only one is queued ahead.
        max_queued = 1 if f.choice.layers_per_slice else self.max_queued_slices
        self.device.gemm_sms(f.choice.prefill_sms)
        with self.device.context(f.choice.prefill_stream):
            while pending < max_queued and f.next_layer < num_layers:
                end = min(num_layers, f.next_layer + f.layers_per_slice)
                f.h, f.residual = self.model.forward_layers(
                    f.h,
                    f.residual,
                    f.batch.positions,
                    self.runner.prefill_backend,
                    f.next_layer,
                    end,
                    self.chunk_tokens,
                )
                f.next_layer = end
                ev = self.device.event()
                if end == num_layers:
                    if any(s.needs_output for s in f.plan.prefill):
                        idx = f.batch.logits_indices
                        res = None if f.residual is None else f.residual[idx]
                        f.hidden_rows = self.model.final_norm(f.h[idx], res)
                    f.done_event = ev
                ev.record()
                f.slice_events.append(ev)
                pending += 1

    def _done(self) -> bool:
        f = self.inflight
        return f is not None and f.done_event is not None and f.done_event.query()

    def _wait_progress(self) -> None:
        """Block the host on the oldest pending slice (a stream event, not a device sync)."""
        f = self.inflight
        if f is None:
            return
        for e in f.slice_events:
            if not e.query():
                e.synchronize()
                return

    def _finish_prefill(self) -> list[RequestOutput]:
        f = self.inflight
        assert f is not None and f.done_event is not None
        self.inflight = None
        out = RunnerOutput()
        try:
            if f.hidden_rows is not None:
                self.device.gemm_sms(f.choice.prefill_sms)
                with self.device.context(f.choice.prefill_stream):
                    wanting = [s for s in f.plan.prefill if s.needs_output]
                    self.runner.outputs_from_hidden(f.hidden_rows, wanting, out)
        finally:
            self.scheduler.end_prefill(f.plan)
        if self.observe is not None and not f.choice.layers_per_slice:
            # (A layer-sliced prefill's span includes the decode steps between its slices:
            # not a prefill latency the cost model could learn from.)
            ms = f.start_event.elapsed_time(f.done_event)
            shape = PrefillShape.from_seqs(
                [(s.num_context_tokens, s.num_new_tokens) for s in f.plan.prefill],
                self.model.num_layers,
            )
            other = f.choice.decode_sms if f.overlapped_decode else 0
            self.observe("prefill", shape, f.choice.prefill_sms, ms, other)
        return self.scheduler.update(f.plan, out)

    # ---- decode -------------------------------------------------------------------------------
    def _run_decode(self, plan: StepPlan) -> list[RequestOutput]:
        f = self.inflight
        if f is not None and self.split_usable(f.choice.prefill_sms):
            split = f.choice
            stream, sms, other = split.decode_stream, split.decode_sms, split.prefill_sms
            f.overlapped_decode = True
            self.num_overlapped_decode_steps += 1
        else:
            split = self.choose(None, plan)
            stream, sms, other = split.decode_stream, split.decode_sms, 0
        self.last_split = split.prefill_sms
        self._use("decode", stream)
        # Products (and a first graph capture) planned for the decode partition's SMs.
        self.device.gemm_sms(0 if split.prefill_sms == TIME_SLICE else sms)
        t0, t1 = self.device.event(), self.device.event()
        with self.device.context(stream):
            if split.prefill_sms != TIME_SLICE:
                # A split's decode stream: decode graphs must be captured on it (a graph keeps
                # the partition it was captured on; the whole-GPU set would escape the split).
                # The first step here captures them, before t0 so it is not timed as decode.
                self.runner.ensure_split_graphs(stream, f"{split.prefill_sms}/{sms}")
            t0.record()
            out = self.runner.run(plan)  # ends in .tolist(): waits for this stream only
            t1.record()
        if self.observe is not None:
            t1.synchronize()
            kv = sum(s.num_context_tokens for s in plan.decode)
            shape = DecodeShape(len(plan.decode), kv, self.model.num_layers)
            self.observe("decode", shape, sms, t0.elapsed_time(t1), other)
        return self.scheduler.update(plan, out)

    def _run_monolithic(self, pplan: StepPlan, dplan: StepPlan, stream: Any) -> list[RequestOutput]:
        """Time-slicing: both parts as one step on the whole-GPU stream (as partition=off)."""
        self.scheduler.end_prefill(pplan)  # never in flight: it runs to completion here
        self.last_split = TIME_SLICE  # a failure here must not be blamed on an earlier split
        merged = StepPlan(step_id=pplan.step_id, prefill=pplan.prefill, decode=dplan.decode)
        self._use("prefill", stream)
        self._use("decode", stream)
        self.device.gemm_sms(0)
        with self.device.context(stream):
            out = self.runner.run(merged)
        return self.scheduler.update(merged, out)
