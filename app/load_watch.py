"""Whether this API server process is what clients wait for: its CPU share, watched at a
fixed rate.

Why: one API server process does the HTTP, the JSON, the validation and the prefix-cache
digests of every request, one thread at a time under the GIL. On an H100 (2026-12-05,
docs/scheduling.md "The served path measured") scoring 14k-token id prompts whose prefixes were
cached, the one process logged 134-151 requests a second while its clients waited 5 s: the
requests queued before the server's clock started, so its logged times and its metrics said
nothing of it. A process that keeps close to a whole core busy is that case. This says so in
the log (at most once per `WARN_EVERY_S`) and in /metrics (`greenlane_api_server_cpu_share`),
naming the option that adds processes (`--api-server-count`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from app.settings import MAX_API_SERVERS

log = logging.getLogger("greenlane.app")

SAMPLE_EVERY_S = 5.0  # one sample: two clock reads, off the request path
# CPU seconds per second at or above which the process counts as saturated: its threads share
# one interpreter lock, so a share near 1 leaves no room (a digest thread can push it past 1).
BUSY_SHARE = 0.9
BUSY_SAMPLES = 2  # consecutive busy samples before warning: one burst is not a ceiling
WARN_EVERY_S = 300.0


class FrontEndLoad:
    """The API process's CPU share per window (`sample`, every `SAMPLE_EVERY_S` from `run`),
    handed to `on_share` (the metrics gauge), and a warning when it stays saturated.

    `cpu_s` and `clock_s` are the process's CPU time and a monotonic clock (tests pass fakes)."""

    def __init__(
        self,
        api_server_count: int,
        on_share: Callable[[float], None] | None = None,
        cpu_s: Callable[[], float] = time.process_time,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api_server_count = api_server_count
        self.on_share = on_share
        self._cpu_s, self._clock_s = cpu_s, clock_s
        self._last_cpu_s, self._last_s = cpu_s(), clock_s()
        self.cpu_share: float | None = None
        self._busy_run = 0
        self._warned_s: float | None = None

    def sample(self) -> float | None:
        """The CPU share since the previous sample (None for an empty window)."""
        cpu_s, now_s = self._cpu_s(), self._clock_s()
        wall_s = now_s - self._last_s
        if wall_s <= 0:
            return None
        share = (cpu_s - self._last_cpu_s) / wall_s
        self._last_cpu_s, self._last_s = cpu_s, now_s
        self.cpu_share = share
        if self.on_share is not None:
            self.on_share(share)
        self._busy_run = self._busy_run + 1 if share >= BUSY_SHARE else 0
        if self._busy_run >= BUSY_SAMPLES and (
            self._warned_s is None or now_s - self._warned_s >= WARN_EVERY_S
        ):
            self._warned_s = now_s
            log.warning(
                "API server process %d used %.0f %% of a core over the last %.0f s (one of %d): "
                "requests wait for it before the server's clock starts, so clients see longer "
                "times than the server logs. More processes share the HTTP work: "
                "--api-server-count %d",
                os.getpid(),
                100 * share,
                wall_s,
                self.api_server_count,
                min(2 * self.api_server_count, MAX_API_SERVERS),
            )
        return share

    async def run(self) -> None:
        """Sample every `SAMPLE_EVERY_S` until cancelled."""
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            self.sample()
