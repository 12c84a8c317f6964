"""Decode speed through the product path: streamed `/v1/completions` against a running server.

For each batch size B it opens B concurrent streams with prompts of `--context` random token ids
(distinct per stream, never one repeated token; the prefix cache is reset first, so prompts are
cold), `ignore_eos`, and measures what a client sees: the gaps between content chunks (ITL)
once every stream is decoding, and the decode tokens/s of the server. Beside it, from the same
window:
  - the bandwidth floor of one decode step: the weight bytes a step reads (the embedding table
    only when it is also the LM head) plus the KV bytes of the batch's contexts, over the copy
    bandwidth measured in this run (device-to-device, read + write bytes; `--copy-gbs` when the
    client has no GPU), and the ITL's ratio to it;
  - the engine-level decode step time (device time of decode steps, CUDA events, from the
    engine's counters) and the GPU idle fraction between consecutive decode steps: engine
    diagnostics, read from /metrics (absent on servers that do not export them);
  - optionally (`--prefill-check N`), one cold N-token scoring prompt end to end and its
    model FLOP rate against the measured matmul peak (prefill must not regress), with the
    engine's own steps for it (/admin/api/steps: device time and the host's gap before each),
    which say whether a slow reading (a fresh server's first long prompt) lost its time on
    the GPU or on the host;
  - the CPU use of the server's processes (the API server(s) and the engine core: psutil over
    the process tree listening on the port), and optionally a py-spy profile of each;
  - the client's own CPU use. The streams are spread over `--client-procs` processes (default
    one per 16 streams): one Python client reading 48 streams of ~250 chunks/s each (12k SSE
    events a second, each parsed as JSON) can itself be the bottleneck, and then its timestamps
    bunch up — a gap distribution of the client, not the server. `client_cpu_percent_max` says
    how close the busiest client process came to a full core.

    python -m bench.decode --url http://127.0.0.1:8000 --shape llama-3.1-8b --batches 1,16,64 \
        --context 2048 --output-tokens 160 --out decode.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from bench.bursts import provenance
from bench.serve import prometheus_samples
from runtime.model.presets import get_preset

# Engine counters (runtime/engine.py stats, exported by app/metrics.py under these names).
_COUNTERS = {
    "decode_device_s": (
        "greenlane_engine_decode_device_s",
        "greenlane_engine_decode_device_s_total",
    ),
    "decode_idle_s": ("greenlane_engine_decode_idle_s", "greenlane_engine_decode_idle_s_total"),
    "num_decode_steps": (
        "greenlane_engine_num_decode_steps",
        "greenlane_engine_num_decode_steps_total",
    ),
    "num_decode_tokens": (
        "greenlane_engine_num_decode_tokens",
        "greenlane_engine_num_decode_tokens_total",
    ),
}


def decode_bytes(shape: str, batch: int, context: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of `batch` sequences of `context` tokens reads."""
    cfg = get_preset(shape)
    params = cfg.num_params
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size  # the embedding: B rows, not the table
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return params * dtype_bytes, kv


