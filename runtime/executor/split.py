"""`SplitExecutor`: prefill and decode at the same time on a pair of SM partitions.

A launched plan is split in two:
  - its prefill part: the controller (`choose`) picks a split for it. Time-slicing (no split)
    runs the whole plan as one step on the whole-GPU stream, like the serial executor; so does
    chunked time-slicing, whose chunk the engine asked the controller for before planning the
    step and used as the step's prefill token cap (`StepPacer.auto_capacity`,
    runtime/partition/pacing.py). A split starts the prefill *in flight* on the prefill
    partition's stream: it is embedded, then its layers are launched in slices
    (`layers_per_slice = max(1, slice_tokens // batch tokens)`), at most `max_queued_slices`
    ahead of the device, so the host returns quickly and keeps decode fed. Time-slicing by
    layers (`layers_per_slice` from the controller, both streams the whole GPU's) also puts it
    in flight: its slices and the decode steps then alternate on one stream, so a decode waits
    at most one slice. While a prefill is in flight the capacity offers no prefill budget, and
    the scheduler holds its requests.
  - its decode part: launched at once on the decode stream of the split in flight (else of the
    split the controller picks for decode alone), replaying that stream's own decode graphs (a
    graph keeps the partition it was captured on). Decode steps queue back to back on it,
    overlapped with the host like the serial executor's.
When the prefill's completion event has fired (`query()`, no device-wide sync), its logits
rows are sampled / scored on the prefill stream and its result is returned with the others.
A prefill in flight whose requests have all finished (aborted: a client gone) launches no
more slices; it comes back with no outputs once what was queued has run. A time-sliced whole
step is interruptible between layers as the serial executor's is (`StepInterrupted`).
Streams: a phase that changes stream makes the new stream wait on the old one (events), so KV
written on one partition is visible to the next user; the two streams of a pair never wait on
each other while a prefill is in flight. Timings come from events on each stream and go to
`observe` (the cost model's online refinement) when the step is collected.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.attention.base import ForwardBatch
from runtime.config import EngineConfig
from runtime.executor.base import HeldFailure, StepFailed, StepInterrupted, StepResult
from runtime.executor.streams import EventLike, StreamDevice
from runtime.model.llama import ForwardInterrupted, RowsKV
from runtime.partition import TIME_SLICE, SplitChoice
from runtime.partition.cost_model import DecodeShape, PrefillShape, num_row_chunks
from runtime.runner import PendingOutput
from runtime.scheduler import RunnerOutput, StepCapacity, StepPlan

log = logging.getLogger("greenlane.split")


@dataclass(slots=True)
class _Prefill:
    """The prefill in flight."""

    plan: StepPlan
    choice: SplitChoice
    batch: ForwardBatch
    h: torch.Tensor  # [T, H] hidden state between slices (lives on the prefill stream)
    residual: torch.Tensor | None
    layers_per_slice: int
    start_event: EventLike
    next_layer: int = 0
    # Sub-layer slices (`SplitDecision.slice_ends`): where each slice ends in hybrid chunks
    # counted layer after layer (empty: whole layers), the next slice's index, chunks a
    # layer, the next row of `next_layer`, and that layer's keys and values between pieces.
    slice_ends: tuple[int, ...] = ()
    next_slice: int = 0
    num_chunks: int = 0
    next_row: int = 0
    layer_kv: RowsKV | None = None
    abandoned: bool = False  # its requests all finished before its last slice: no outputs
    hidden_rows: torch.Tensor | None = None  # [N, H] final-normed rows needing an output
    slice_events: list[EventLike] = field(default_factory=list)
    done_event: EventLike | None = None
    overlapped_decode: bool = False  # a decode step ran while it was in flight
    # The decode steps launched beside it (count, summed batch and KV tokens): their mean
    # shape is the neighbour load the cost model's interference term reads (`_collect`).
    num_beside: int = 0
    batch_beside: int = 0
    kv_beside: int = 0


@dataclass(slots=True)
class _Launched:
    """A step whose outputs are on their way to the host."""

    kind: str  # "decode" | "whole" (time-sliced plan) | "prefill" (a finished split prefill)
    plan: StepPlan
    pending: PendingOutput
    start: EventLike
    end: EventLike
    sms: int  # SMs it ran on (prefill or decode partition; 0 = the whole GPU)
    other_sms: int = 0  # SMs of the phase running beside it (0: none)
    layer_sliced: bool = False
    # A layer-sliced prefill: the controller's predicted completion (its slices and the decode
    # steps between them); a prefill on a split: its predicted prefill on the split's SMs, as
    # the controller weighed it (`SplitDecision.predicted_prefill_ms`); NaN otherwise.
    predicted_ms: float = math.nan
    on_split: bool = False  # ran on a split's partition (not the whole GPU)
    neighbour: DecodeShape | None = None  # a split prefill: the mean decode step beside it
    abandoned: bool = False  # a prefill stopped part-way: no outputs, its time not a step's
    # A decode step behind a layer slice: the wait the controller promised it (ms), else NaN
    # (`StepResult.slice_promised_s`).
    promised_wait_ms: float = math.nan


# observe(stage, shape, sms, measured_ms, other_sms[, neighbour shape | None]): the cost
# model's online refinement (`CostModel.observe`).
Observe = Callable[..., None]
# score(kind, predicted_ms, measured_ms): a choice's prediction against its measured time,
# recorded per kind without refining the model (`GreenContextPartition.score`).
Score = Callable[[str, float, float], None]
Choose = Callable[[StepPlan | None, StepPlan | None], SplitChoice]


def _count_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """after - before, per count (`StreamDevice.allocator_counts`)."""
    return {name: after[name] - before.get(name, 0) for name in after}


class SplitExecutor:
    name = "split"
    launch_parts_ms: dict[str, float] | None = None  # (`Executor.launch_parts_ms`)
    launch_detail: dict[str, Any] | None = None  # (`Executor.launch_detail`)

    def __init__(
        self,
        config: EngineConfig,
        runner: Any,  # runtime.runner.ModelRunner
        device: StreamDevice,
        choose: Choose,
        observe: Observe | None = None,
        *,
        split_usable: Callable[[int], bool] | None = None,
        score: Score | None = None,
    ) -> None:
        """choose(prefill plan, decode plan): the controller's split for the next prefill (or
        decode-only) launch. split_usable(prefill_sms): False once the partition manager has
        taken that split out of service; decodes beside an in-flight prefill on it then use
        the whole GPU. score: where a layer-sliced prefill's completion is scored against
        its prediction."""
        self.config = config
        self.runner = runner
        self.model = runner.model
        self.device = device
        self.choose = choose
        self.observe = observe
        self.score = score
        self.slice_tokens = config.pd_slice_tokens
        self.max_queued_slices = config.pd_max_queued_slices
        self.chunk_tokens, self.stream_rows_above = config.hybrid_form()
        self.split_usable = split_usable or (lambda _sms: True)
        self.prefill: _Prefill | None = None
        self._queue: deque[_Launched] = deque()
        self._held = HeldFailure()  # a collect failure behind steps already collected
        cur = device.current_stream()
        self._last_stream: dict[str, Any] = {"prefill": cur, "decode": cur}
        self.num_prefill_batches = 0
        self.num_split_prefills = 0
        self.num_layer_sliced_prefills = 0
        self.num_sub_layer_sliced_prefills = 0  # of those, in row pieces of each layer
        self.num_overlapped_decode_steps = 0
        self.num_abandoned_prefills = 0  # in flight when their requests were all aborted
        self.last_split = TIME_SLICE  # the split of the latest prefill start or decode launch
        self._prompt_pending: PendingOutput | None = None  # prompt logprobs of the prefill
        # The latest collected step that carried decodes: its end event and its requests
        # (`decode_gap_s` of the next one that continues any of them).
        self._last_decode: tuple[EventLike, frozenset[str]] | None = None
        self.prefill_token_budget = config.prefill_token_budget  # lowered at run time only
        # A layer-sliced prefill's last slice was enqueued and no decode step after it yet:
        # the next step must be decode-only, or a decode waits that slice and a whole prefill
        # step (`capacity`).
        self._decode_owed = False
        # The promise of the layer-sliced prefill whose last slice is enqueued, for the decode
        # step after it: what that step waits at most (`SplitDecision.predicted_decode_ms`,
        # ms); NaN once a step is launched after the slice.
        self._owed_wait_ms = math.nan

    def set_prefill_token_budget(self, num_tokens: int) -> None:
        self.prefill_token_budget = num_tokens

    # ---- interface ----------------------------------------------------------------------------
    def capacity(self) -> StepCapacity:
        """No prefill budget while a prefill is in flight, nor for the step right after a
        layer-sliced prefill whose last slice no decode step has followed yet: slices promise
        a decode waits at most one slice. On the H200 (3B, plan z at 8c86337) the step planned
        the moment the last slice finished carried prefill (51-86 ms), and gaps between decode
        steps around a layer-sliced prefill reached 118-149 ms for an 80-ms target. Owed
        once: with no decodes to plan, the step after takes prefill again."""
        budget = self.prefill_token_budget if self.prefill is None else 0
        if self.prefill is None and self._decode_owed:
            self._decode_owed = False
            budget = 0
        return StepCapacity(
            prefill_token_budget=budget,
            decodes_share_budget=False,
            hold_prefills=True,
            chunk_scoring=False,  # a long scoring prompt runs beside decode, not before it
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._queue) + (self.prefill is not None) + self._held.count

    @property
    def busy(self) -> bool:
        return self.num_in_flight > 0

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> None:
        self.launch_parts_ms = None
        self.launch_detail = None
        dplan = StepPlan(plan.step_id, decode=plan.decode) if plan.decode else None
        parts: dict[str, float] | None = None
        allocs0 = None
        if plan.prefill:
            self._owed_wait_ms = math.nan  # (a prefill's step: not the owed decode step)
            pplan = StepPlan(plan.step_id, prefill=plan.prefill)
            self.num_prefill_batches += 1
            try:
                t0 = time.perf_counter()
                choice = self.choose(pplan, dplan)
                if choice.prefill_sms == TIME_SLICE and not choice.layers_per_slice:
                    self._launch_whole(plan, choice.prefill_stream)
                    return
                parts = {"choose": (time.perf_counter() - t0) * 1e3}
                # (Read here, at a start only: chunked steps launch often.)
                allocs0 = self.device.allocator_counts()
                self._start_prefill(pplan, choice, parts)
            except StepInterrupted:
                raise
            except Exception as e:  # noqa: BLE001 - the engine re-runs the plan's requests
                self.prefill = None
                raise StepFailed(plan, e, self.last_split) from e
        t0 = time.perf_counter()
        if dplan is not None:
            try:
                self._launch_decode(dplan)
            except Exception as e:  # noqa: BLE001
                raise StepFailed(dplan, e, self.last_split) from e
        allocs1 = self.device.allocator_counts() if parts is not None else None
        pieces: list[dict[str, float]] | None = [] if parts is not None else None
        t1 = time.perf_counter()  # (after that read: the first slice's time is its own)
        self._guarded_pump(pieces)
        if parts is not None:
            parts["decode"] = (t1 - t0) * 1e3
            parts["first_slice"] = (time.perf_counter() - t1) * 1e3
            self.launch_parts_ms = parts
            detail: dict[str, Any] = {}
            if pieces:
                slowest = max(pieces, key=lambda x: x["host_ms"])
                detail["slowest_piece"] = {**slowest, "num_pieces": len(pieces)}
            if allocs0 is not None and allocs1 is not None:
                allocs2 = self.device.allocator_counts()
                assert allocs2 is not None
                detail["allocs"] = {
                    "to_first_slice": _count_deltas(allocs0, allocs1),
                    "first_slice": _count_deltas(allocs1, allocs2),
                }
            self.launch_detail = detail

    @torch.inference_mode()
    def results(self, block: bool) -> list[StepResult]:
        self._held.raise_held()
        out: list[StepResult] = []
        while True:
            self._guarded_pump()
            if self.prefill is not None and self._prefill_done():
                self._finish_prefill()
            while self._queue and self._queue[0].pending.ready():
                try:
                    out.append(self._collect(self._queue.popleft()))
                except StepFailed as e:
                    self._held.hold(e, out)  # raises unless steps before it go out now
                    return out
            if out or not block or self.num_in_flight == 0:
                return out
            if self._queue:
                self._queue[0].pending.wait()
            else:
                self._wait_progress()

    def drain(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self.num_in_flight:
            try:
                out += self.results(block=True)
            except StepFailed as e:
                self._held.hold(e, out)
                return out
        self._last_decode = None  # (the executor may sit unused: no gap across that)
        return out

    def run_alone(self, plan: StepPlan) -> RunnerOutput:
        """Run on the whole GPU's stream after everything the executor queued."""
        stream = self.device.current_stream()
        self.fence(stream)
        with self.device.context(stream):
            out = self.runner.run(plan)
        self.enter(stream)
        return out

    # ---- streams ------------------------------------------------------------------------------
    def enter(self, stream: Any) -> None:
        """Work ran on `stream` (after `fence(stream)`): order what follows after it."""
        self._last_stream = {"prefill": stream, "decode": stream}

    def fence(self, stream: Any) -> None:
        """Make `stream` wait for everything the executor queued (before other work there)."""
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

    # ---- launches -----------------------------------------------------------------------------
    def _launch_whole(self, plan: StepPlan, stream: Any) -> None:
        """Time-slicing: both parts as one step on the whole-GPU stream (as partition=off)."""
        self.last_split = TIME_SLICE  # a failure here must not be blamed on an earlier split
        self._use("prefill", stream)
        self._use("decode", stream)
        start, end = self.device.event(), self.device.event()
        with self.device.context(stream):
            start.record()
            try:
                pending = self.runner.launch(plan, interruptible=True)
            except ForwardInterrupted as e:
                raise StepInterrupted(plan, e.layer) from e
            end.record()
        self._queue.append(_Launched("whole", plan, pending, start, end, TIME_SLICE))

    def _launch_decode(self, plan: StepPlan) -> None:
        promised_ms = self._promised_wait_ms()
        self._owed_wait_ms = math.nan
        self._decode_owed = False  # (queued behind any slice enqueued before it)
        f = self.prefill
        if f is not None and self.split_usable(f.choice.prefill_sms):
            split = f.choice
            stream, sms, other = split.decode_stream, split.decode_sms, split.prefill_sms
            f.overlapped_decode = True
            f.num_beside += 1
            f.batch_beside += len(plan.decode)
            f.kv_beside += sum(s.num_context_tokens for s in plan.decode)
            self.num_overlapped_decode_steps += 1
        else:
            split = self.choose(None, plan)
            stream, sms, other = split.decode_stream, split.decode_sms, 0
        self.last_split = split.prefill_sms
        self._use("decode", stream)
        t0, t1 = self.device.event(), self.device.event()
        with self.device.context(stream):
            if split.prefill_sms != TIME_SLICE:
                # A split's decode stream: decode graphs must be captured on it (a graph keeps
                # the partition it was captured on; the whole-GPU set would escape the split).
                # The first step here captures them, before t0 so it is not timed as decode.
                self.runner.ensure_split_graphs(stream, f"{split.prefill_sms}/{sms}")
            t0.record()
            pending = self.runner.launch(plan)
            t1.record()
        self._queue.append(
            _Launched(
                "decode",
                plan,
                pending,
                t0,
                t1,
                sms,
                other,
                on_split=split.prefill_sms != TIME_SLICE,
                promised_wait_ms=promised_ms,
            )
        )

    def _start_prefill(
        self, plan: StepPlan, choice: SplitChoice, parts_ms: dict[str, float]
    ) -> None:
        """Build, plan and embed the prefill (its slices follow from `_pump`); its host
        time by part into `parts_ms`."""
        if choice.layers_per_slice and choice.prefill_sms == TIME_SLICE:
            self.num_layer_sliced_prefills += 1
        else:
            self.num_split_prefills += 1
        self.last_split = choice.prefill_sms
        stream = choice.prefill_stream
        self._use("prefill", stream)
        start = self.device.event()
        t0 = time.perf_counter()
        with self.device.context(stream):
            start.record()
            batch = self.runner.build_batch(plan.prefill, [])
            t1 = time.perf_counter()
            # Guarded: a whole step still in flight may not have consumed the prefill
            # backend's staged plan copies yet.
            self.runner.plan_attention(self.runner.prefill_backend, batch)
            h = self.model.embed(batch.input_ids)
        t2 = time.perf_counter()
        parts_ms["build"] = (t1 - t0) * 1e3
        parts_ms["plan_embed"] = (t2 - t1) * 1e3
        num_tokens = int(batch.input_ids.shape[0])
        per_slice = choice.layers_per_slice or self.slice_tokens // max(num_tokens, 1)
        per_slice = max(1, min(self.model.num_layers, per_slice))
        self.prefill = _Prefill(plan, choice, batch, h, None, per_slice, start)
        ends, chunk = choice.slice_ends, self.chunk_tokens
        if ends and chunk is not None:
            num_chunks = num_row_chunks(num_tokens, chunk)
            streams = self.model.streams_rows(
                num_tokens, self.runner.prefill_backend, chunk, self.stream_rows_above
            )
            if streams and ends[-1] == num_chunks * self.model.num_layers:
                self.prefill.slice_ends = ends
                self.prefill.num_chunks = num_chunks
                self.prefill.layers_per_slice = 1
                self.num_sub_layer_sliced_prefills += 1
            else:
                # The controller is told whether a batch streams its rows and how many
                # (`rows`): a mismatch here is a bug, run whole layers rather than fail.
                log.warning(
                    "sub-layer slices (%d chunks in all) asked for a prefill of %d tokens "
                    "that %s: whole layers instead",
                    ends[-1],
                    num_tokens,
                    "has other chunks" if streams else "does not stream its rows",
                )

    def _guarded_pump(self, pieces: list[dict[str, float]] | None = None) -> None:
        f = self.prefill
        try:
            self._pump(pieces)
        except Exception as e:  # noqa: BLE001 - the engine re-runs the prefill's requests
            assert f is not None
            self.prefill = None
            raise StepFailed(f.plan, e, f.choice.prefill_sms) from e

    def _pump(self, pieces: list[dict[str, float]] | None = None) -> None:
        """Launch prefill slices while fewer than `max_queued_slices` are pending. `pieces`:
        where given, each forward call's host time is appended ({layer, row_start, rows,
        host_ms}; a whole-layer slice: {layer, layers, host_ms}), to find a slow enqueue."""
        f = self.prefill
        if f is None or f.done_event is not None:
            return
        if all(s.request.is_finished for s in f.plan.prefill):
            self._abandon(f)
            return
        pending = sum(1 for e in f.slice_events if not e.query())
        num_layers = self.model.num_layers
        # Time-sliced by layers, prefill and decode share one stream: a second queued slice
        # would sit between a decode step and the GPU, so only one is queued ahead.
        max_queued = 1 if f.choice.layers_per_slice else self.max_queued_slices
        with self.device.context(f.choice.prefill_stream):
            while pending < max_queued and f.next_layer < num_layers:
                if f.slice_ends:
                    chunk = self.chunk_tokens
                    assert chunk is not None
                    num_rows, per_layer = f.h.shape[0], f.num_chunks
                    # One slice: a piece of each layer it touches, up to its end.
                    stop = f.slice_ends[f.next_slice]
                    f.next_slice += 1
                    while f.next_layer * per_layer + f.next_row // chunk < stop:
                        layer = f.next_layer
                        row_end = min(num_rows, min(per_layer, stop - layer * per_layer) * chunk)
                        t_piece = time.perf_counter() if pieces is not None else 0.0
                        f.h, f.layer_kv = self.model.forward_layer_rows(
                            f.h,
                            f.residual,
                            f.batch.positions,
                            self.runner.prefill_backend,
                            layer,
                            f.next_row,
                            row_end,
                            chunk,
                            f.layer_kv,
                        )
                        if pieces is not None:
                            pieces.append(
                                {
                                    "layer": layer,
                                    "row_start": f.next_row,
                                    "rows": row_end - f.next_row,
                                    "host_ms": (time.perf_counter() - t_piece) * 1e3,
                                }
                            )
                        f.residual = None  # one stream from the first piece on
                        done = row_end >= num_rows
                        f.next_row = 0 if done else row_end
                        f.next_layer += 1 if done else 0
                    end = f.next_layer
                else:
                    end = min(num_layers, f.next_layer + f.layers_per_slice)
                    t_piece = time.perf_counter() if pieces is not None else 0.0
                    f.h, f.residual = self.model.forward_layers(
                        f.h,
                        f.residual,
                        f.batch.positions,
                        self.runner.prefill_backend,
                        f.next_layer,
                        end,
                        self.chunk_tokens,
                        self.stream_rows_above,
                    )
                    if pieces is not None:
                        pieces.append(
                            {
                                "layer": f.next_layer,
                                "layers": end - f.next_layer,
                                "host_ms": (time.perf_counter() - t_piece) * 1e3,
                            }
                        )
                f.next_layer = end
                ev = self.device.event()
                if end == num_layers:
                    self._final_rows(f)
                    f.done_event = ev
                    self._owe_decode(f)
                ev.record()
                f.slice_events.append(ev)
                pending += 1

    def _abandon(self, f: _Prefill) -> None:
        """Every request of the prefill in flight finished (aborted) before its last slice:
        launch no more; it is done once what was queued has run (its blocks stay held until
        then: the scheduler frees a lease only when no launched step uses it)."""
        f.abandoned = True
        self.num_abandoned_prefills += 1
        ev = self.device.event()
        with self.device.context(f.choice.prefill_stream):
            ev.record()
        f.slice_events.append(ev)
        f.done_event = ev
        self._owe_decode(f)

    def _owe_decode(self, f: _Prefill) -> None:
        """`f`'s last slice is enqueued: a layer-sliced prefill owes the decodes a step
        (`capacity`) and keeps its promise for it (`_promised_wait_ms`)."""
        self._decode_owed = bool(f.choice.layers_per_slice)
        sliced = f.choice.layers_per_slice and f.choice.prefill_sms == TIME_SLICE
        self._owed_wait_ms = f.choice.decision.predicted_decode_ms if sliced else math.nan

    def _promised_wait_ms(self) -> float:
        """What the controller promised a decode step launched now waits behind a layer
        slice (the heaviest slice and the step: `SplitDecision.predicted_decode_ms`, ms):
        that of the layer-sliced prefill in flight, or of the one whose last slice no step
        has followed yet; NaN otherwise."""
        f = self.prefill
        if f is not None:
            sliced = f.choice.layers_per_slice and f.choice.prefill_sms == TIME_SLICE
            return f.choice.decision.predicted_decode_ms if sliced else math.nan
        return self._owed_wait_ms

    def _final_rows(self, f: _Prefill) -> None:
        """After the last slice: the final-normed rows needing an output (and the prompt
        logprobs of sequences asking for them, which need every row)."""
        wants_prompt = any(s.request.sampling.prompt_logprobs is not None for s in f.plan.prefill)
        if wants_prompt:
            final = self.model.final_norm(f.h, f.residual)
            self._prompt_pending = PendingOutput(self.runner.device)
            self.runner.prompt_logprobs(final, f.batch, f.plan.prefill, self._prompt_pending)
            if any(s.needs_output for s in f.plan.prefill):
                f.hidden_rows = final[f.batch.logits_indices]
        elif any(s.needs_output for s in f.plan.prefill):
            idx = f.batch.logits_indices
            res = None if f.residual is None else f.residual[idx]
            f.hidden_rows = self.model.final_norm(f.h[idx], res)

    def _prefill_done(self) -> bool:
        f = self.prefill
        return f is not None and f.done_event is not None and f.done_event.query()

    def _wait_progress(self) -> None:
        """Block the host on the oldest pending slice (a stream event, not a device sync)."""
        f = self.prefill
        if f is None:
            return
        for e in f.slice_events:
            if not e.query():
                e.synchronize()
                return

    def _finish_prefill(self) -> None:
        """The prefill's layers are done: sample / score its rows on the prefill stream."""
        f = self.prefill
        assert f is not None and f.done_event is not None
        self.prefill = None
        try:
            pending = self._prompt_pending or PendingOutput(self.runner.device)
            self._prompt_pending = None
            with self.device.context(f.choice.prefill_stream):
                if f.hidden_rows is not None and not f.abandoned:
                    wanting = [s for s in f.plan.prefill if s.needs_output]
                    self.runner.outputs_from_hidden(f.hidden_rows, wanting, pending)
                pending.seal()
                self.runner.track_grammar_samples(pending)
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f.plan, e, f.choice.prefill_sms) from e
        sliced = bool(f.choice.layers_per_slice)
        other = f.choice.decode_sms if f.overlapped_decode else 0
        neighbour = None
        if f.num_beside:
            n = f.num_beside
            neighbour = DecodeShape(
                round(f.batch_beside / n), round(f.kv_beside / n), self.model.num_layers
            )
        self._queue.append(
            _Launched(
                "prefill",
                f.plan,
                pending,
                f.start_event,
                f.done_event,
                f.choice.prefill_sms,
                other,
                layer_sliced=sliced,
                predicted_ms=f.choice.decision.predicted_prefill_ms
                if sliced or f.choice.prefill_sms != TIME_SLICE
                else math.nan,
                on_split=f.choice.prefill_sms != TIME_SLICE,
                neighbour=neighbour,
                abandoned=f.abandoned,
            )
        )

    # ---- results ------------------------------------------------------------------------------
    def _collect(self, f: _Launched) -> StepResult:
        try:
            output = f.pending.result()
        except Exception as e:  # noqa: BLE001 - an asynchronous device error
            raise StepFailed(f.plan, e, f.sms, rerun_ok=False) from e
        f.end.synchronize()
        ms = f.start.elapsed_time(f.end)
        layers = self.model.num_layers
        if f.abandoned:  # part of a prefill: nothing for the models to learn, no outputs
            return StepResult(f.plan, output, None, None, on_split=f.on_split)
        if self.observe is not None:
            if f.kind == "decode":
                kv = sum(s.num_context_tokens for s in f.plan.decode)
                self.observe(
                    "decode", DecodeShape(len(f.plan.decode), kv, layers), f.sms, ms, f.other_sms
                )
            elif f.kind == "prefill" and not f.layer_sliced:
                # (A layer-sliced prefill's span includes the decode steps between its slices:
                # not a prefill latency the cost model could learn from; scored below.)
                shape = PrefillShape.from_seqs(
                    [(s.num_context_tokens, s.num_new_tokens) for s in f.plan.prefill], layers
                )
                self.observe("prefill", shape, f.sms, ms, f.other_sms, f.neighbour)
        if f.layer_sliced and self.score is not None and math.isfinite(f.predicted_ms):
            # Start to last slice, the decode steps between slices included: what the
            # controller predicted for the choice (prefill + a decode step per gap).
            self.score("prefill/layer_sliced", f.predicted_ms, ms)
        device_s = None if f.layer_sliced else ms / 1e3
        return StepResult(
            f.plan,
            output,
            device_s,
            None,
            on_split=f.on_split,
            sms=f.sms if f.on_split else 0,
            other_sms=f.other_sms if f.on_split else 0,
            decode_gap_s=self._decode_gap_s(f) if f.plan.decode else None,
            slice_promised_s=(
                f.promised_wait_ms / 1e3 if math.isfinite(f.promised_wait_ms) else None
            ),
            layer_sliced_span_s=ms / 1e3 if f.layer_sliced else None,
            layer_sliced_predicted_s=(
                f.predicted_ms / 1e3 if f.layer_sliced and math.isfinite(f.predicted_ms) else None
            ),
            split_predicted_s=(
                f.predicted_ms / 1e3
                if f.kind == "prefill" and f.on_split and math.isfinite(f.predicted_ms)
                else None
            ),
        )

    def _decode_gap_s(self, f: _Launched) -> float | None:
        """`StepResult.decode_gap_s` of a collected step carrying decodes (collected in launch
        order, so the previous one ran before it)."""
        ids = frozenset(s.request.request_id for s in f.plan.decode)
        last, self._last_decode = self._last_decode, (f.end, ids)
        if last is None or last[1].isdisjoint(ids):
            return None  # no request of this step was waiting since the previous one
        try:
            return max(0.0, last[0].elapsed_time(f.start) / 1e3)
        except RuntimeError:  # events of two contexts (green contexts) need not compare
            return None
