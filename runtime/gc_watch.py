"""The interpreter's garbage collector, kept off the step loop's critical path.

Why: a full (generation 2) collection walks every tracked object in the process: those of
torch, Triton and FlashInfer's Python layers, the model's modules, and the engine's own state
— hundreds of thousands of objects, tens of milliseconds or more with the step loop stopped,
and it comes at moments no one chose. On the H200 a fresh server's first second showed host
gaps of 101 and 136 ms before a step (3B, plan v at 4af23c2), the size of such a pause (not
proven to be one: `GcWatch` is here to say). The anchors freeze the start-up objects
(`gc.freeze()` after the engine is built): collections then walk only what serving creates.

`GcWatch` times every collection through `gc.callbacks` (O(1) per collection, nothing per
step) so the engine's stats can say how long the loop stood still for the collector.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("greenlane.gc")


def freeze_startup_objects(process: str = "engine core") -> int:
    """Collect once, then move every object alive now to the permanent generation (never
    walked again). Returns how many were frozen. Call once start-up is done (the engine
    built; in an API server, the engine connected). `process` names it in the log line."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("gc: %s: %d start-up objects frozen (not walked by later collections)", process, n)
    return n


class GcWatch:
    """Pause times of the collector since `install()`: full collections (generation 2) and
    the longest pause of any generation, per stats window (`take_window`)."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.num_full = 0
        self.full_ms_total = 0.0
        self.max_ms = 0.0  # longest pause since the last take_window()
        self.max_ms_ever = 0.0
        self._pause_ms = 0.0  # every collection's pause since the last take_pause_ms()
        self._t0: float | None = None
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = self.clock()
            return
        if self._t0 is None:
            return
        ms = (self.clock() - self._t0) * 1e3
        self._t0 = None
        self.max_ms = max(self.max_ms, ms)
        self.max_ms_ever = max(self.max_ms_ever, ms)
        self._pause_ms += ms
        if info.get("generation") == 2:
            self.num_full += 1
            self.full_ms_total += ms

    def take_pause_ms(self) -> float:
        """Pause time (ms, any generation) since the last call: the step trace's `gc_ms`."""
        ms, self._pause_ms = self._pause_ms, 0.0
        return round(ms, 3)

    def take_window(self) -> dict[str, float | int]:
        """The stats fields; the window's longest pause restarts."""
        out = {
            "gc_full_collections": self.num_full,
            "gc_full_ms_total": round(self.full_ms_total, 3),
            "gc_pause_ms_max": round(self.max_ms, 3),
            "gc_pause_ms_max_ever": round(self.max_ms_ever, 3),
        }
        self.max_ms = 0.0
        return out
