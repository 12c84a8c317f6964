"""Profile one server's steps under the load that runs against it, the same way for both.

Greenlane: `POST /admin/api/profile` (the torch profiler over its next N steps; it writes the
chrome trace). vLLM: `POST /start_profile` with the server started with `--profiler-config`
(`max_iterations` N: its worker stops the profiler itself after N steps and writes the trace
under `torch_profiler_dir`). Both traces are then read by the same code
(`runtime.diagnostics.profiling.summarize_trace`): device kernels by name and category per step, and
the share of the window the device was busy. Diagnostic numbers (the profiler slows both), not a
headline.

    python -m bench.peer.profile_steps --server greenlane --url URL --steps 200 --out F
    python -m bench.peer.profile_steps --server vllm --url URL --steps 200 \
        --trace-dir /tmp/peer/vprof --out F
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from runtime.diagnostics.profiling import summarize_trace


def _post(url: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, bytes]:
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def profile_greenlane(url: str, num_steps: int, timeout_s: float) -> dict[str, Any]:
    status, raw = _post(
        f"{url}/admin/api/profile",
        {"num_steps": num_steps, "timeout_s": timeout_s, "trace": True},
        timeout_s + 180,
    )
    if status != 200:
        raise RuntimeError(f"greenlane profile: HTTP {status}: {raw[:300]!r}")
    server = json.loads(raw)
    out: dict[str, Any] = {"server_summary": server}
    if server.get("trace_path"):
        out["trace_summary"] = summarize_trace(server["trace_path"], server["num_steps"])
    return out


def profile_vllm(url: str, num_steps: int, trace_dir: str, timeout_s: float) -> dict[str, Any]:
    before = set(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True))
    status, raw = _post(f"{url}/start_profile", None, 60)
    if status != 200:
        raise RuntimeError(f"vllm start_profile: HTTP {status}: {raw[:300]!r}")
    # Its worker stops after `max_iterations` steps and writes the trace; wait for the file to
    # appear and stop growing.
    end = time.monotonic() + timeout_s
    found: str | None = None
    while time.monotonic() < end:
        new = sorted(
            set(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)) - before,
            key=os.path.getmtime,
        )
        new = [p for p in new if "trace" in os.path.basename(p)]
        if new:
            size = os.path.getsize(new[-1])
            time.sleep(2.0)
            if os.path.getsize(new[-1]) == size:
                found = new[-1]
                break
        time.sleep(1.0)
    _post(f"{url}/stop_profile", None, 120)  # clears its state for the next profile
    if found is None:
        raise RuntimeError(f"vllm wrote no trace under {trace_dir} within {timeout_s} s")
    out: dict[str, Any] = {"trace_path": found, "trace_summary": summarize_trace(found, num_steps)}
    table = os.path.join(trace_dir, "profiler_out_0.txt")
    if os.path.exists(table):
        with open(table) as f:
            out["server_table_head"] = f.read()[:6000]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=["greenlane", "vllm"], required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trace-dir", default="/tmp/peer/vprof", help="vLLM's torch_profiler_dir")
    ap.add_argument("--timeout-s", type=float, default=90.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    try:
        if args.server == "greenlane":
            res = profile_greenlane(args.url, args.steps, args.timeout_s)
        else:
            res = profile_vllm(args.url, args.steps, args.trace_dir, args.timeout_s)
    except Exception as e:  # noqa: BLE001 - recorded, the call goes on with the other side
        res = {"error": f"{type(e).__name__}: {e}"}
    res.update(server=args.server, num_steps=args.steps, started_unix_s=t0, what="diagnostic")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    s = res.get("trace_summary") or {}
    print(
        f"{args.server}: {s.get('kernel_ms_per_step')} kernel ms/step, busy "
        f"{s.get('busy_fraction')}, {s.get('launches_per_step')} launches/step",
        {k: v["ms_per_step"] for k, v in (s.get("by_category") or {}).items()},
        res.get("error", ""),
    )


if __name__ == "__main__":
    main()