def measure_ceilings() -> dict[str, float] | None:
    """The GPU's measured bf16 matmul rate and copy bandwidth (bench/gpu_suite.py's
    ceilings), or None without CUDA on this side."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from bench.gpu_suite import section_ceilings

    out = section_ceilings()
    torch.cuda.empty_cache()
    return out


def _int_list(text: str) -> list[int]:
    """'16384,32768' -> [16384, 32768]; '' -> []."""
    return [int(x) for x in text.split(",") if x.strip()]


def prefill_check(
    url: str,
    model: str,
    shape: str,
    num_tokens: int,
    peak_tflops: float | None,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """One cold scoring prompt of `num_tokens` random ids end to end (HTTP): seconds, and the
    model FLOPs it did over that time against the measured matmul peak. `profile_steps` > 0:
    the server's torch profiler runs over the prompt's steps (POST /admin/api/profile, asked
    just before the prompt; it adds its own overhead, so such readings say where the time
    goes, not how much there is)."""
    from bench.gpu_suite import _flops_prefill

    cfg = get_preset(shape)
    rng = random.Random(12345)
    lo = min(1000, cfg.vocab_size // 2)  # skip the low ids (specials) when there is room
    prompt = [rng.randrange(lo, min(cfg.vocab_size, 40000)) for _ in range(num_tokens)]
    body = {"model": model, "query": prompt, "label_token_ids": [1, 2]}
    profile: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post("/admin/api/prefix-cache/reset", json={})
        worker = None
        if profile_steps > 0:
            worker = threading.Thread(
                target=_profile_into, args=(url, profile_steps, profile), daemon=True
            )
            worker.start()
            time.sleep(0.5)  # the engine thread starts the profiler between two (idle) steps
        t0 = time.monotonic()
        r = c.post("/v1/score", json=body)
        e2e_s = time.monotonic() - t0
        r.raise_for_status()
        steps = engine_steps_within(c, t0)
        if worker is not None:
            worker.join(60)
    server_s = r.json().get("timing", {}).get("server_s")
    tflops = _flops_prefill(cfg, num_tokens) / e2e_s / 1e12
    out = {
        "num_tokens": num_tokens,
        "e2e_s": e2e_s,
        "server_s": server_s,
        "tflops_e2e": tflops,
        "fraction_of_peak_e2e": tflops / peak_tflops if peak_tflops else None,
        "engine_steps": steps,
    }
    if profile_steps > 0:
        out["profile"] = profile or None
    return out


def _profile_into(url: str, num_steps: int, into: dict[str, Any]) -> None:
    """POST /admin/api/profile for `num_steps` steps (it answers when they ran or after its
    timeout); the parts of its summary a prefill reading keeps go into `into`."""
    try:
        r = httpx.post(
            f"{url}/admin/api/profile",
            json={"num_steps": num_steps, "timeout_s": 5},
            timeout=120,
        )
    except httpx.HTTPError as e:
        into["error"] = f"{type(e).__name__}: {e}"
        return
    if r.status_code != 200:
        into["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
        return
    s = r.json()
    for key in ("num_steps", "steps_by_kind", "timed_out", "wall_ms", "kernel_ms", "by_category"):
        into[key] = s.get(key)
    into["top_kernels"] = (s.get("top_kernels") or [])[:12]
    into["host_ops"] = (s.get("host_ops") or [])[:20]


def engine_steps_within(client: httpx.Client, since_s: float) -> dict[str, Any] | None:
    """The engine's steps that ended since `since_s` (this process's monotonic clock; GET
    /admin/api/steps; the server is idle but for the request just timed, so they are its
    steps, `bench.host_profile.steps_since`): how many, their prefill tokens, device time and
    the device idle before each (the host's gap), totalled and one row a step. None where the
    server keeps no step trace."""
    from bench.host_profile import steps_since

    try:
        r = client.get("/admin/api/steps", params={"limit": 256}, timeout=30)
    except httpx.HTTPError:
        return None
    answered_s = time.monotonic()
    if r.status_code != 200:
        return None
    keep = ("num_prefill_tokens", "device_ms", "idle_before_ms", "gc_ms")
    rows = [
        {k: s.get(k) for k in keep} for s in steps_since(r.json()["steps"], since_s, answered_s)
    ]

    def total(key: str) -> float | None:
        vals = [row[key] for row in rows if row[key] is not None]
        return round(sum(vals), 3) if vals else None

    return {
        "num_steps": len(rows),
        "num_prefill_tokens": sum(row["num_prefill_tokens"] or 0 for row in rows),
        "device_ms": total("device_ms"),
        "idle_before_ms": total("idle_before_ms"),
        "gc_ms": total("gc_ms"),
        "steps": rows,
    }


def read_counters(client: httpx.Client) -> dict[str, float] | None:
    try:
        text = client.get("/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for name, _, value in prometheus_samples(text):
        for key, names in _COUNTERS.items():
            if name in names:
                values[key] = value
    return values if len(values) == len(_COUNTERS) else None


def server_processes(port: int) -> list[Any]:
    """The process listening on `port` and its descendants (API servers, engine core)."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            if conn.pid is None:
                continue
            root = psutil.Process(conn.pid)
            # The listener may be one of several API servers: climb to the launcher.
            parent = root.parent()
            if parent is not None and "app serve" in " ".join(parent.cmdline()):
                root = parent
            return [p for p in [root, *root.children(recursive=True)] if _running(p)]
    return []


def _running(proc: Any) -> bool:
    try:
        return proc.status() != "zombie"
    except Exception:  # noqa: BLE001 - gone already
        return False


def _role(proc: Any) -> str:
    """What a server process is: the engine core is the one process that loads torch (the
    API servers never do); other spawned children are API servers (--api-server-count)."""
    cmd = " ".join(proc.cmdline())
    if "resource_tracker" in cmd:
        return "resource-tracker"
    if "app serve" in cmd:
        return "app-serve"
    try:
        if any("libtorch" in m.path for m in proc.memory_maps(grouped=True)):
            return "engine-core"
    except Exception:  # noqa: BLE001 - no access: say so
        return "spawned"
    return "api-server"


class CpuMeter:
    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs

    def start(self) -> None:
        for p in self.procs:
            try:
                p.cpu_percent(None)
            except Exception:  # noqa: BLE001 - a process may have exited
                pass

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.procs:
            try:
                out[f"{p.pid}:{_role(p)}"] = p.cpu_percent(None)
            except Exception:  # noqa: BLE001
                pass
        return out


# A constrained stream's grammar (`--constrained-streams`): lowercase letters it cannot finish
# within --output-tokens tokens, so EOS stays masked and it runs its tokens as `ignore_eos`
# does for the others (a grammar with ignore_eos is a 400).
CONSTRAINED_REGEX = "[a-z]{4000}"


class StreamTimes(NamedTuple):
    """One stream's result: whether it ran under the grammar, its content chunk times
    (monotonic), and the first 64 characters of its text (what the grammar let through)."""

    constrained: bool
    times: list[float]
    head: str


async def one_stream(
    client: httpx.AsyncClient,
    model: str,
    item: tuple[list[int], bool],
    max_tokens: int,
    t_start: list[float],
) -> StreamTimes:
    """One streamed completion's content chunk times (monotonic); `item` is (prompt,
    constrained)."""
    prompt, constrained = item
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if constrained:
        body["structured_outputs"] = {"regex": CONSTRAINED_REGEX}
    else:
        body["ignore_eos"] = True
    times: list[float] = []
    head = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.monotonic())
                if len(head) < 64:
                    head += choices[0]["text"]
    t_start.append(time.monotonic())
    return StreamTimes(constrained, times, head[:64])


