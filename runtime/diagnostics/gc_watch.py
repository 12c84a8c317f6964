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

Young collections (generations 0 and 1) walk every element of every list created since the
previous one. Scoring prompts are token-id lists of 10k-60k ints, and under a scoring load
with shared prefixes (H200, 2026-12-02: 49 waiting, prefix hit rate 0.96) young collections
paused 10-45 ms with no full collection. On a CPU the engine core's young generations held
0.5-1.9 M list elements, nearly all prompt tokens (15,778 per request), and their young
collections took 5-22 ms of the collecting thread's CPU; no cyclic garbage at all (`collected`
0, DEBUG_SAVEALL empty). `untrack_int_list` takes such a list out of the collector's sight.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from typing import Any, TypeVar

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


_AtomList = TypeVar("_AtomList", list[int], list[bytes])

# CPython's own call: a list is tracked from creation to its end, and Python has no way to
# untrack one (CPython untracks tuples and dicts of atomic values itself, never lists).
_gc_untrack: Any = None
if sys.implementation.name == "cpython":
    _gc_untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    _gc_untrack.argtypes = [ctypes.py_object]
    _gc_untrack.restype = None


def untrack_int_list(values: _AtomList) -> _AtomList:
    """Take a list that holds only ints or bytes (token ids, block digests) out of the
    collector's lists, O(1); returns it. Safe because these hold no references: such a list
    can be in no reference cycle, now or after more are appended (appends never re-track a
    list). Never pass a list that may later hold a container: a cycle through it would leak.
    A no-op off CPython and for anything but an exact list."""
    if _gc_untrack is not None and type(values) is list:
        _gc_untrack(values)
    return values


class GcWatch:
    """Pause times of the collector since `install()`: full collections (generation 2) and
    the longest pause of any generation, per stats window (`take_window`).

    A pause is wall time from the "start" to the "stop" callback. It can hold time in which
    another thread of the process ran: the callbacks are Python code, where the interpreter
    hands the GIL to a thread that has waited for it (5 ms, `sys.getswitchinterval()`). On a
    CPU the engine core's main thread measured 18.6 ms for a young collection that took 5.0 ms
    of its CPU, the engine thread running in between. So the window also reports the
    collecting thread's CPU time (`gc_pause_cpu_ms_max`: what the collector itself took) and
    the longest young (generation 0/1) pause on its own (`gc_young_pause_ms_max`)."""

    def __init__(
        self, clock: Any = time.perf_counter, thread_clock: Any = time.thread_time
    ) -> None:
        self.clock = clock
        self.thread_clock = thread_clock  # CPU time of the calling thread (s)
        self.num_full = 0
        self.full_ms_total = 0.0
        self.max_ms = 0.0  # longest pause since the last take_window()
        self.max_ms_ever = 0.0
        self.young_max_ms = 0.0  # longest generation 0/1 pause since the last take_window()
        self.cpu_max_ms = 0.0  # most CPU of the collecting thread, since the last take_window()
        self.young_max_ms_ever = 0.0
        self.cpu_max_ms_ever = 0.0
        self._pause_ms = 0.0  # every collection's pause since the last take_pause_ms()
        self._t0: float | None = None
        self._cpu0 = 0.0
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
            self._cpu0 = self.thread_clock()
            self._t0 = self.clock()
            return
        if self._t0 is None:
            return
        ms = (self.clock() - self._t0) * 1e3
        cpu_ms = (self.thread_clock() - self._cpu0) * 1e3
        self._t0 = None
        self.max_ms = max(self.max_ms, ms)
        self.max_ms_ever = max(self.max_ms_ever, ms)
        self.cpu_max_ms = max(self.cpu_max_ms, cpu_ms)
        self.cpu_max_ms_ever = max(self.cpu_max_ms_ever, cpu_ms)
        self._pause_ms += ms
        if info.get("generation") == 2:
            self.num_full += 1
            self.full_ms_total += ms
        else:
            self.young_max_ms = max(self.young_max_ms, ms)
            self.young_max_ms_ever = max(self.young_max_ms_ever, ms)

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
            "gc_young_pause_ms_max": round(self.young_max_ms, 3),
            "gc_pause_cpu_ms_max": round(self.cpu_max_ms, 3),
            "gc_young_pause_ms_max_ever": round(self.young_max_ms_ever, 3),
            "gc_pause_cpu_ms_max_ever": round(self.cpu_max_ms_ever, 3),
        }
        self.max_ms = self.young_max_ms = self.cpu_max_ms = 0.0
        return out
