"""Bursts of requests submitted at once to engines in this process (no HTTP), for the
engine-level benchmarks (`bench.budget`, `bench.shared_prefix`): start engines and warm them
up, run a burst until every answer is in, take medians over repeats."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.config import EngineConfig
from runtime.request import EngineOutput, Request, RequestKind


def git_revision() -> str:
    """The tree's revision, read at run time. A device copy may carry stale git metadata
    (seen: an old HEAD, "+dirty"); a plan that knows better exports GREENLANE_REVISION (the
    revision as read on the machine that sent the tree), recorded beside what git says."""
    given = os.environ.get("GREENLANE_REVISION")
    read = _git_head()
    return read if not given else f"{given} (git here reads {read})"


def _git_head() -> str:
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
        self.finished: dict[str, EngineOutput] = {}
        self.expected = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def sink(self, outs: list[EngineOutput]) -> None:
        """The engine's sink: one step's outputs."""
        with self._lock:
            for out in outs:
                if out.finished:
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


def alternate(
    engines: dict[Any, Any],
    repeats: int,
    run_one: Callable[[Any, Any, int], dict[str, float]],
    describe: Callable[[Any, int, dict[str, float]], str],
) -> dict[Any, list[dict[str, float]]]:
    """Repeats alternate the engines (A B A B ...) so a change in machine load hits all of
    them; `run_one(key, engine, repeat)` measures one burst, `describe` prints it (stderr).
    The engines are shut down at the end, also after a failure."""
    runs: dict[Any, list[dict[str, float]]] = {k: [] for k in engines}
    try:
        for r in range(repeats):
            for key, engine in engines.items():
                res = run_one(key, engine, r)
                runs[key].append(res)
                print(describe(key, r, res), file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return runs


def device_name() -> str:
    """The accelerator this runs beside, as nvidia-smi names it ("cpu" without one)."""
    from bench.serve import nvidia_smi_gpus

    return ", ".join(nvidia_smi_gpus("name") or []) or "cpu"


def provenance(prog: str, argv: list[str] | None) -> dict[str, Any]:
    """What every result file records: the command, git revision, device, date and machine."""
    import torch

    return {
        "command": f"python -m {prog} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_revision": git_revision(),
        "device": device_name(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write a result file (folders made as needed); None: nothing to write."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")
