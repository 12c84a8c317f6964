"""`GreenContextPartition`: the CUDA implementation of runtime.partition.PartitionManager.

At start-up one disjoint (prefill, decode) green-context stream pair is created per split
(granularity and minimum read from the device). The runner asks `streams()` for the pair to
use for the next step; switching = returning another pre-created pair. Work already queued on
the old pair stays there, so `streams()` makes the new streams wait on events recorded on the
old ones (no device-wide synchronisation).

The cost model's parameters come from runtime/partition/calibrate.py (calibration file,
start-up profile or fallback; chosen by the engine). `EngineProbe` below is what that profile
measures with: the engine's own model and runner on these pre-created pairs.

Modes: "off" = time-slicing on the whole GPU (both phases on one ordinary stream, as a
monolithic engine runs); "static:<n>" pins the split with n prefill SMs; "auto" lets the
`SplitController` choose per step from the cost model (which may also choose time-slicing).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from runtime.partition import TIME_SLICE, PartitionState, SplitChoice, SplitDecision
from runtime.partition.cost_model import (
    ChunkInput,
    ControllerConfig,
    CostModel,
    DecodeShape,
    PrefillShape,
    RowStream,
    SplitController,
)
from runtime.partition.green_ctx import GreenPair, SmLayout, create_pairs, read_sm_layout

log = logging.getLogger("greenlane.partition")


# Choice-count keys besides the splits (0 = a whole time-slice): time-sliced by slices of layers
# ("layer-sliced") or with the prefill cut into chunks sized to the TBT target ("chunked").
LAYER_SLICED = -1
CHUNKED = -2
_CHOICE_LABELS = {LAYER_SLICED: "layer-sliced", CHUNKED: "chunked"}


def choice_key(dec: SplitDecision) -> int:
    """The choice-count key of a decision (see LAYER_SLICED / CHUNKED)."""
    if dec.chunk_tokens:
        return CHUNKED
    return LAYER_SLICED if dec.layers_per_slice else dec.prefill_sms


def parse_mode(spec: str) -> tuple[str, int | None]:
    if spec in ("off", "auto"):
        return spec, None
    if spec.startswith("static:") and spec[7:].isdigit():
        return "static", int(spec[7:])
    raise ValueError(f"partition mode must be off, auto or static:<prefill_sms>, got {spec!r}")


class GreenContextPartition:
    def __init__(
        self,
        mode: str = "off",
        cost_model: CostModel | None = None,
        controller_config: ControllerConfig | None = None,
        min_decode_sms: int | None = None,
        device_index: int = 0,
    ) -> None:
        self.layout: SmLayout = read_sm_layout(device_index)
        self.splits = self.layout.valid_prefill_counts(min_decode_sms)
        self.pairs: dict[int, GreenPair] = create_pairs(self.splits, device_index)
        # Time-slicing runs both phases on one ordinary stream: serial on every SM.
        self._whole = torch.cuda.Stream(device=device_index)
        self.cost_model = cost_model or CostModel(self.layout.total_sms)
        self.controller = SplitController(self.cost_model, self.splits, controller_config)
        self._lock = threading.Lock()  # the admin API sets the mode from another thread
        self._mode = "off"
        self._active = TIME_SLICE
        self._last: SplitChoice | None = None
        self._last_decision = None
        self.measured: dict[str, float | None] = {"prefill_ms": None, "decode_ms": None}
        # set_mode from another thread hands the change to the engine thread through this
        # (the engine's inbox); None = apply at once (start-up, tests, single-threaded use).
        self.submit: Callable[[Callable[[], None]], None] | None = None
        self._pending_mode: str | None = None
        # auto's choices since the mode was last set: prefill batches per split (0 = time-
        # slice), and a once-a-second log line when the choice changes (with its reason).
        self._choice_counts: Counter[int] = Counter()
        self.disabled: dict[int, str] = {}  # split -> why it was taken out of service
        self._logged_choice: tuple[int, float] = (TIME_SLICE, 0.0)
        self._apply_mode(*parse_mode(mode))

    def set_cost_model(self, model: CostModel) -> None:
        """Install new parameters (after a start-up profile); the controller uses them from its
        next decision. Online corrections learned so far are dropped with the old model; a
        shared prefill model (`share_prefill_model`) stays."""
        with self._lock:
            model.whole_prefill_ms = self.cost_model.whole_prefill_ms
            self.cost_model = model
            self.controller.model = model
        log.info("partition cost model now from %s", model.source)

    def share_prefill_model(self, whole_prefill_ms: Callable[[PrefillShape], float | None]) -> None:
        """Predict whole-GPU prefill latency (ms) with `whole_prefill_ms` (the engine's JCT
        model; None: the cost model's own fit), now and in any cost model installed later: one
        prefill model for the splits and the chunks (`CostModel.whole_prefill_ms`)."""
        with self._lock:
            self.cost_model.whole_prefill_ms = whole_prefill_ms

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    # ---- PartitionManager protocol ----------------------------------------------------------
    def state(self) -> PartitionState:
        with self._lock:
            total = self.layout.total_sms
            p = self._active or total
            d = total - self._active if self._active else total
            dec = self._last_decision
            return PartitionState(
                available=True,
                reason="",
                mode=self._pending_mode or self._mode,
                total_sms=total,
                prefill_sms=p,
                decode_sms=d,
                splits=list(self.splits),
                pinned=self.controller.pinned is not None,
                predicted_prefill_ms=None if dec is None else dec.predicted_prefill_ms,
                predicted_decode_ms=None if dec is None else dec.predicted_decode_ms,
                measured_prefill_ms=self.measured["prefill_ms"],
                measured_decode_ms=self.measured["decode_ms"],
                choice_counts={
                    _CHOICE_LABELS.get(k, str(k)): v for k, v in sorted(self._choice_counts.items())
                },
                disabled_splits={str(k): v for k, v in sorted(self.disabled.items())},
            )

    def set_mode(self, spec: str) -> PartitionState:
        """Validate here (ValueError at once), apply on the engine thread (via `submit`)."""
        mode, n = parse_mode(spec)
        if n is not None and n in self.disabled:
            raise ValueError(f"split {n} was disabled after it failed: {self.disabled[n]}")
        if n is not None and n not in self.pairs:
            raise ValueError(f"split {n} was not pre-created; choose from {self.splits}")
        if self.submit is None:
            self._apply_mode(mode, n)
        else:
            with self._lock:
                self._pending_mode = mode
            self.submit(lambda: self._apply_mode(mode, n))
        return self.state()

    def _apply_mode(self, mode: str, n: int | None) -> None:
        with self._lock:
            self._mode = mode
            self._pending_mode = None
            self._choice_counts.clear()
            if mode == "static":
                assert n is not None
                self.controller.pin(n)
                self._active = n
            else:
                self.controller.release()
                if mode == "off":
                    self._active = TIME_SLICE
        log.info("partition mode: %s%s", mode, f":{n}" if n is not None else "")

    def disable_split(self, prefill_sms: int, reason: str) -> None:
        """Take a split out of service after work on it failed while the same requests ran fine
        on the whole GPU. auto stops choosing it; a pin on it falls back to `off`. Engine thread
        only (it changes what `decide` may return)."""
        with self._lock:
            if prefill_sms in self.disabled or prefill_sms not in self.splits:
                return
            self.disabled[prefill_sms] = reason[:300]
            self.splits = [s for s in self.splits if s != prefill_sms]
            self.controller.splits = [s for s in self.controller.splits if s != prefill_sms]
            if self.controller.current == prefill_sms:
                self.controller.current = TIME_SLICE
            if self.controller.pinned == prefill_sms:
                self.controller.release()
                self._mode = "off"
            if self._active == prefill_sms:
                self._active = TIME_SLICE
            mode = self._mode
        log.warning(
            "split %d/%d disabled (%s); mode now %s",
            prefill_sms,
            self.layout.total_sms - prefill_sms,
            reason[:300],
            mode,
        )

    # ---- runner hooks ------------------------------------------------------------------------
    def decide(
        self,
        prefill: PrefillShape | None,
        decode: DecodeShape | None,
        kv_usage: float,
        *,
        chunk: ChunkInput | None = None,
        record: bool = True,
        aim_ms: float | None = None,
        rows: RowStream | None = None,
        slice_aim_ms: float | None = None,
    ) -> SplitChoice:
        """The split for the next step and its streams: auto's controller decides; static
        and off keep theirs. When the split changed since the last call, the new streams wait
        for the work queued on the old ones (events, no sync). `chunk`: `prefill` is the head
        of the queue, not yet planned, and may be chunked (`SplitController.choose`).
        `record` False: the decision may not be carried out as made (the engine asks before
        planning a step; only a chunked answer is kept), so it is neither counted nor logged
        here; `record` does that when it is. `aim_ms`: the engine's aim for what a decode
        waits; `slice_aim_ms`: the same for layer slices where the engine measured their own
        tail (`SplitController.choose`). `rows`: the prefill streams its rows, so its layers
        may be cut into row pieces (sub-layer slices)."""
        with self._lock:
            if self._mode == "auto":
                dec = self.controller.choose(
                    prefill,
                    decode,
                    kv_usage,
                    chunk=chunk,
                    aim_ms=aim_ms,
                    rows=rows,
                    slice_aim_ms=slice_aim_ms,
                )
                self._last_decision = dec
                self._active = dec.prefill_sms
                if record:
                    self._record_locked(dec, prefill is not None)
            else:
                dec = SplitDecision(self._active, reason=self._mode)
        total = self.layout.total_sms
        if dec.prefill_sms == TIME_SLICE:
            choice = SplitChoice(dec, self._whole, self._whole, total)
        else:
            pair = self.pairs[dec.prefill_sms]
            choice = SplitChoice(
                dec, pair.prefill.stream, pair.decode.stream, total - dec.prefill_sms
            )
        last = self._last
        if last is not None and last.prefill_sms != choice.prefill_sms:
            for new in {choice.prefill_stream, choice.decode_stream}:
                for old in {last.prefill_stream, last.decode_stream}:
                    new.wait_stream(old)
        self._last = choice
        return choice

    def record(self, dec: SplitDecision) -> None:
        """Count and log a prefill decision of auto's that `decide` made with `record` False
        and the engine then carried out (a chunked step)."""
        with self._lock:
            if self._mode == "auto":
                self._record_locked(dec, True)

    def _record_locked(self, dec: SplitDecision, has_prefill: bool) -> None:
        if has_prefill:
            self._choice_counts[choice_key(dec)] += 1
        self._log_choice(dec)

    def _log_choice(self, dec: SplitDecision) -> None:
        """INFO when auto's choice changes, at most once a second (a flapping choice would
        otherwise flood the log); the counts in `state()` keep the full picture."""
        last, t_last = self._logged_choice
        now = time.monotonic()
        key = choice_key(dec)
        if key != last and now - t_last >= 1.0:
            self._logged_choice = (key, now)
            if dec.chunk_tokens:
                what = f"time-slice in chunks of <= {dec.chunk_tokens} tokens"
            elif dec.slice_ends:
                what = f"time-slice by {len(dec.slice_ends)} sub-layer slices"
            elif dec.layers_per_slice:
                what = f"time-slice by {dec.layers_per_slice} layers"
            elif dec.prefill_sms == TIME_SLICE:
                what = "time-slice"
            else:
                what = f"{dec.prefill_sms} prefill SMs"
            log.info(
                "auto split: %s (%s; predicted prefill %.1f ms, decode %.1f ms)",
                what,
                dec.reason,
                dec.predicted_prefill_ms,
                dec.predicted_decode_ms,
            )

    def observe(
        self,
        stage: str,
        shape: PrefillShape | DecodeShape,
        sms: int,
        measured_ms: float,
        other_sms: int,
        neighbour: PrefillShape | DecodeShape | None = None,
    ) -> None:
        """A measured stage latency: scored against the cost model, then refines it.
        `neighbour`: the other phase's mean shape beside it (a split prefill's decodes)."""
        with self._lock:
            self.cost_model.observe(stage, shape, sms, measured_ms, other_sms, neighbour=neighbour)
        per_layer = measured_ms / max(shape.num_layers, 1)
        if stage == "prefill":
            self.record_measured(per_layer * shape.num_layers, None)
        else:
            self.record_measured(None, per_layer * shape.num_layers)

    def predict_chunked_step_ms(
        self, prefill: list[tuple[int, int]], decode: DecodeShape, chunk: ChunkInput
    ) -> float:
        """The controller's prediction for a planned chunked step (`chunked_step_ms`)."""
        with self._lock:
            return self.controller.chunked_step_ms(prefill, decode, chunk)

    def observe_whole_decode(self, decode: DecodeShape, measured_ms: float) -> None:
        """A decode-only step the serial executor ran on the whole GPU (mode off): refines the
        model's decode as the split executor's whole-GPU decode steps do under auto."""
        self.observe("decode", decode, self.cost_model.total_sms, measured_ms, 0)

    def predict_decode_ms(self, decode: DecodeShape) -> float | None:
        """The cost model's whole-GPU decode step for `decode` (ms); None while uncalibrated."""
        with self._lock:
            return self.controller.predicted_decode_ms(decode)

    def chunk_room_ms(self, decode: DecodeShape, chunk: ChunkInput) -> float:
        """The controller's room for a chunked step's prefill parts (`chunk_room_ms`)."""
        with self._lock:
            return self.controller.chunk_room_ms(decode, chunk)

    def score(self, kind: str, predicted_ms: float, measured_ms: float) -> None:
        """A choice's measured time against the prediction it was made on, per kind ("chunked/
        step": a chunked time-slice step; "prefill/layer_sliced": a prefill's layer slices
        with the decode steps between them): `mape_<kind>` in `cost_model_errors`. Scored,
        not learned from."""
        with self._lock:
            self.cost_model.score(kind, predicted_ms, measured_ms)

    def reset_cost_model_errors(self) -> bool:
        """Empty the error logs (every kind); the model's parameters and corrections stay."""
        with self._lock:
            self.cost_model.errors.clear()
        return True

    def cost_model_errors(self) -> dict[str, float | int]:
        """The cost model's out-of-sample errors by kind (`CostModel.error_stats`)."""
        with self._lock:
            return self.cost_model.error_stats()

    def cost_model_mape(self) -> float | None:
        with self._lock:
            stats = self.cost_model.error_stats()
        mape = stats.get("mape")
        return None if mape is None or mape != mape else float(mape)  # NaN -> None

    def record_measured(self, prefill_ms: float | None, decode_ms: float | None) -> None:
        if prefill_ms is not None:
            self.measured["prefill_ms"] = prefill_ms
        if decode_ms is not None:
            self.measured["decode_ms"] = decode_ms


