"""Where the engine's host time goes under scoring next to chat: py-spy over the server's
processes and the torch profiler over the engine's steps, on one running server under load.

Why: next to scoring, short suffix steps (a post of ~150 tokens after a user's 14k-token cached
profile, beside a few decodes) are 40-78 % of the mixed steps on the H200, "launch" for about
as long as they run (6-10 ms; ~3 ms of device work) and spend 1.3-2.7 ms in planning, and their
cost moves with the host's state from run to run (docs/benchmarks.md, "The cap's second
repeats"). A launch's wall time also holds any time the host blocked in it, so the step traces
cannot say what the host does; this reads it.

What, in one call against a server already running (`--url`):
  1. the side's settings through the admin API (`--settings`, as plan cap's sides);
  2. chat streaming in the background (ShareGPT at `--chat-qps`) and scoring at a fixed rate
     (`--score-workload`, primed when it is a stream of users) for `--duration-s`;
  3. after `--warm-s`, py-spy (raw samples, idle frames left out) over every server process
     for `--py-spy-s`, then the engine's step trace (the last 4,096 steps), then the torch
     profiler over the next `--profile-steps` steps;
  4. one JSON: the settings, each process's role and CPU use, the py-spy summary of each
     (`summarize_raw`: the frames with the most samples, own and below them), the step
     trace's medians by kind, the profiler's summary (kernels and host ops per step, device
     busy fraction, how long its stop held the engine thread) and the load's figures. The
     load's latencies include the profile's cost; the py-spy and step figures do not.

    python -m bench.host_profile --url http://127.0.0.1:8011 \
        --settings partition=off,budget=2048,tbt=none --score-qps 40 --out-dir /tmp/prof

    python -m bench.host_profile --steps searches/c16k/post-recommendation-0.5-fcfs-r1.steps.json.gz

reads a saved step trace instead (`device_load`: busy share, batches priced per request, the
cold one-prompt steps' device time per token and launch against device time).

An engine-level diagnostic run through the product path; its figures are not headline ones.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def summarize_raw(path: Path, top: int = 30) -> dict[str, Any]:
    """A py-spy `--format raw` file (one line per distinct stack, `f1;f2;...;fN COUNT`, outer
    frame first) -> the samples, the frames with the most samples of their own (the leaf), and
    the frames with the most samples at or below them (each counted once a stack)."""
    own: Counter[str] = Counter()
    below: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            below[f] += n

    def rows(c: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"frame": f[:200], "samples": n, "share": round(n / total, 4)}
            for f, n in c.most_common(top)
        ]

    return {"samples": total, "own": rows(own), "at_or_below": rows(below)}


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    import httpx

    r = httpx.post(url, json=body, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def step_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's step trace of the run, summarised: the short suffix steps beside decodes
    (`bench.step_fit.short_steps`), and the decode-only and prefill-only steps' medians (device,
    launch and plan time, the device's idle before them; prefill-only: also their tokens and
    sequences). The prefill-only steps' host times are what a simulator of scoring alone leaves
    out (`bench.sim`'s `step_overhead_s`)."""
    import numpy as np

    from bench.step_fit import short_steps

    def medians(kind: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {"num_steps": len(kind)}
        for k in keys:
            vals = [s[k] for s in kind if s.get(k) is not None]
            out[f"{k}_p50"] = float(np.median(vals)) if vals else None
        return out

    timed = [s for s in steps if s.get("launch_ms") and not s.get("on_split")]
    decode = [s for s in timed if s.get("num_decodes") and not s.get("num_prefill_tokens")]
    prefill = [s for s in timed if s.get("num_prefill_tokens") and not s.get("num_decodes")]
    # (launch_wait_ms: of the launch, the host's waits for the device; traces since 2026-12-07)
    host = ("device_ms", "launch_ms", "launch_wait_ms", "plan_ms", "idle_before_ms")
    return {
        "num_steps": len(steps),
        "short_steps": short_steps(steps),
        "decode_steps": medians(decode, host),
        "prefill_steps": medians(prefill, (*host, "num_prefill_tokens", "num_prefill_seqs")),
        "device_load": device_load(steps),
    }


# Steps the engine's trace keeps (runtime.engine.STEP_TRACE_LEN; /admin/api/steps' most).
TRACE_STEPS = 4096


def steps_since(
    steps: list[dict[str, Any]], started_s: float, answered_s: float
) -> list[dict[str, Any]]:
    """The steps of a trace (`/admin/api/steps`, each with its `age_s`) that ended since
    `started_s`, this process's monotonic clock. `answered_s`: the same clock read after the
    server answered. The server ages its steps as it answers, so a clock read before asking is
    short by the request's own time and, on a loaded machine, leaves out a step that ended
    soon after `started_s` (a CI flake, 2026-12-05)."""
    window_s = answered_s - started_s
    return [s for s in steps if s.get("age_s") is not None and s["age_s"] <= window_s]


# A device gap longer than this is taken for "no work queued" (between probes, a drained
# queue), not for the host's time between two steps: a step's own host work is 1-10 ms.
NO_WORK_GAP_MS = 50.0
# Prefill-only steps grouped by their number of requests: [low, high] inclusive.
BATCH_BANDS = ((1, 1), (2, 8), (9, 32), (33, 128), (129, 1 << 30))


def read_json(path: Path) -> Any:
    """A saved JSON file, gzipped when its name ends in `.gz` (step traces and search records
    are committed so)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cold_prefill(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-prompt prefill-only steps with nothing cached (a cold scoring prompt alone):
    their device time per new token, and whether their launch held the engine thread — the
    launch's wall time against the device's (a launch whose kernels outrun the launch queue
    returns only near the step's end; docs/scheduling.md, "A 16,384-token prefill chunk")."""
    cold = [
        s
        for s in steps
        if s.get("num_prefill_seqs") == 1
        and not s.get("num_decodes")
        and not s.get("prefill_context_tokens")
        and s.get("num_prefill_tokens")
    ]
    launched = [s for s in cold if s.get("launch_ms") is not None and s["device_ms"] > 0]
    tokens = sum(s["num_prefill_tokens"] for s in cold)
    return {
        "num_steps": len(cold),
        "new_tokens_p50": _p50([s["num_prefill_tokens"] for s in cold]),
        "device_ms_p50": _p50([s["device_ms"] for s in cold]),
        "device_us_per_token": 1000 * sum(s["device_ms"] for s in cold) / tokens
        if tokens
        else None,
        "launch_ms_p50": _p50([s["launch_ms"] for s in launched]),
        "launch_over_device_p50": _p50([s["launch_ms"] / s["device_ms"] for s in launched]),
    }


def device_load(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the device or the host set the pace over the trace, and what a prefill-only step
    cost per request at each batch size: the GPU's own batch model, read off a served load
    (docs/scheduling.md: the simulator prices batches of 20-60 warm requests from points of 4
    and 16). `busy_share`: device time over device time plus the host's gaps between steps
    (gaps of `NO_WORK_GAP_MS` or more are counted apart, as `no_work_gaps`: nothing queued).
    Whole-GPU steps with a device time only (a split's partitions overlap)."""
    whole = [s for s in steps if not s.get("on_split") and s.get("device_ms") is not None]
    device_ms = sum(s["device_ms"] for s in whole)
    # Steps that discarded prompt KV beside prefill context: the FlashInfer backend copied
    # every member's context in every layer (traces before 2026-12-05 lack the field: None).
    gathered = [
        s
        for s in whole
        if (s.get("prefill_discarded_tokens") or 0) > 0 and s.get("prefill_context_tokens")
    ]
    traced = any("prefill_discarded_tokens" in s for s in steps)
    gaps = [s["idle_before_ms"] for s in whole if s.get("idle_before_ms") is not None]
    host_gap_ms = sum(g for g in gaps if g < NO_WORK_GAP_MS)
    bands = []
    for low, high in BATCH_BANDS:
        band = [
            s
            for s in whole
            if s.get("num_prefill_tokens")
            and not s.get("num_decodes")
            and low <= (s.get("num_prefill_seqs") or 0) <= high
        ]
        if not band:
            continue
        seqs = sum(s["num_prefill_seqs"] for s in band)
        band_ms = sum(s["device_ms"] for s in band)
        bands.append(
            {
                "num_seqs": [low, high] if high < 1 << 30 else [low, None],
                "num_steps": len(band),
                "num_requests": seqs,
                "device_ms_per_seq": band_ms / seqs,
                "new_tokens_per_seq": sum(s["num_prefill_tokens"] for s in band) / seqs,
                "context_tokens_per_seq": sum(s.get("prefill_context_tokens") or 0 for s in band)
                / seqs,
            }
        )
    return {
        "num_steps": len(whole),
        "device_ms": device_ms,
        "cold_prefill": cold_prefill(whole),
        "host_gap_ms": host_gap_ms,
        "busy_share": device_ms / (device_ms + host_gap_ms) if device_ms + host_gap_ms else None,
        "no_work_gaps": sum(1 for g in gaps if g >= NO_WORK_GAP_MS),
        # Their length: between probes they are the harness's, within one they would be a
        # device waiting with requests queued (only a per-probe reading tells them apart:
        # bench.sim_vs_gpu's `steps_in_probe`).
        "no_work_gap_ms": sum(g for g in gaps if g >= NO_WORK_GAP_MS),
        "gathered_steps": len(gathered) if traced else None,
        "gathered_device_ms": sum(s["device_ms"] for s in gathered) if traced else None,
        "prefill_by_batch": bands,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--settings", default="", help="admin settings first (plan cap's sides)")
    ap.add_argument("--score-workload", default="post-recommendation-stream")
    ap.add_argument("--score-qps", type=float, default=40.0)
    ap.add_argument("--chat-qps", type=float, default=2.0)
    ap.add_argument("--scale", type=float, default=1.0, help="prompt lengths (bench.serve's)")
    ap.add_argument("--duration-s", type=float, default=24.0, help="seconds of scoring arrivals")
    ap.add_argument("--warm-s", type=float, default=6.0, help="load before py-spy starts")
    ap.add_argument("--py-spy-s", type=float, default=8.0, help="0: no py-spy")
    ap.add_argument("--profile-steps", type=int, default=300, help="0: no torch profile")
    ap.add_argument("--out-dir", type=Path, help="where the profile's files go (required)")
    ap.add_argument(
        "--steps",
        type=Path,
        help="instead: print the device load of a saved step trace (a search's "
        "STEM.steps.json[.gz], bench.gpu_scheduling) and exit",
    )
    ap.add_argument("--tag", default="host-profile")
    ap.add_argument(
        "--server-revision",
        default="",
        help="the served tree's git revision when it is not this one's (plan hostab's old side)",
    )
    args = ap.parse_args(argv)
    if args.steps is not None:
        trace = read_json(args.steps)
        steps = trace["steps"] if isinstance(trace, dict) else trace
        print(json.dumps(device_load(steps), indent=1))
        return 0
    if args.out_dir is None:
        ap.error("--out-dir is required (unless --steps)")

    import httpx

    from bench.bursts import provenance
    from bench.decode import CpuMeter, _role, py_spy, server_processes
    from bench.gpu_serving import apply_settings, prime_args

    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    port = int(args.url.rsplit(":", 1)[1].split("/")[0])
    record: dict[str, Any] = {
        **provenance("bench.host_profile", argv),
        "note": "engine-level diagnostic through a running server; not a headline figure",
        # The server's tree: this client's revision unless another tree was served.
        "server_revision": args.server_revision or None,
    }
    if args.settings:
        record["settings"] = apply_settings(args.url, args.settings)
    serve = [sys.executable, "-m", "bench.serve", "--url", args.url, "--no-progress"]
    serve += ["--scale", str(args.scale)]
    chat = subprocess.Popen(
        [
            *serve,
            *["--workload", "sharegpt", "--qps", str(args.chat_qps), "--seed", "7"],
            *["--duration", str(args.duration_s + 10), "--no-reset-prefix-cache"],
            *["--out", str(out_dir / f"{args.tag}-chat.json")],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(2.0)  # chat streams before the scoring starts
    score_out = out_dir / f"{args.tag}-score.json"
    score = subprocess.Popen(
        [
            *serve,
            *["--workload", args.score_workload, *prime_args(args.score_workload)],
            *["--qps", str(args.score_qps), "--duration", str(args.duration_s), "--seed", "0"],
            *["--out", str(score_out)],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs = server_processes(port)
    record["processes"] = {str(p.pid): _role(p) for p in procs}
    time.sleep(args.warm_s)
    meter = CpuMeter(procs)
    meter.start()
    files = py_spy(procs, args.py_spy_s, out_dir, args.tag) if args.py_spy_s > 0 else []
    time.sleep(max(args.py_spy_s, 4.0) + 2.0)
    record["cpu_percent_while_sampled"] = meter.read()
    # The step trace before the torch profile: the profiler slows the steps it records and
    # stalls the engine thread when it stops (`engine_stop_ms`), and on the H100 (2026-12-05)
    # the trace read afterwards held a backlog of queued requests, not the load's steps.
    try:  # the trace's last 4,096 steps: the scoring window's, py-spy's included
        r = httpx.get(args.url + "/admin/api/steps", params={"limit": "4096"}, timeout=30)
        r.raise_for_status()
        steps = r.json()["steps"]
        (out_dir / f"{args.tag}-steps.json").write_text(json.dumps(steps))
        record["steps"] = step_summary(steps)
    except Exception as exc:  # noqa: BLE001 - the load's figures stand on their own
        record["steps"] = {"error": str(exc)[:400]}
    if args.profile_steps:
        try:
            record["torch_profile"] = _post_json(
                args.url + "/admin/api/profile",
                {"num_steps": args.profile_steps, "timeout_s": 30.0},
                timeout_s=60,
            )
        except Exception as exc:  # noqa: BLE001 - the py-spy half stands on its own
            record["torch_profile"] = {"error": str(exc)[:400]}
    try:
        _, err = score.communicate(timeout=args.duration_s + 120)
    except subprocess.TimeoutExpired:  # an overloaded server: keep what was sampled
        score.terminate()  # SIGTERM: bench.serve writes what completed
        _, err = score.communicate(timeout=30)
    chat.terminate()  # SIGTERM: bench.serve writes what completed
    chat.wait(30)
    record["py_spy"] = {}
    for f in files:
        pid = Path(f).stem.rsplit("-", 1)[-1]
        role = record["processes"].get(pid, "?")
        p = Path(f)
        record["py_spy"][f"{pid}:{role}"] = (
            summarize_raw(p) if p.exists() else {"error": "no samples written"}
        )
    if score.returncode == 0 and score_out.exists():
        metrics = json.loads(score_out.read_text()).get("metrics", {})
        keep = ("completed", "failed", "failure_reasons", "ttft_ms", "request_throughput")
        record["score_load"] = {k: metrics.get(k) for k in keep}
    else:
        record["score_load"] = {"error": (err or "")[-400:]}
    path = out_dir / f"{args.tag}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    print(f"steps: {json.dumps(record['steps'])}")
    for key, s in record["py_spy"].items():
        if "own" in s:
            print(f"== {key}: {s['samples']} samples; most own samples:")
            for row in s["own"][:12]:
                print(f"  {row['share']:6.1%}  {row['frame']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