def make_prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ids from the middle of the vocabulary (ordinary tokens), distinct per stream."""
    rng = random.Random(seed + batch)
    return [[rng.randrange(1000, min(vocab, 40000)) for _ in range(context)] for _ in range(batch)]


async def run_streams(
    url: str, model: str, items: list[tuple[list[int], bool]], max_tokens: int
) -> list[StreamTimes]:
    n = len(items)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        done: list[float] = []
        return await asyncio.gather(
            *(one_stream(client, model, it, max_tokens, done) for it in items)
        )


def _warm(_: int) -> None:
    """A no-op job: each spawned client process imports this module before any batch."""


def _client_worker(
    job: tuple[str, str, list[tuple[list[int], bool]], int, float],
) -> tuple[list[StreamTimes], float, float]:
    """One client process: wait for the common start time, run its streams; returns
    ((constrained, chunk times) per stream, CPU seconds, wall seconds). time.monotonic is
    system-wide on Linux, so the processes' timestamps share one clock."""
    url, model, items, max_tokens, start_at = job
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu0, t0 = time.process_time(), time.monotonic()
    streams = asyncio.run(run_streams(url, model, items, max_tokens))
    return streams, time.process_time() - cpu0, time.monotonic() - t0


def run_batch(
    pool: Any,
    url: str,
    model: str,
    items: list[tuple[list[int], bool]],
    max_tokens: int,
    num_procs: int,
) -> tuple[list[StreamTimes], list[float]]:
    """The batch's streams, `items` of (prompt, constrained), over `num_procs` client
    processes (`pool`; in this process when 1): ((constrained, chunk times) per stream, in no
    particular order, and each client process's CPU percent)."""
    if num_procs <= 1:
        streams, cpu_s, wall_s = _client_worker((url, model, items, max_tokens, 0.0))
        return streams, [100.0 * cpu_s / wall_s if wall_s > 0 else 0.0]
    shares = [items[i::num_procs] for i in range(num_procs)]
    start_at = time.monotonic() + 1.0  # every process's streams start together
    jobs = [(url, model, share, max_tokens, start_at) for share in shares if share]
    streams: list[StreamTimes] = []
    cpu_pct: list[float] = []
    for share_streams, cpu_s, wall_s in pool.map(_client_worker, jobs):
        streams += share_streams
        cpu_pct.append(100.0 * cpu_s / wall_s if wall_s > 0 else 0.0)
    return streams, cpu_pct


