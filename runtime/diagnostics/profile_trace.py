"""A torch profiler chrome trace read into summary rows, in a process of its own.

Why a process: reading a profile's events in Python takes seconds (`key_averages` over 300
steps of a scoring load: 16 s on the H100's host, 2026-12-05), and any thread of the engine
core process that does it holds the GIL the engine thread needs: a server that held 40 scoring
QPS answered with a P50 of 12 s while the summary was built on the admin caller's thread. The
engine's process only writes the trace (kineto's own writer, C++) and runs
`python -m runtime.diagnostics.profile_trace TRACE --device cuda|cpu`, which prints the rows as
JSON.

Rows are (name, count, µs), as `runtime.diagnostics.profiling.summarize_kernels` and
`summarize_host_ops` take them:
- device rows: kernels, copies and memsets (`cat` kernel / gpu_memcpy / gpu_memset) by name
  and their summed durations; without a CUDA device, the host ops' own time instead (what the
  CPU ran);
- host rows: each host op's own time (`cat` cpu_op, cuda_runtime, cuda_driver): its duration
  less that of the ops nested directly in it on the same thread.

Pure Python (json only): no torch import, so the process starts in well under a second.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from typing import Any

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "cuda_runtime", "cuda_driver"})

Row = tuple[str, int, float]


def _rows(acc: dict[str, list[float]]) -> list[Row]:
    return [(name, int(c), us) for name, (c, us) in acc.items()]


def read_trace(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def host_self_rows(events: list[dict[str, Any]]) -> list[Row]:
    """Each host op's own time by name: its duration less its direct children's, where a
    child is an op of the same thread that lies within it (the profiler's nesting)."""
    by_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() in HOST_CATS:
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
            by_thread[(ev.get("pid"), ev.get("tid"))].append((ts, dur, ev.get("name", "?")))
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ops in by_thread.values():
        ops.sort(key=lambda o: (o[0], -o[1]))  # a parent before the children it starts with
        # Open ops: [end, own µs so far, name]; an op is closed when the next starts after it.
        stack: list[list[Any]] = []

        def close(item: list[Any]) -> None:
            a = acc[item[2]]
            a[0] += 1
            a[1] += max(item[1], 0.0)

        for ts, dur, name in ops:
            while stack and ts >= stack[-1][0]:
                close(stack.pop())
            if stack:
                stack[-1][1] -= dur  # the parent's own time excludes this child
            stack.append([ts + dur, dur, name])
        while stack:
            close(stack.pop())
    return _rows(acc)


def device_rows(events: list[dict[str, Any]]) -> list[Row]:
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in events:
        if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() in DEVICE_CATS:
            a = acc[ev.get("name", "?")]
            a[0] += 1
            a[1] += float(ev.get("dur", 0.0))
    return _rows(acc)


def trace_rows(path: str, on_cuda: bool) -> dict[str, list[Row]]:
    """{"device": rows, "host": rows} of one trace (see the module docstring)."""
    events = read_trace(path)
    host = host_self_rows(events)
    return {"device": device_rows(events) if on_cuda else host, "host": host}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.diagnostics.profile_trace")
    p.add_argument("trace")
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = p.parse_args(argv)
    json.dump(trace_rows(args.trace, args.device == "cuda"), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
