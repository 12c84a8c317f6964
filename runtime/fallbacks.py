"""The fallbacks this process's engine took, each kept with its first reason.

The log says FALLBACK once, where it happens; this keeps the list so that `/admin/api/state`
shows it, and with it every benchmark that records the server's state: a run measured on a
fallback (prefill graphs not captured, kernels not warmed up, merged steps turned off) must
not need the server's log to say so. One engine a process (the engine core); tests that build
several in one process start each with an empty list (`clear`)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_taken: dict[str, str] = {}


def note(what: str, why: str) -> None:
    """Keep `what` (a short name: "prefill graphs") with `why`; the first reason stays."""
    with _lock:
        _taken.setdefault(what, why[:300])


def taken() -> dict[str, str]:
    """What fell back, and why."""
    with _lock:
        return dict(_taken)


def clear() -> None:
    with _lock:
        _taken.clear()