# ------------------------------------------------------------------------- start-up profile probe
class EngineProbe:
    """The measure functions of runtime/partition/calibrate.py, on a built (not started)
    engine: its model, runner (the same `forward_part` the serving loops call, so a decode
    step uses the decode CUDA graphs whenever serving would) and its pre-created pairs.

    Contexts are real KV blocks borrowed from the engine's pool (freed after each call); the
    new tokens of a prefill are discarded, as for a scoring request. The values in the pool
    are whatever it holds, which does not change the timing. Each call is one timed run
    (CUDA events on the stream used); the profile adds warm-up and repeats.
    Hazard: must run before the engine thread starts (it uses the pool and the runner)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.green: GreenContextPartition = engine._green
        self.total_sms = self.green.layout.total_sms
        self._serial = 0

    # ---- streams for an SM count ------------------------------------------------------------
    def _prefill_stream(self, sms: int) -> torch.cuda.Stream:
        return self.green._whole if sms >= self.total_sms else self.green.pairs[sms].prefill.stream

    def _decode_stream(self, sms: int) -> torch.cuda.Stream:
        if sms >= self.total_sms:
            return self.green._whole
        return self.green.pairs[self.total_sms - sms].decode.stream

    # ---- borrowed sequences -------------------------------------------------------------------
    @contextmanager
    def _seqs(self, specs: list[tuple[int, int]], decode: bool) -> Iterator[list[Any]]:
        """ScheduledSeqs for (context_tokens, new_tokens) each; a decode keeps its new token's
        KV (blocks for context + 1). A prefill keeps its new tokens' KV too when the pool has
        the blocks now, as a served one does (a chat chunk always; a scoring prompt when there
        is room), so a prefill after context is timed on the paged attention path it is served
        on; only without room does it discard them and attend a per-layer copy of the context
        (as until 2026-12-05 every probe did, Engine.measure_prefill_batch's note)."""
        from runtime.request import Request, RequestKind
        from runtime.scheduler import Lease, ScheduledSeq

        bm = self.engine.block_manager
        rids: list[str] = []
        seqs = []
        try:
            for ctx, new in specs:
                self._serial += 1
                rid = f"__partition_probe_{self._serial}__"
                keep = decode or self.engine.served_keeps_kv([(new, ctx)])
                kept = ctx + new if keep else ctx
                blocks = bm.allocate(rid, bm.num_blocks_for(kept))
                rids.append(rid)
                kind = RequestKind.GENERATE if decode else RequestKind.SCORE
                req = Request(rid, kind, [0] * (ctx + new), label_token_ids=[0])
                seqs.append(
                    ScheduledSeq(
                        request=req,
                        # Token slot 0: a decode reads (and its sample writes) one row of the
                        # token table; the values do not change the timing.
                        lease=Lease(req, rid, 0 if decode else -1),
                        num_context_tokens=ctx,
                        num_new_tokens=new,
                        num_kept_tokens=kept,
                        block_ids=list(blocks),
                        input_ids=[] if decode else [0] * new,
                        needs_output=decode,
                        samples=decode,
                    )
                )
            yield seqs
        finally:
            for rid in rids:
                bm.free(rid)

    def _decode_step(self, seqs: list[Any]) -> None:
        """One decode step as the split executor runs it: forward, LM head, sampling, and the
        host waiting for the sampled tokens."""
        from runtime.runner import PendingOutput

        runner = self.engine.runner
        hidden, wanting = runner.forward_part(seqs, True, runner.decode_backend)
        pending = PendingOutput(runner.device)
        runner.outputs_from_hidden(hidden, wanting, pending)
        pending.seal().result()

    # ---- the three measures ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_ms(self, num_tokens: int, context_tokens: int, sms: int) -> float:
        runner = self.engine.runner
        stream = self._prefill_stream(sms)
        with self._seqs([(context_tokens, num_tokens)], decode=False) as seqs:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                a, b = _timing_events()
                a.record()
                runner.forward_part(seqs, False, runner.prefill_backend)
                b.record()
            b.synchronize()
            return float(a.elapsed_time(b))

    @torch.inference_mode()
    def decode_ms(self, batch_size: int, context_tokens: int, sms: int) -> float:
        stream = self._decode_stream(sms)
        if sms < self.total_sms:
            # Graphs captured on an ordinary stream would run on every SM: use (capturing
            # now, outside the timed region) the set bound to this split's decode stream.
            self.engine.runner.ensure_split_graphs(stream, f"{self.total_sms - sms}/{sms}")
        with self._seqs([(context_tokens, 1)] * batch_size, decode=True) as seqs:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                a, b = _timing_events()
                a.record()
                self._decode_step(seqs)
                b.record()
            b.synchronize()
            return float(a.elapsed_time(b))

    @torch.inference_mode()
    def concurrent_ms(
        self,
        prefill: tuple[int, int],
        decode: tuple[int, int],
        prefill_sms: int,
        max_decode_steps: int = 500,
    ) -> tuple[float, float]:
        """The prefill on the pair's prefill stream; decode steps on its decode stream until
        the prefill's end event completes (one host thread launching both, as in the PD loop).
        Returns (prefill ms, mean decode step ms; NaN if no step ran alongside)."""
        runner = self.engine.runner
        pair = self.green.pairs[prefill_sms]
        ps, ds = pair.prefill.stream, pair.decode.stream
        decode_sms = self.total_sms - prefill_sms
        runner.ensure_split_graphs(ds, f"{prefill_sms}/{decode_sms}")
        (num_tokens, p_ctx), (batch, d_ctx) = prefill, decode
        # The decodes' blocks first: the prefill keeps its new tokens' KV only if room is left
        # (fit_shapes_to_limits sizes the decodes to the pool with the prefill's context alone).
        with (
            self._seqs([(d_ctx, 1)] * batch, decode=True) as dseqs,
            self._seqs([(p_ctx, num_tokens)], decode=False) as pseqs,
        ):
            torch.cuda.synchronize()
            p0, p1 = _timing_events()
            with torch.cuda.stream(ps):
                p0.record()
                runner.forward_part(pseqs, False, runner.prefill_backend)
                p1.record()
            steps: list[tuple[Any, Any]] = []
            with torch.cuda.stream(ds):
                while not p1.query() and len(steps) < max_decode_steps:
                    a, b = _timing_events()
                    a.record()
                    self._decode_step(dseqs)  # its sampling syncs the host with this stream
                    b.record()
                    steps.append((a, b))
            torch.cuda.synchronize()
            prefill_ms = float(p0.elapsed_time(p1))
            # Steps that ended after the prefill overlapped it only partly: keep the others.
            overlapped = [(a, b) for a, b in steps if p0.elapsed_time(b) <= prefill_ms]
            if not overlapped:
                return prefill_ms, math.nan
            return prefill_ms, float(np.mean([a.elapsed_time(b) for a, b in overlapped]))

    def measures(self) -> dict[str, Callable[..., Any]]:
        return {
            "measure_prefill_ms": self.prefill_ms,
            "measure_decode_ms": self.decode_ms,
            "measure_concurrent_ms": self.concurrent_ms,
        }


def _timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def profile_engine(
    engine: Any,
    *,
    full: bool = False,
    cache_dir: str | None = None,
    out_path: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Any:
    """Profile a built, not started engine on its pre-created pairs, fit and write the
    calibration (`out_path`, else the cache folder). `full`: the explicit profile of
    `python -m app calibrate --what partition`; else the bounded start-up one. Returns the
    `PartitionCalibration`. Raises ValueError when the engine has no green-context pairs."""
    from runtime.calibrate import model_key
    from runtime.partition import calibrate as pc

    g = getattr(engine, "_green", None)
    if g is None:
        raise ValueError(f"SM partitioning is unavailable: {engine.partition.state().reason}")
    total = g.layout.total_sms
    cfg = engine.config
    shapes = pc.fit_shapes_to_limits(
        pc.FULL_SHAPES if full else pc.STARTUP_SHAPES,
        max_model_len=engine.max_model_len,
        kv_pool_tokens=engine.kv_pool_tokens,
        max_num_seqs=cfg.max_num_seqs,
    )
    fractions = pc.FULL_SPLIT_FRACTIONS if full else pc.STARTUP_SPLIT_FRACTIONS
    probe = EngineProbe(engine)
    return pc.calibrate_partition(
        **probe.measures(),
        device=engine.device_name,
        total_sms=total,
        model=model_key(cfg.model),
        num_layers=engine.model_config.num_layers,
        splits=pc.pick_splits(g.splits, fractions, total),
        shapes=shapes,
        repeats=pc.FULL_REPEATS if full else pc.STARTUP_REPEATS,
        max_seconds=pc.FULL_MAX_S if full else pc.STARTUP_MAX_S,
        cache_dir=cache_dir,
        out_path=out_path,
        **({"progress": progress} if progress is not None else {}),
    )
