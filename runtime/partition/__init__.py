"""SM partitioning of one GPU between prefill and decode (CUDA green contexts).

`PartitionManager` is what the engine and the admin API use. On machines without CUDA
green contexts the engine holds an `UnavailablePartition` that says why.

The package is the split: `green_ctx` (green-context stream pairs), `gpu`
(`GreenContextPartition`, the engine probe), `cost_model` (stage latency vs SM share and the
`SplitController`), `pacing` (`StepPacer`: the engine's side of the controller, and the TBT
cut), `calibrate` (the cost-model profile and its file), `setup` (the engine's partition
set-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

TIME_SLICE = 0  # the decision "no split: every SM to one phase at a time" (like partition=off)


@dataclass(frozen=True, slots=True)
class SplitDecision:
    """Where and how the next step's prefill runs: the one type for a split decision, whoever
    makes it (the controller in auto, a pin in static, off). Predictions are NaN when none was
    made. `predicted_prefill_ms` is the time to finish the prefill (on its split, or over its
    layer slices or chunk steps with the decode steps between them), `predicted_decode_ms` how
    long a decode step takes (time-sliced: waits) meanwhile."""

    prefill_sms: int  # TIME_SLICE (0) = no split
    # Time-slicing by slices of this many layers (prefill_sms is TIME_SLICE); None = whole.
    layers_per_slice: int | None = None
    # Sub-layer slices of a row-streamed prefill (hybrid prefill's row form), where no whole
    # layer fits the TBT target or where they make fewer slices (layers_per_slice is then 1):
    # where each slice ends, in whole hybrid chunks counted from the prefill's start layer
    # after layer (layer * chunks a layer + chunk), ascending, the last all of them. A slice
    # runs on into the next layer where its room allows; a decode step follows each. None =
    # whole layers.
    slice_ends: tuple[int, ...] | None = None
    # Time-slicing with the prefill cut into chunks of at most this many tokens per step, each
    # step one whole-GPU forward of the decodes and a chunk sized to the TBT target
    # (prefill_sms is TIME_SLICE): it caps the step's prefill tokens when the step is planned.
    # None = the prefill is not cut by the decision.
    chunk_tokens: int | None = None
    predicted_prefill_ms: float = math.nan
    predicted_decode_ms: float = math.nan
    speedup_vs_time_slice: float = 1.0  # serial-on-whole-GPU time / concurrent time
    reason: str = ""
    evaluations: int = 0


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """A decision bound to the streams that carry it out (the split executor's input)."""

    decision: SplitDecision
    prefill_stream: Any  # TIME_SLICE: both streams are the whole GPU's
    decode_stream: Any
    decode_sms: int

    @property
    def prefill_sms(self) -> int:
        return self.decision.prefill_sms

    @property
    def layers_per_slice(self) -> int | None:
        return self.decision.layers_per_slice

    @property
    def slice_ends(self) -> tuple[int, ...] | None:
        return self.decision.slice_ends

    @property
    def chunk_tokens(self) -> int | None:
        return self.decision.chunk_tokens


@dataclass(slots=True)
class PartitionState:
    available: bool
    reason: str  # why partitioning is unavailable, or "" when available
    mode: str  # "off" | "static" | "auto"
    total_sms: int
    prefill_sms: int  # SMs of the prefill partition now (== total_sms when mode is off)
    decode_sms: int
    splits: list[int] = field(default_factory=list)  # pre-created prefill SM counts
    pinned: bool = False  # a manual override holds the split until released
    predicted_prefill_ms: float | None = None
    predicted_decode_ms: float | None = None
    measured_prefill_ms: float | None = None
    measured_decode_ms: float | None = None
    # auto: prefill batches per choice since the mode was set ("0" = time-slice,
    # "layer-sliced" = time-sliced by slices of layers, "chunked" = time-sliced with the
    # prefill cut into chunks sized to the TBT target)
    choice_counts: dict[str, int] = field(default_factory=dict)
    # splits taken out of service after failing at run time (split -> why)
    disabled_splits: dict[str, str] = field(default_factory=dict)


class PartitionManager(Protocol):
    def state(self) -> PartitionState: ...

    def set_mode(self, spec: str) -> PartitionState:
        """spec: "off", "auto" or "static:<prefill_sms>" (pins that split). Raises ValueError
        for a malformed spec or a split that was not pre-created."""
        ...

    def reset_cost_model_errors(self) -> bool:
        """Forget the cost model's logged prediction errors (`cost_model_errors`, and the
        evidence the split margin reads), so what is logged next belongs to what runs next
        (a benchmark's side). False when there is no cost model."""
        ...


class UnavailablePartition:
    """Stand-in when there is no CUDA / no green contexts: everything runs time-sliced."""

    def __init__(self, reason: str, total_sms: int = 0) -> None:
        self._state = PartitionState(
            available=False,
            reason=reason,
            mode="off",
            total_sms=total_sms,
            prefill_sms=total_sms,
            decode_sms=total_sms,
        )

    def state(self) -> PartitionState:
        return self._state

    def set_mode(self, spec: str) -> PartitionState:
        if spec == "off":
            return self._state
        raise ValueError(f"SM partitioning is unavailable: {self._state.reason}")

    def reset_cost_model_errors(self) -> bool:
        return False
