"""`GreenContextPartition`: the CUDA implementation of runtime.partition.PartitionManager.

At start-up one disjoint (prefill, decode) green-context stream pair is created per split
(granularity and minimum read from the device). The runner asks `streams()` for the pair to
use for the next step; switching = returning another pre-created pair. Work already queued on
the old pair stays there, so `streams()` makes the new streams wait on events recorded on the
old ones (no device-wide synchronisation).

Modes: "off" = time-slicing on the whole GPU (both phases on one ordinary stream, as a
monolithic engine runs); "static:<n>" pins the split with n prefill SMs; "auto" lets the
`SplitController` choose per step from the cost model (which may also choose time-slicing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.cost_model import (
    TIME_SLICE,
    ControllerConfig,
    CostModel,
    DecodeShape,
    PrefillShape,
    SplitController,
)
from runtime.green_ctx import GreenPair, SmLayout, create_pairs, read_sm_layout
from runtime.partition import PartitionState

log = logging.getLogger("greenlane.partition")


@dataclass(slots=True)
class StreamChoice:
    prefill_sms: int  # TIME_SLICE (0) = no split
    prefill_stream: torch.cuda.Stream
    decode_stream: torch.cuda.Stream


def make_cost_model(config: object, gpu_name: str, device_index: int = 0) -> CostModel:
    """The cost model from `config.partition_calibration` (keyed by GPU and model) when it has
    an entry, else an uncalibrated model (flat base: every split predicted alike, so `auto`
    relies on the measured per-split corrections; said in the log)."""
    path = getattr(config, "partition_calibration", None)
    model_name = str(getattr(config, "model", ""))
    layout_total = torch.cuda.get_device_properties(device_index).multi_processor_count
    if path:
        m = CostModel.load(path, gpu_name, model_name)
        if m is not None:
            log.info("cost model loaded from %s (%s | %s)", path, gpu_name, model_name)
            return m
        log.warning("no cost-model calibration for %s | %s in %s", gpu_name, model_name, path)
    log.warning("cost model uncalibrated: run bench/gpu_partition.py to profile this GPU/model")
    return CostModel(layout_total)


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
        self._last: StreamChoice | None = None
        self._last_decision = None
        self.measured: dict[str, float | None] = {"prefill_ms": None, "decode_ms": None}
        # set_mode from another thread hands the change to the engine thread through this
        # (the engine's inbox); None = apply at once (start-up, tests, single-threaded use).
        self.submit: Callable[[Callable[[], None]], None] | None = None
        self._pending_mode: str | None = None
        self._apply_mode(*parse_mode(mode))

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
                available=True, reason="", mode=self._pending_mode or self._mode,
                total_sms=total,
                prefill_sms=p, decode_sms=d, splits=list(self.splits),
                pinned=self.controller.pinned is not None,
                predicted_prefill_ms=None if dec is None else dec.predicted_prefill_ms,
                predicted_decode_ms=None if dec is None else dec.predicted_decode_ms,
                measured_prefill_ms=self.measured["prefill_ms"],
                measured_decode_ms=self.measured["decode_ms"],
            )

    def set_mode(self, spec: str) -> PartitionState:
        """Validate here (ValueError at once), apply on the engine thread (via `submit`)."""
        mode, n = parse_mode(spec)
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
            if mode == "static":
                assert n is not None
                self.controller.pin(n)
                self._active = n
            else:
                self.controller.release()
                if mode == "off":
                    self._active = TIME_SLICE
        log.info("partition mode: %s%s", mode, f":{n}" if n is not None else "")

    # ---- runner hooks ------------------------------------------------------------------------
    def decide(self, prefill: PrefillShape | None, decode: DecodeShape | None,
               kv_usage: float) -> int:
        """Pick the split for the next step (auto mode); returns the prefill SM count or 0."""
        with self._lock:
            if self._mode == "auto":
                dec = self.controller.choose(prefill, decode, kv_usage)
                self._last_decision = dec
                self._active = dec.prefill_sms
            return self._active

    def streams(self) -> StreamChoice:
        """The (prefill, decode) streams for the active split. When the split changed since the
        last call, the new streams wait for work queued on the old ones (events, no sync)."""
        with self._lock:
            active = self._active
        if active == TIME_SLICE:
            choice = StreamChoice(TIME_SLICE, self._whole, self._whole)
        else:
            pair = self.pairs[active]
            choice = StreamChoice(active, pair.prefill.stream, pair.decode.stream)
        last = self._last
        if last is not None and last.prefill_sms != choice.prefill_sms:
            for new in {choice.prefill_stream, choice.decode_stream}:
                for old in {last.prefill_stream, last.decode_stream}:
                    new.wait_stream(old)
        self._last = choice
        return choice

    def observe(self, stage: str, shape: PrefillShape | DecodeShape, sms: int,
                measured_ms: float, other_sms: int) -> None:
        """A measured stage latency: scored against the cost model, then refines it."""
        with self._lock:
            self.cost_model.observe(stage, shape, sms, measured_ms, other_sms)
        per_layer = measured_ms / max(shape.num_layers, 1)
        if stage == "prefill":
            self.record_measured(per_layer * shape.num_layers, None)
        else:
            self.record_measured(None, per_layer * shape.num_layers)

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