def itl_window(streams: list[list[float]]) -> tuple[list[float], float, float, int]:
    """Gaps between consecutive chunks of each stream inside the window where every stream
    was decoding (after the last stream's first chunk, before the first stream's last one):
    (gaps, window start, window end, tokens in the window)."""
    start = max(s[0] for s in streams if s)
    end = min(s[-1] for s in streams if s)
    gaps, tokens = gaps_within(streams, start, end)
    return gaps, start, end, tokens


def gaps_within(streams: list[list[float]], start: float, end: float) -> tuple[list[float], int]:
    """(gaps between consecutive chunks, chunks) of these streams inside [start, end]."""
    gaps: list[float] = []
    tokens = 0
    for s in streams:
        inside = [t for t in s if start <= t <= end]
        tokens += len(inside)
        gaps += [b - a for a, b in zip(inside, inside[1:], strict=False)]
    return gaps, tokens


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def py_spy(procs: list[Any], seconds: float, out_dir: Path, tag: str) -> list[str]:
    """Start a py-spy `top`-style profile (raw samples) of each server process; returns files.
    py-spy is looked for on PATH, then beside this interpreter (a venv's bin/). Raises
    FileNotFoundError when it is in neither: a profile asked for must not come back empty."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if exe is None:
        raise FileNotFoundError("py-spy is not on PATH nor beside " + sys.executable)
    files = []
    for p in procs:
        path = out_dir / f"pyspy-{tag}-{p.pid}.txt"
        cmd = [
            exe,
            "record",
            "--pid",
            str(p.pid),
            "--duration",
            str(int(seconds)),
            "--format",
            "raw",
            "--rate",
            "200",
            "--output",
            str(path),
            "--nonblocking",
        ]
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        files.append(str(path))
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--shape", required=True, help="the random:<preset> the server runs (floor)")
    ap.add_argument("--batches", type=_int_list, default="1,16,64")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per stream")
    ap.add_argument("--output-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copy-gbs", type=float, default=None, help="skip measuring: use this")
    ap.add_argument("--label", default="", help="what server this is (revision, options)")
    ap.add_argument("--py-spy-s", type=float, default=0.0, help="profile the server this long")
    ap.add_argument(
        "--prefill-check",
        type=_int_list,
        default=[],
        help="also: cold scoring prompts of these lengths (comma-separated), "
        "--prefill-repeats of each in order",
    )
    ap.add_argument(
        "--prefill-profile-steps",
        type=int,
        default=0,
        help="profile each prefill reading's steps on the server (torch profiler, up to this "
        "many steps; the readings then say where the time goes, not how much)",
    )
    ap.add_argument(
        "--prefill-repeats",
        type=int,
        default=1,
        help="cold prompts for --prefill-check (prefix cache emptied before each); the record "
        "keeps every reading and, as prefill_check, the median one",
    )
    ap.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="client processes the streams are spread over (0: one per 16 streams)",
    )
    ap.add_argument(
        "--constrained-streams",
        type=int,
        default=0,
        help="this many streams of each batch under a grammar (structured_outputs regex "
        f"{CONSTRAINED_REGEX!r}, never finished within the tokens asked), the rest ignore_eos; "
        "each point then reports both groups' gaps",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.client_procs < 0:
        ap.error("--client-procs must be >= 0")
    if args.constrained_streams < 0:
        ap.error("--constrained-streams must be >= 0")

    ceilings = None if args.copy_gbs else measure_ceilings()
    copy_gbs = args.copy_gbs or (ceilings or {}).get("copy_gbs_read_plus_write")
    cfg = get_preset(args.shape)
    port = httpx.URL(args.url).port or 80
    batches = args.batches
    most_procs = max((args.client_procs or -(-b // 16) for b in batches), default=1)
    with contextlib.ExitStack() as stack:
        pool = None
        if most_procs > 1:
            # Spawned (not forked: this process may hold httpx state); warmed so that imports
            # are done before any batch's common start time.
            ctx = multiprocessing.get_context("spawn")
            pool = stack.enter_context(ProcessPoolExecutor(most_procs, mp_context=ctx))
            list(pool.map(_warm, range(most_procs)))
        return _measure(args, argv, ceilings, copy_gbs, cfg, port, batches, pool)


def _measure(
    args: argparse.Namespace,
    argv: list[str] | None,
    ceilings: dict[str, float] | None,
    copy_gbs: float | None,
    cfg: Any,
    port: int,
    batches: list[int],
    pool: Any,
) -> int:
    with httpx.Client(base_url=args.url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        procs = server_processes(port)
        result: dict[str, Any] = {
            **provenance("bench.decode", argv),
            "label": args.label,
            "url": args.url,
            "shape": args.shape,
            "model": model,
            "context_tokens": args.context,
            "output_tokens": args.output_tokens,
            "copy_gbs_read_plus_write": copy_gbs,
            "ceilings": ceilings,
            "server_processes": [p.pid for p in procs],
            "points": [],
        }
        out_dir = Path(args.out).parent
        for batch in batches:
            for rep in range(args.repeats):
                client.post("/admin/api/prefix-cache/reset", json={})
                cpu = CpuMeter(procs)
                time.sleep(0.5)  # engine counters reach /metrics with a heartbeat (0.2 s)
                before = read_counters(client)
                cpu.start()
                spy = []
                if args.py_spy_s and rep == 0:
                    spy = py_spy(
                        procs, args.py_spy_s, out_dir, f"{args.label or 'server'}-b{batch}"
                    )
                t0 = time.monotonic()
                prompts = make_prompts(batch, args.context, cfg.vocab_size, args.seed + rep)
                # The first --constrained-streams of the batch under a grammar, spread over
                # the client processes like the others.
                items = [(p, i < args.constrained_streams) for i, p in enumerate(prompts)]
                num_procs = args.client_procs or -(-batch // 16)
                flagged, client_cpu = run_batch(
                    pool, args.url, model, items, args.output_tokens, num_procs
                )
                streams = [st.times for st in flagged]
                wall = time.monotonic() - t0
                cpu_pct = cpu.read()
                time.sleep(0.5)
                after = read_counters(client)
                gaps, w0, w1, tokens = itl_window(streams)
                w_bytes, kv_bytes = decode_bytes(
                    args.shape, batch, args.context + args.output_tokens // 2
                )
                floor_ms = (w_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3 if copy_gbs else None
                point: dict[str, Any] = {
                    "batch": batch,
                    "repeat": rep,
                    "itl_median_ms": (pct(gaps, 0.5) or 0) * 1e3,
                    "itl_p90_ms": (pct(gaps, 0.9) or 0) * 1e3,
                    "itl_p99_ms": (pct(gaps, 0.99) or 0) * 1e3,
                    "num_gaps": len(gaps),
                    "decode_tokens_per_s": tokens / (w1 - w0) if w1 > w0 else None,
                    "wall_s": wall,
                    "weight_bytes": w_bytes,
                    "kv_bytes": kv_bytes,
                    "floor_ms": floor_ms,
                    "itl_over_floor": (pct(gaps, 0.5) or 0) * 1e3 / floor_ms if floor_ms else None,
                    "server_cpu_percent": cpu_pct,
                    "client_procs": num_procs,
                    "client_cpu_percent_max": round(max(client_cpu), 1),
                    "py_spy_files": spy,
                }
                if args.constrained_streams:
                    # The two groups' gaps inside the same window, where both decode: a
                    # constrained stream that sat out every other step shows a gap twice the
                    # others'.
                    for name, want in (("constrained", True), ("unconstrained", False)):
                        group = [st for st in flagged if st.constrained == want]
                        g, n = gaps_within([st.times for st in group], w0, w1)
                        point[f"itl_{name}_median_ms"] = (pct(g, 0.5) or 0) * 1e3
                        point[f"itl_{name}_p99_ms"] = (pct(g, 0.99) or 0) * 1e3
                        point[f"{name}_tokens_per_s_per_stream"] = (
                            n / (w1 - w0) / max(1, len(group)) if w1 > w0 else None
                        )
                    point["constrained_text_head"] = next(
                        (st.head for st in flagged if st.constrained), ""
                    )
                if before and after and after["num_decode_steps"] > before["num_decode_steps"]:
                    steps = after["num_decode_steps"] - before["num_decode_steps"]
                    dev = after["decode_device_s"] - before["decode_device_s"]
                    idle = after["decode_idle_s"] - before["decode_idle_s"]
                    point["engine_decode_step_ms"] = dev / steps * 1e3
                    point["engine_decode_steps"] = steps
                    point["gpu_idle_fraction_between_decode_steps"] = (
                        idle / (idle + dev) if idle + dev > 0 else None
                    )
                    point["itl_over_engine_step"] = (
                        point["itl_median_ms"] / point["engine_decode_step_ms"]
                    )
                result["points"].append(point)
                print(
                    f"B={batch} rep={rep}: ITL median {point['itl_median_ms']:.2f} ms"
                    f" (floor {floor_ms or float('nan'):.2f} ms, x{point['itl_over_floor'] or float('nan'):.2f}),"
                    f" {point['decode_tokens_per_s'] or 0:.0f} tok/s,"
                    f" engine step {point.get('engine_decode_step_ms', float('nan')):.2f} ms,"
                    f" GPU idle {point.get('gpu_idle_fraction_between_decode_steps', float('nan'))},"
                    f" CPU {sorted(cpu_pct.values(), reverse=True)[:3]},"
                    f" client CPU max {max(client_cpu):.0f} % over {num_procs} process(es)",
                    flush=True,
                )
        if args.prefill_check:
            peak = (ceilings or {}).get("matmul_bf16_tflops")
            checks = []
            for num_tokens in args.prefill_check:
                for _ in range(max(1, args.prefill_repeats)):
                    checks.append(
                        prefill_check(
                            args.url,
                            model,
                            args.shape,
                            num_tokens,
                            peak,
                            profile_steps=args.prefill_profile_steps,
                        )
                    )
                    ck, st = checks[-1], checks[-1]["engine_steps"] or {}
                    print(
                        f"prefill check: {ck['num_tokens']} tokens, {ck['e2e_s']:.4f} s end to"
                        f" end (server {ck['server_s']}), {ck['fraction_of_peak_e2e']} of the"
                        f" peak; engine: {st.get('num_steps')} steps, device"
                        f" {st.get('device_ms')} ms, idle before them {st.get('idle_before_ms')}"
                        " ms",
                        flush=True,
                    )
            result["prefill_checks"] = checks
            # The headline reading: the median of the first length's readings.
            first = [c for c in checks if c["num_tokens"] == args.prefill_check[0]]
            result["prefill_check"] = sorted(first, key=lambda c: c["e2e_s"])[len(first) // 2]
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
