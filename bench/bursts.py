"""Bursts of requests submitted at once to engines in this process (no HTTP), for the
engine-level benchmarks (`bench.budget`, `bench.shared_prefix`): start engines and warm them
up, run a burst until every answer is in, take medians over repeats."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from typing import Any

from runtime.config import EngineConfig
from runtime.request import Request, RequestKind, RequestOutput


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True
        ).stdout
        return out.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Burst:
    """Collects the finished outputs of one burst."""

    def __init__(self) -> None:
        self.finished: dict[str, RequestOutput] = {}
        self.expected = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def sink(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        with self._lock:
            self.finished[out.request_id] = out
            if len(self.finished) >= self.expected:
                self.done.set()


def run_burst(engine: Any, burst: Burst, prompts: list[list[int]], tag: str) -> dict[str, float]:
    burst.finished.clear()
    burst.done.clear()
    burst.expected = len(prompts)
    steps_before = engine.stats()["num_steps"]
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(Request(f"{tag}-{i}", RequestKind.SCORE, list(ids), label_token_ids=[1, 2]))
    if not burst.done.wait(timeout=3600):
        raise TimeoutError("burst did not finish")
    wall_s = time.perf_counter() - t0
    outs = list(burst.finished.values())
    bad = [o for o in outs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"requests failed: {bad[0].error}")
    # Stats are published after each step; wait for the last one to be visible.
    time.sleep(0.05)
    num_tokens = sum(len(p) for p in prompts)
    return {
        "wall_s": wall_s,
        "tokens_per_s": num_tokens / wall_s,
        "num_forwards": float(engine.stats()["num_steps"] - steps_before),
        "mean_latency_s": statistics.mean(o.e2e_s or 0.0 for o in outs),
    }


def start_engines(
    configs: dict[Any, EngineConfig], burst: Burst, warm: list[list[int]]
) -> dict[Any, Any]:
    """Build and start one engine per config (same key), each warmed up with `warm` so that
    first-call allocations stay off the clock. Only one computes at a time in the benchmarks
    (the others idle on their queues)."""
    from runtime.engine import Engine  # lazily: loads torch

    engines: dict[Any, Any] = {}
    for key, cfg in configs.items():
        engine = Engine(cfg, burst.sink)
        engine.start()
        run_burst(engine, burst, warm, f"warm{key}")
        engines[key] = engine
    return engines


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeats."""
    return {k: statistics.median(x[k] for x in runs) for k in runs[0]}
