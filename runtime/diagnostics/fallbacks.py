"""The fallbacks this process's engine took, each kept with its first reason.

The log says FALLBACK once, where it happens; this keeps the list so that `/admin/api/state`
shows it, and with it every benchmark that records the server's state: a run measured on a
fallback (prefill graphs not captured, kernels not warmed up, merged steps turned off) must
not need the server's log to say so. One engine a process (the engine core); tests that build
several in one process start each with an empty list (`clear`)."""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
_taken: dict[str, str] = {}


def note(what: str, why: str) -> None:
    """Keep `what` (a short name: "prefill graphs") with `why`; the first reason stays."""
    with _lock:
        _taken.setdefault(what, why[:300])


def take(
    what: str,
    error: BaseException | str,
    then: str,
    logger: logging.Logger,
    *,
    failed: str | None = None,
) -> str:
    """A fallback taken: log `FALLBACK: <failed> (<error>); <then>` once, here, and `note` it.
    `failed`: what went wrong, in words ("the 16384-token prefill warm-up failed"; default
    "<what> failed"); `then`: what the engine does instead, kept with the error. Returns the
    error as `Type: message` (a string error as given), at most 300 characters, for the
    caller's own records."""
    why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    logger.warning("FALLBACK: %s (%s); %s", failed or f"{what} failed", why, then)
    note(what, f"{why}; {then}")
    return why[:300]


def taken() -> dict[str, str]:
    """What fell back, and why."""
    with _lock:
        return dict(_taken)


def clear() -> None:
    with _lock:
        _taken.clear()
