"""The torch profiler over a number of the engine's steps, on demand (`POST /admin/api/profile`).

Why: where a step's time goes (which kernels, how long each, how much the device idles between
them) is what decides the next optimisation, and it must be read on the running server under
the user's load, not in a harness that builds its own batches. vLLM and SGLang expose the same
(`/start_profile`); `bench/peer/run.sh profile` reads both tables the same way
(`kernel_category`, `summarize_trace`) to compare one decode step with the other's.

`StepProfile` lives on the engine thread: started between two steps, it counts applied steps
(by kind) and stops after `num_steps`. Nothing runs per step while no profile is asked for
(the engine checks one attribute). The summary (the kernels with the most device time,
grouped by `kernel_category` as well) comes back as a dict and the chrome trace goes to a
file. The engine thread only stops the profiler; the caller's thread writes the trace and a
process of its own reads it (`summarize`, runtime/diagnostics/profile_trace.py): reading a few
hundred GPU steps' events takes seconds of Python, which stalled serving on the engine thread (30 s)
and, on another thread of its process, starved it of the GIL (scoring P50 12 s at 40 QPS).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import torch

# The trace reader's process (runtime/diagnostics/profile_trace.py) runs from the repository root,
# and is given this long (s) for a trace: a few hundred GPU steps' trace reads in seconds.
_REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARSE_TIMEOUT_S = 300.0

# Kernel name -> category, first match wins. The names are those of the libraries both servers
# use (cuBLAS/CUTLASS GEMMs, FlashInfer and FlashAttention, Triton, torch's elementwise
# kernels): a rough map, enough to put two servers' decode steps side by side.
_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Before attention: FlashInfer's KV append kernel has "paged" in its name.
    ("rope_kv_write", re.compile(r"rope|rotary|kv_write|reshape_and_cache|append_?paged", re.I)),
    (
        "attention",
        re.compile(
            r"flash_fwd|flash::|flashattn|fmha|attention|attn|batchdecode|batchprefill|merge_state|paged",
            re.I,
        ),
    ),
    ("gemm", re.compile(r"gemm|cutlass|cublas|sm90_xmma|nvjet|matmul|splitk|wgmma", re.I)),
    ("norm", re.compile(r"rms|norm|rsqrt", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul|swiglu", re.I)),
    (
        "sampling",
        re.compile(
            r"argmax|softmax|topk|top_k|sampl|gumbel|exponential|multinomial|logsumexp|cumsum|sort",
            re.I,
        ),
    ),
    ("copy", re.compile(r"memcpy|memset|copy|cat|index|gather|scatter|fill", re.I)),
)


def kernel_category(name: str) -> str:
    """A device kernel's coarse category (attention, gemm, norm, rope_kv_write, activation,
    sampling, copy, other) from its name."""
    for label, pattern in _CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def summarize_kernels(
    rows: list[tuple[str, int, float]], num_steps: int, wall_ms: float, top: int = 40
) -> dict[str, Any]:
    """`rows`: (kernel name, launches, total device µs). The top kernels by device time and the
    totals per category, per step as well (`num_steps` > 0), and the device-busy share of
    `wall_ms` (kernels on several streams at once can push it past 1)."""
    per_step = max(1, num_steps)
    rows = sorted(rows, key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    cats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, count, us in rows:
        c = cats[kernel_category(name)]
        c[0] += count
        c[1] += us
    return {
        "num_steps": num_steps,
        "wall_ms": round(wall_ms, 3),
        "kernel_ms": round(total_us / 1e3, 3),
        "kernel_ms_per_step": round(total_us / 1e3 / per_step, 4),
        "launches_per_step": round(sum(r[1] for r in rows) / per_step, 1),
        "busy_fraction": round(total_us / 1e3 / wall_ms, 4) if wall_ms > 0 else None,
        "by_category": {
            k: {
                "launches_per_step": round(v[0] / per_step, 2),
                "ms_per_step": round(v[1] / 1e3 / per_step, 4),
                "share": round(v[1] / total_us, 4) if total_us else None,
            }
            for k, v in sorted(cats.items(), key=lambda kv: -kv[1][1])
        },
        "top_kernels": [
            {
                "name": name[:160],
                "category": kernel_category(name),
                "launches_per_step": round(count / per_step, 2),
                "us_per_step": round(us / per_step, 2),
                "us_per_launch": round(us / count, 2) if count else None,
                "share": round(us / total_us, 4) if total_us else None,
            }
            for name, count, us in rows[:top]
        ],
    }


def summarize_host_ops(
    rows: list[tuple[str, int, float]], num_steps: int, top: int = 25
) -> list[dict[str, Any]]:
    """`rows`: (host op name, calls, self CPU µs): the ops the host spent most of its own time
    in, CUDA runtime calls included (`cudaMalloc`, `cudaHostAlloc`, `cudaStreamSynchronize`):
    where a step's host time goes, e.g. a fresh server's first long prompt waiting on
    cuBLAS's first GEMMs of that size (`aten::mm`'s own time)."""
    per_step = max(1, num_steps)
    return [
        {
            "name": name[:160],
            "calls": count,
            "self_cpu_ms": round(us / 1e3, 3),
            "self_cpu_ms_per_step": round(us / 1e3 / per_step, 4),
        }
        for name, count, us in sorted(rows, key=lambda r: -r[2])[:top]
    ]


def summarize_trace(path: str, num_steps: int, top: int = 40) -> dict[str, Any]:
    """The same summary from a chrome trace file (`.json` or `.json.gz`, torch profiler's
    format, e.g. vLLM's): device kernels (`cat` "kernel") by name, and the wall time from the
    first kernel's start to the last one's end. `num_steps` is how many engine steps it holds
    (the caller's count)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    first, last = float("inf"), float("-inf")
    for ev in events:
        if ev.get("ph") != "X" or str(ev.get("cat", "")).lower() != "kernel":
            continue
        ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        a = acc[ev.get("name", "?")]
        a[0] += 1
        a[1] += dur
        first, last = min(first, ts), max(last, ts + dur)
    rows = [(name, int(c), us) for name, (c, us) in acc.items()]
    wall_ms = (last - first) / 1e3 if rows else 0.0
    return summarize_kernels(rows, num_steps, wall_ms, top)


class StepProfile:
    """One profile of the next `num_steps` steps; engine thread only, except `wait`.

    The engine calls `start()` between two steps, `on_step(kind)` for each applied step, and
    `stop()` when `on_step` returns True or when the caller gave up (no steps came); the
    caller then reads `summarize()` on its own thread."""

    def __init__(self, num_steps: int, trace_path: str | None) -> None:
        self.num_steps = num_steps
        self.trace_path = trace_path
        self.steps_by_kind: dict[str, int] = defaultdict(int)
        self.num_done = 0
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._prof: torch.profiler.profile | None = None
        self._stopped: torch.profiler.profile | None = None  # set by `stop`, read by `summarize`
        self._t0 = 0.0
        self._wall_ms = 0.0
        self._stop_ms = 0.0
        self._timed_out = False
        self._on_cuda = False

    def start(self, device: torch.device) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        self._on_cuda = device.type == "cuda"
        if self._on_cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)  # the window starts with the device idle
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.start()
        self._t0 = time.perf_counter()

    def on_step(self, kind: str) -> bool:
        """Count an applied step; True once `num_steps` are in (then call `stop`)."""
        self.steps_by_kind[kind] += 1
        self.num_done += 1
        return self.num_done >= self.num_steps

    def stop(self, timed_out: bool = False) -> None:
        """Stop the profiler and wake `wait`; engine thread. Only the device sync and the
        profiler's own stop run here: its events are parsed later, in `summarize` on the
        caller's thread. Parsing 300 steps' events takes seconds of Python, and on the engine
        thread that stalled every request behind it (H100, 2026-12-05: a server that held 40
        scoring QPS without the profile stopped stepping for 30 s and answered 429s)."""
        try:
            prof = self._prof
            if prof is None:
                raise RuntimeError("the profile never started")
            if self._on_cuda:
                torch.cuda.synchronize()
            t_stop = time.perf_counter()
            self._wall_ms = (t_stop - self._t0) * 1e3
            self._timed_out = timed_out
            prof.stop()
            # What the profile cost the engine thread after its window (the serving stall):
            # the profiler's own stop collects every recorded event, seconds for 300 steps.
            self._stop_ms = (time.perf_counter() - t_stop) * 1e3
            self._stopped = prof
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the engine goes on
            self.error = e
        finally:
            self._prof = None
            self._done.set()

    def summarize(self) -> dict[str, Any]:
        """The summary of a stopped profile (kernels, host ops, steps by kind), and its chrome
        trace written to `trace_path` when given; the caller's thread, after `wait`. Raises
        what stopping raised, or RuntimeError when the profile has not stopped."""
        if self.error is not None:
            raise self.error
        prof = self._stopped
        if prof is None:
            raise RuntimeError("the profile has not stopped")
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        # The events go to a chrome trace (kineto's writer) and are read in a process of its
        # own (runtime/diagnostics/profile_trace.py): read here, in the engine's process, they held
        # the GIL the engine thread needs for seconds.
        path = self.trace_path
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        else:
            fd, path = tempfile.mkstemp(prefix="greenlane-profile-", suffix=".json")
            os.close(fd)
        try:
            prof.export_chrome_trace(path)
            export_ms = (time.perf_counter() - t0) * 1e3
            device = "cuda" if self._on_cuda else "cpu"
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "runtime.diagnostics.profile_trace",
                    path,
                    "--device",
                    device,
                ],
                capture_output=True,
                text=True,
                timeout=PARSE_TIMEOUT_S,
                cwd=_REPO_DIR,
            )
            if done.returncode != 0:
                raise RuntimeError(f"reading the trace failed: {done.stderr.strip()[-500:]}")
            rows = json.loads(done.stdout)
        finally:
            if not self.trace_path:
                os.unlink(path)
        summary = summarize_kernels(
            [tuple(r) for r in rows["device"]], self.num_done, self._wall_ms
        )
        summary["what"] = "CUDA kernels" if self._on_cuda else "CPU ops (no CUDA device)"
        summary["host_ops"] = summarize_host_ops([tuple(r) for r in rows["host"]], self.num_done)
        summary["steps_by_kind"] = dict(self.steps_by_kind)
        summary["num_steps_asked"] = self.num_steps
        summary["timed_out"] = self._timed_out
        if self.trace_path:
            summary["trace_path"] = self.trace_path
        summary["engine_stop_ms"] = round(self._stop_ms, 1)
        # In the engine's process (sharing the GIL with the engine thread): the trace's export.
        summary["export_ms"] = round(export_ms, 1)
        summary["summarize_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        self.result = summary
        return summary

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)
