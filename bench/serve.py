"""Load generator: `python -m bench.serve --url URL --workload NAME ... --out FILE.json`.

Open-loop: requests leave at planned arrival times (Poisson, or gamma inter-arrivals with
shape = burstiness; rate inf = all at once), whatever the server's state, so queueing shows up
as latency (as in `vllm bench serve`). Chat requests stream (SSE) and every content chunk's
arrival time is recorded; scoring requests go to `/v1/score` as token ids. Runs are bounded:
by a request count or a duration, a per-request timeout, and a bounded number of search probes.

`--server vllm` targets vLLM's OpenAI server instead (bench/peer/, issue 18): the same bodies,
scoring to its `/generative_scoring` (same fields as our `/v1/score`), the prefix-cache reset to
its `/reset_prefix_cache` (served with VLLM_SERVER_DEV_MODE=1) and the hit counters from its
Prometheus `/metrics`.

See bench/README.md for the output format and examples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.metrics import SLO, RequestResult, compute_metrics, meets_p99_slo
from bench.workloads import (
    WORKLOAD_NAMES,
    TokenizerLike,
    WorkloadGenerator,
    WorkloadRequest,
    describe,
    encode_ids,
    load_tokenizer,
)

REPO_DIR = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class ClientOptions:
    """How requests are sent (shared by bench.serve and bench.compare)."""

    model: str = ""
    ignore_eos: bool = True  # ask for exact output lengths (extension field; may be ignored)
    # Ask for usage in every chat chunk (`stream_options.continuous_usage_stats`, vLLM's and
    # Greenlane's): the tokens each chunk carries, for `token_itl_ms`.
    chunk_usage: bool = True
    temperature: float = 0.0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True
    tokenizer: TokenizerLike | None = None  # to count output tokens when usage is missing
    score_path: str = "/v1/score"  # vLLM: /generative_scoring (SERVER_APIS)
    score_as_completion: bool = False  # scoring sent as a one-token completion (SERVER_APIS)


@dataclass(frozen=True, slots=True)
class ServerApi:
    """Where a server kind takes scoring requests and prefix-cache resets (`--server`).
    `score_as_completion`: a scoring request goes as a completion of one token with logprobs
    (query + item ids as the prompt), the other way a vLLM user classifies."""

    score_path: str
    reset_path: str
    score_as_completion: bool = False


SERVER_APIS: dict[str, ServerApi] = {
    "greenlane": ServerApi("/v1/score", "/admin/api/prefix-cache/reset"),
    "vllm": ServerApi("/generative_scoring", "/reset_prefix_cache"),
    "vllm-completions": ServerApi("/v1/completions", "/reset_prefix_cache", True),
}


# ---------------------------------------------------------------- arrivals


def arrival_times_s(
    qps: float,
    seed: int,
    burstiness: float = 1.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Planned send times (s from the run start): gamma inter-arrivals with mean 1/qps.

    Shape `burstiness` = 1 is Poisson; < 1 is burstier, > 1 more regular. With qps = inf every
    request is due at 0 (needs `num_requests`). With `duration_s`, arrivals stop at the duration.
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(qps):
        if num_requests is None:
            raise ValueError("--request-rate inf needs --num-requests")
        return [0.0] * num_requests
    if qps <= 0:
        raise ValueError("qps must be > 0")
    rng = np.random.default_rng(seed)
    scale = 1.0 / (qps * burstiness)
    times: list[float] = []
    now = 0.0
    while True:
        if num_requests is not None and len(times) >= num_requests:
            break
        # The first request leaves at t = 0 so the run's duration starts with real work.
        if times:
            now += float(rng.gamma(burstiness, scale))
        if duration_s is not None and now > duration_s:
            break
        times.append(now)
    return times


# ---------------------------------------------------------------- one request


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body)
        msg = err.get("error", err)
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = body.decode("utf-8", "replace")
    return f"HTTP {status}: {str(msg)[:160]}"


def chat_body(req: WorkloadRequest, opts: ClientOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": [{"role": "user", "content": req.prompt_text}],
        "max_tokens": req.max_output_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.chunk_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.ignore_eos:
        body["ignore_eos"] = True  # Greenlane/vLLM extension: generate exactly max_tokens
    return body


def score_body(req: WorkloadRequest, opts: ClientOptions) -> dict[str, Any]:
    if opts.score_as_completion:
        # The same prompt as one token of greedy completion with the top logprobs: the forward
        # pass a label probability needs (the labels' own probabilities are not asked for).
        return {
            "model": opts.model,
            "prompt": list(req.query_token_ids) + list(req.item_token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 2,
        }
    body: dict[str, Any] = {
        "model": opts.model,
        "query": req.query_token_ids,
        "items": [req.item_token_ids],
        "apply_softmax": True,
        "item_first": False,
    }
    if req.label_token_ids:
        body["label_token_ids"] = req.label_token_ids
    else:
        body["labels"] = req.labels
    return body


async def _send_chat(
    client: httpx.AsyncClient,
    base_url: str,
    req: WorkloadRequest,
    opts: ClientOptions,
    result: RequestResult,
    start: float,
) -> None:
    body = chat_body(req, opts)
    text_parts: list[str] = []
    last_chunk = 0.0
    usage_tokens: int | None = None
    async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            result.error = _error_text(resp.status_code, await resp.aread())
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event names
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"stream error: {str(chunk['error'])[:160]}"
                return
            usage = chunk.get("usage")
            tokens_before = usage_tokens
            if usage:
                usage_tokens = usage.get("completion_tokens")
                result.num_prompt_tokens_server = usage.get("prompt_tokens")
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or choice.get("text")
                if not content:
                    continue  # a role-only or finish-only chunk is not a token
                if not text_parts:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last_chunk)
                    if usage and tokens_before is not None and usage_tokens is not None:
                        result.itl_tokens.append(usage_tokens - tokens_before)
                last_chunk = now
                text_parts.append(content)
    result.e2el_s = time.perf_counter() - start
    if not text_parts:
        result.error = "no content in stream"
        return
    if usage_tokens is not None:
        result.num_output_tokens = int(usage_tokens)
        result.output_tokens_from_usage = True
    elif opts.tokenizer is not None:  # fallback: re-tokenize the text, as vLLM's client does
        result.num_output_tokens = len(encode_ids(opts.tokenizer, "".join(text_parts)))
    else:  # last resort: one token per content chunk
        result.num_output_tokens = len(text_parts)
    result.success = True


async def _send_score(
    client: httpx.AsyncClient,
    base_url: str,
    req: WorkloadRequest,
    opts: ClientOptions,
    result: RequestResult,
    start: float,
) -> None:
    resp = await client.post(f"{base_url}{opts.score_path}", json=score_body(req, opts))
    result.e2el_s = result.ttft_s = time.perf_counter() - start
    if resp.status_code != 200:
        result.error = _error_text(resp.status_code, resp.content)
        return
    payload = resp.json()
    scores = payload.get("choices" if opts.score_as_completion else "scores", payload.get("data"))
    if not isinstance(scores, list) or len(scores) != 1:
        result.error = "score response without one result per item"
        return
    usage = payload.get("usage") or {}
    result.num_prompt_tokens_server = usage.get("prompt_tokens")
    result.num_cached_tokens_server = (usage.get("prompt_tokens_details") or {}).get(
        "cached_tokens"
    )
    timing = payload.get("timing")
    if isinstance(timing, dict):  # Greenlane's extension: where the server's time went
        result.server_s = timing.get("server_s")
        result.engine_queue_s = _only_item(timing.get("queue_s"))
        result.engine_ttft_s = _only_item(timing.get("ttft_s"))
    result.num_output_tokens = 1  # one forward pass yields the label probabilities
    result.success = True


def _only_item(values: Any) -> float | None:
    """The one item's value of a per-item timing list (None if not exactly one number)."""
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], int | float):
        return float(values[0])
    return None


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    req: WorkloadRequest,
    opts: ClientOptions,
    scheduled_s: float,
    run_start: float,
) -> RequestResult:
    """Send one request and time it; never raises (failures are recorded in the result)."""
    result = RequestResult(
        req.request_id,
        req.api,
        req.source,
        scheduled_s=scheduled_s,
        num_prompt_tokens=req.num_prompt_tokens,
        expected_output_tokens=req.max_output_tokens,
    )
    start = time.perf_counter()
    result.send_s = start - run_start
    sender = _send_score if req.api == "score" else _send_chat
    try:
        await asyncio.wait_for(
            sender(client, base_url, req, opts, result, start), opts.request_timeout_s
        )
    except TimeoutError:
        result.error = f"timeout after {opts.request_timeout_s:g}s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:120]}"
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON / SSE payload
        result.error = f"bad response: {type(exc).__name__}: {str(exc)[:120]}"
    if result.error:
        result.success = False
    return result


# ---------------------------------------------------------------- one run


class Progress:
    """A one-line progress bar on stderr (throttled; no dependency)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" failed {self.failed} {now - self.start:6.1f}s"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def make_client(opts: ClientOptions) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    # No connection cap: a pool limit would queue requests inside the client and hide queueing
    # time from TTFT. Timeouts per operation; the total per request is bounded by wait_for.
    return httpx.AsyncClient(
        headers=headers,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        timeout=httpx.Timeout(opts.request_timeout_s, connect=30.0),
    )


# Wall-clock instants are rounded to 0.1 ms and per-request latencies to 10 us: finer than the
# client's timing noise (its event loop), and short enough for a run's worth of token gaps.
UNIX_S_DECIMALS = 4
LATENCY_S_DECIMALS = 5


def request_records(results: list[RequestResult], started_unix_s: float) -> list[dict[str, Any]]:
    """Per-request timings (`--record-requests`), seconds: when each request was sent (wall
    clock, `started_unix_s` = the run's start), its TTFT, TPOT and inter-token gaps (the gaps
    that `compute_metrics` pools as ITL). Failed requests have only `start_unix_s`, `ok` and
    their id. A score answered with the server's own account adds its cached prompt tokens,
    `server_s`, `engine_queue_s` and `engine_ttft_s` (client TTFT - server_s: the front end and
    HTTP; engine_ttft_s - engine_queue_s: its prefill, the wait for a planned step included)."""

    def rounded(value_s: float | None) -> float | None:
        return None if value_s is None else round(value_s, LATENCY_S_DECIMALS)

    records: list[dict[str, Any]] = []
    for r in results:
        rec: dict[str, Any] = {
            "request_id": r.request_id,
            "start_unix_s": round(started_unix_s + r.send_s, UNIX_S_DECIMALS),
            "ok": r.success,
        }
        if r.success:
            rec["ttft_s"] = rounded(r.ttft_s)
            rec["tpot_s"] = rounded(r.tpot_s)
            rec["itl_s"] = [rounded(gap) for gap in r.itl_s]
            if len(r.itl_tokens) == len(r.itl_s):  # (the server counted tokens in every chunk)
                rec["itl_tokens"] = r.itl_tokens
            if r.num_cached_tokens_server is not None:
                rec["cached_tokens"] = r.num_cached_tokens_server
            for key in ("server_s", "engine_queue_s", "engine_ttft_s"):
                if getattr(r, key) is not None:
                    rec[key] = rounded(getattr(r, key))
        records.append(rec)
    return records


async def run_once(
    base_url: str,
    requests: list[WorkloadRequest],
    arrivals_s: list[float],
    opts: ClientOptions,
    slo: SLO | None = None,
    label: str = "",
    stop: asyncio.Event | None = None,
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send `requests` at `arrivals_s` and return (metrics, per-request results).

    The metrics hold the run's wall-clock window (`started_unix_s`, `ended_unix_s`: from the
    first send to the last request drained), so that runs of separate processes line up.
    `stop` (set e.g. by SIGTERM): send nothing more, cancel the requests still running, and
    return the metrics of those that completed (`stopped_early` and `num_cut_off` say so)."""
    assert len(requests) == len(arrivals_s)
    progress = Progress(len(requests), label or "bench", opts.progress)
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None

    async with make_client(opts) as client:

        async def one(req: WorkloadRequest, at_s: float, run_start: float) -> RequestResult:
            if sem is None:
                res = await send_request(client, base_url, req, opts, at_s, run_start)
            else:
                async with sem:
                    res = await send_request(client, base_url, req, opts, at_s, run_start)
            progress.update(res.success)
            return res

        run_start = time.perf_counter()
        started_unix_s = time.time()
        cpu_start_s = time.process_time()  # the client's own CPU (all its threads)
        tasks: list[asyncio.Task[RequestResult]] = []
        stop = stop or asyncio.Event()
        for req, at_s in zip(requests, arrivals_s, strict=True):
            delay_s = run_start + at_s - time.perf_counter()
            if delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay_s)
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(one(req, at_s, run_start)))
        stopper = asyncio.create_task(stop.wait())
        pending = set(tasks)
        while pending and not stop.is_set():
            _, pending = await asyncio.wait(
                pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(stopper)
        stopper.cancel()
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        results = [t.result() for t in tasks if not t.cancelled()]
        duration_s = time.perf_counter() - run_start
        ended_unix_s = time.time()
        cpu_s = time.process_time() - cpu_start_s
    metrics = compute_metrics(results, duration_s, slo, opts.max_concurrency)
    # A client near a whole core delays its own reads: its gaps and TTFT then include its lag
    # (and a closed loop sends late), whatever the server does. Printed as a warning past 80 %.
    metrics["client_cpu_percent"] = round(100.0 * cpu_s / max(duration_s, 1e-9), 1)
    metrics["started_unix_s"] = round(started_unix_s, UNIX_S_DECIMALS)
    metrics["ended_unix_s"] = round(ended_unix_s, UNIX_S_DECIMALS)
    if stop.is_set():
        metrics["stopped_early"] = True
        metrics["num_cut_off"] = len(requests) - len(results)
    return metrics, results


# ---------------------------------------------------------------- several client processes

# One Python client process sends long scoring requests at ~5 ms of its CPU each (httpx and
# asyncio per request, the JSON of a 14k-token body). Past ~80 % of a core it sends late and
# reads late, and a run then measures the client: post recommendation at the default pool on
# an H100 (2026-12-05) failed its 135-QPS probe with the client at 87 % of a core, its send
# lag P99 3.0 s, while the server's own request times stayed under 1 s (P99 0.8 s).
# `--client-procs N` deals a run's requests round-robin to N processes, which start sending
# at one wall-clock instant, each on its own core.
SPREAD_LEAD_S = 1.0  # a run's start this far ahead of the dispatch, plus the bodies' pickling
SPREAD_LEAD_S_PER_MTOKEN = 0.2  # per million distinct prompt tokens shipped to the processes
SPREAD_LATE_WARN_S = 0.05

_worker_tokenizer: dict[str, Any] = {}


def _worker_ready(_: int) -> int:
    time.sleep(0.2)  # so that each process takes one (the pool spawns every process)
    return os.getpid()


def _worker_run(
    base_url: str,
    requests: list[WorkloadRequest],
    arrivals_s: list[float],
    opts: ClientOptions,
    tokenizer_spec: str | None,
    start_at_unix_s: float,
) -> tuple[dict[str, Any], list[RequestResult]]:
    """One process's share of a run (`ClientPool.run`): wait for the common start, then send.
    Returns its metrics and results (times relative to its own start, `started_unix_s`)."""
    if tokenizer_spec is not None:  # loaded once a process, as the parent's was
        if tokenizer_spec not in _worker_tokenizer:
            spec = tokenizer_spec or None
            _worker_tokenizer[tokenizer_spec] = load_tokenizer(spec)
        opts.tokenizer = _worker_tokenizer[tokenizer_spec]
    delay_s = start_at_unix_s - time.time()
    if delay_s > 0:
        time.sleep(delay_s)
    return asyncio.run(run_once(base_url, requests, arrivals_s, opts))


class ClientPool:
    """`num_procs` client processes kept across a search's probes (spawned once: each imports
    this module, ~1-2 s). `run` has `run_once`'s contract, without `stop`: a run in flight on
    several processes ends when its requests do (or time out)."""

    def __init__(self, num_procs: int, tokenizer_spec: str | None) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if num_procs < 2:
            raise ValueError("ClientPool needs at least 2 processes (1: use run_once)")
        self.num_procs = num_procs
        # "" stands for the default tokenizer (load_tokenizer(None)); None: no tokenizer.
        self.tokenizer_spec = tokenizer_spec
        self._pool = ProcessPoolExecutor(num_procs, mp_context=multiprocessing.get_context("spawn"))
        self._started = False

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        pids = await asyncio.gather(
            *[loop.run_in_executor(self._pool, _worker_ready, i) for i in range(self.num_procs)]
        )
        self._started = True
        if len(set(pids)) != self.num_procs:  # a slow spawn: one process took two of them
            print(
                f"warning: {len(set(pids))} of {self.num_procs} client processes answered at "
                "start-up (the rest start with the first run)",
                file=sys.stderr,
            )

    async def run(
        self,
        base_url: str,
        requests: list[WorkloadRequest],
        arrivals_s: list[float],
        opts: ClientOptions,
        slo: SLO | None = None,
        label: str = "",
    ) -> tuple[dict[str, Any], list[RequestResult]]:
        assert len(requests) == len(arrivals_s)
        if opts.max_concurrency:
            raise ValueError("a closed loop (--max-concurrency) runs in one client process")
        if not self._started:
            await self._start()
        quiet = ClientOptions(
            **{f: getattr(opts, f) for f in opts.__slots__ if f not in ("tokenizer", "progress")},
            progress=False,
        )
        spec = self.tokenizer_spec if opts.tokenizer is not None else None
        n = self.num_procs
        # Distinct prompt tokens shipped (a user's shared query list is pickled once a process).
        distinct = {id(r.query_token_ids): len(r.query_token_ids) for r in requests}
        mtokens = (sum(distinct.values()) * n + sum(len(r.item_token_ids) for r in requests)) / 1e6
        start_at = time.time() + SPREAD_LEAD_S + SPREAD_LEAD_S_PER_MTOKEN * mtokens
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *[
                loop.run_in_executor(
                    self._pool,
                    _worker_run,
                    base_url,
                    requests[i::n],
                    arrivals_s[i::n],
                    quiet,
                    spec,
                    start_at,
                )
                for i in range(n)
            ]
        )
        # Onto the common clock: a process that started late sent its requests that much
        # later than planned, which its send lag must show.
        late = [max(m["started_unix_s"] - start_at, 0.0) for m, _ in parts]
        results = []
        for (_, rs), late_s in zip(parts, late, strict=True):
            for r in rs:
                r.send_s += late_s
            results += rs
        ended = max(m["ended_unix_s"] for m, _ in parts)
        metrics = compute_metrics(results, ended - start_at, slo, None)
        cpu = [m["client_cpu_percent"] for m, _ in parts]
        # The busiest process is the one whose lag would show in the timings.
        metrics["client_cpu_percent"] = max(cpu)
        metrics["client_procs"] = {
            "num": n,
            "cpu_percent": cpu,
            "late_start_s": [round(x, UNIX_S_DECIMALS) for x in late],
        }
        metrics["started_unix_s"] = round(start_at, UNIX_S_DECIMALS)
        metrics["ended_unix_s"] = round(ended, UNIX_S_DECIMALS)
        if max(late) > SPREAD_LATE_WARN_S:
            print(
                f"warning: {label or 'run'}: a client process started {max(late):.2f} s late "
                "(its requests left late; send_lag_ms counts it)",
                file=sys.stderr,
            )
        return metrics, results

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- max-QPS search


async def search_max_qps(
    run_at: Callable[[float], Awaitable[dict[str, Any]]],
    slo: SLO,
    start_qps: float,
    max_probes: int = 8,
    rel_tol: float = 0.05,
    factor: float = 2.0,
) -> dict[str, Any]:
    """Highest QPS whose run meets the P99 SLO: multiply by `factor` until a probe fails (or,
    when the first fails, divide until one passes), then bisect.

    At most `max_probes` runs. Stops early once the bracket [pass, fail] is within `rel_tol`.
    Assumes latency grows with load (probes are noisy; every probe is reported). A factor
    below 2 brackets a good first guess (`start_qps`) in fewer probes.
    """
    if factor <= 1.0:
        raise ValueError("the search factor must be > 1")
    best: float | None = None  # highest passing QPS seen
    fail: float | None = None  # lowest failing QPS seen
    qps = start_qps
    probes: list[dict[str, Any]] = []
    for _ in range(max_probes):
        metrics = await run_at(qps)
        ok = meets_p99_slo(metrics, slo)
        probes.append({"qps": qps, "meets_slo": ok, "metrics": metrics})
        if ok:
            best = qps if best is None else max(best, qps)
        else:
            fail = qps if fail is None else min(fail, qps)
        if fail is None:
            qps *= factor
        elif best is None:
            qps = fail / factor
        else:
            if (fail - best) / fail <= rel_tol:
                break
            qps = (best + fail) / 2.0
    return {"max_qps": best, "lowest_failing_qps": fail, "slo": slo.as_dict(), "probes": probes}


# ---------------------------------------------------------------- environment record


def git_revision() -> dict[str, Any]:
    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(REPO_DIR), *args], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        return {
            "revision": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        # Other work on the machine skews CPU results; the 1/5/15-minute load shows how much.
        info["load_avg_1_5_15_min"] = [round(x, 2) for x in os.getloadavg()]
    gpus = nvidia_smi_gpus("name,memory.total")
    if gpus is not None:
        info["gpus"] = gpus
    return info


def nvidia_smi_gpus(fields: str) -> list[str] | None:
    """One CSV line of `fields` per GPU as nvidia-smi reports them (`--query-gpu`); None without
    nvidia-smi. Asked of nvidia-smi, not torch: a client beside a server must not open a CUDA
    context (it would take GPU memory from the server it measures)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return []
    return [g.strip() for g in out.stdout.splitlines() if g.strip()]


async def server_info(base_url: str, opts: ClientOptions, admin_token: str | None) -> dict:
    """Models and `/admin/api/state` (the server's configuration); missing pieces noted."""
    info: dict[str, Any] = {"url": base_url}
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    async with make_client(opts) as client:
        try:
            resp = await client.get(f"{base_url}/v1/models", timeout=10.0)
            info["models"] = [m.get("id") for m in resp.json().get("data", [])]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            info["models_error"] = f"{type(exc).__name__}: {exc}"
        try:
            resp = await client.get(f"{base_url}/admin/api/state", headers=headers, timeout=10.0)
            if resp.status_code == 200:
                info["state"] = resp.json()
            else:
                info["state_error"] = f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            info["state_error"] = f"{type(exc).__name__}: {exc}"
    return info


# ---------------------------------------------------------------- admin calls


def admin_headers(admin_token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_token}"} if admin_token else {}


async def save_steps(
    base_url: str, admin_token: str | None, path: Path, started_unix_s: float, ended_unix_s: float
) -> dict[str, Any]:
    """Right after a run: the engine's step trace (`/admin/api/steps`, the last 4,096 steps it
    keeps) written to `path`, so a run's steps can be read per probe (a search's probes differ
    in rate; the harness's own save at the end of a side holds only its last seconds). Says
    whether the trace reaches back to the run's start: on a busy server 4,096 steps can be
    fewer seconds than the run took. Never raises."""
    ok, reply = await admin_call(base_url, "GET", "/admin/api/steps?limit=4096", admin_token)
    # Steps' ages count back from the reply, which comes after the run ended: the trace must
    # reach back to the run's start from now, not only the run's own length.
    needed_s = time.time() - started_unix_s
    if not ok or not isinstance(reply, dict):
        return {"saved": False, "why": str(reply)[:200]}
    steps = reply.get("steps") or []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"steps": steps}))
    except OSError as exc:
        return {"saved": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
    span_s = max((st["age_s"] for st in steps), default=0.0)
    return {
        "saved": True,
        "file": path.name,
        "num_steps": len(steps),
        "span_s": round(span_s, 3),
        "run_s": round(ended_unix_s - started_unix_s, 3),
        "covers_run": span_s >= needed_s,
    }


async def admin_call(
    base_url: str,
    method: str,
    path: str,
    admin_token: str | None,
    body: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> tuple[bool, dict[str, Any] | str]:
    """One admin API request: (True, JSON reply) on 200, else (False, a short error text).

    Never raises: callers decide whether a failed change invalidates their measurement."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            # Always a JSON body ({} when none): the admin refuses changes without one (CSRF).
            resp = await client.request(
                method,
                f"{base_url}{path}",
                json=body if body is not None else {},
                headers=admin_headers(admin_token),
            )
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {str(exc)[:160]}"
    if resp.status_code != 200:
        return False, _error_text(resp.status_code, resp.content)
    try:
        return True, resp.json()
    except ValueError:
        return True, {}


async def reset_prefix_cache(
    base_url: str, admin_token: str | None, path: str = SERVER_APIS["greenlane"].reset_path
) -> dict[str, Any]:
    """Ask the server to drop its idle prefix-cache blocks (`POST /admin/api/prefix-cache/reset`).

    Call it only BETWEEN runs: within a run, prefixes shared by one user's requests are what the
    scoring workloads measure. The server applies the reset before its next step, so requests
    sent after this returns find a cold cache (blocks still held by requests that the client
    gave up on, e.g. after a timeout, survive until those requests end).
    Returns {"done": bool, "error": str (when not done), "blocks_before": int | None}."""
    ok, reply = await admin_call(base_url, "POST", path, admin_token)
    if not ok:
        return {"done": False, "error": reply}
    assert isinstance(reply, dict)
    return {"done": True, "blocks_before": reply.get("prefix_cached_blocks_before")}


async def server_counters(
    base_url: str, admin_token: str | None, server: str = "greenlane"
) -> dict[str, int] | None:
    """The server's cumulative counters read around each run: prefix-cache hit and query
    tokens (`/admin/api/state`; vLLM: `/metrics`), and Greenlane's failed steps and failed
    requests (`num_failed_steps`, `num_failed_requests`) where it reports them. None if
    unreadable."""
    if server.startswith("vllm"):
        return await vllm_counters(base_url)
    ok, reply = await admin_call(base_url, "GET", "/admin/api/state", admin_token)
    if not ok or not isinstance(reply, dict):
        return None
    pc = reply.get("prefix_cache") or {}
    if pc.get("hit_tokens") is None or pc.get("query_tokens") is None:
        return None
    out = {"hit_tokens": int(pc["hit_tokens"]), "query_tokens": int(pc["query_tokens"])}
    engine = reply.get("engine") or {}
    for key in ("num_failed_steps", "num_failed_requests"):
        if isinstance(engine.get(key), int):
            out[key] = engine[key]
    return out


def prometheus_samples(metrics_text: str) -> Iterator[tuple[str, str, float]]:
    """(name, labels, value) of each sample line of Prometheus text (labels: the text between
    the braces, empty without)."""
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        yield name, labels.rstrip("}"), float(value)


def parse_vllm_prefix_counters(metrics_text: str) -> dict[str, int] | None:
    """vLLM's `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens,
    summed over engines) from Prometheus text; None when absent."""
    names = {
        "vllm:prefix_cache_hits_total": "hit_tokens",
        "vllm:prefix_cache_queries_total": "query_tokens",
    }
    sums = {"hit_tokens": 0.0, "query_tokens": 0.0}
    seen = set()
    for name, _, value in prometheus_samples(metrics_text):
        if name in names:
            sums[names[name]] += value
            seen.add(name)
    return {k: int(v) for k, v in sums.items()} if len(seen) == 2 else None


async def metrics_text(base_url: str, admin_token: str | None = None) -> str | None:
    """The server's Prometheus text (`/metrics`), None when unreadable."""
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            resp = await client.get(f"{base_url}/metrics", headers=admin_headers(admin_token))
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def vllm_counters(base_url: str) -> dict[str, int] | None:
    """Prefix-cache counters from `/metrics` (None without them). vLLM's
    `vllm:iteration_tokens_total` is not read: it counts a request's whole prompt in the
    iteration its prefill ends, not the chunk a step ran, so it cannot count chunked steps."""
    text = await metrics_text(base_url)
    return None if text is None else parse_vllm_prefix_counters(text)


# The server's own inter-token histogram (Greenlane and vLLM export it under vLLM's name): the
# gaps between a request's outputs as the API server received them from the engine, one per
# engine step. Read around each run, it says which of the client's long gaps the server already
# had (the engine and the hop to the API server) and which arose after (SSE, the network, a
# token without text that sent no chunk).
SERVER_ITL_METRIC = "vllm:inter_token_latency_seconds_bucket"
SERVER_ITL_OVER_S = (0.04, 0.06, 0.08, 0.1, 0.15, 0.2)  # bucket bounds of both servers


def parse_itl_buckets(metrics_text: str) -> dict[float, float] | None:
    """Cumulative counts by upper bound (`le`, seconds; inf for `+Inf`) of the server's
    inter-token histogram, summed over label sets; None when absent."""
    out: dict[float, float] = {}
    for name, labels, value in prometheus_samples(metrics_text):
        if name != SERVER_ITL_METRIC:
            continue
        for label in labels.split(","):
            key, _, raw = label.partition("=")
            if key.strip() == "le":
                le = float(raw.strip().strip('"').replace("+Inf", "inf"))
                out[le] = out.get(le, 0.0) + value
    return out or None


async def server_itl_buckets(base_url: str, admin_token: str | None) -> dict[float, float] | None:
    """`parse_itl_buckets` of the server's `/metrics` (None when unreadable)."""
    text = await metrics_text(base_url, admin_token)
    return None if text is None else parse_itl_buckets(text)


def server_itl_delta(
    before: dict[float, float] | None, after: dict[float, float] | None
) -> dict[str, Any] | None:
    """The server's inter-token gaps during a run: how many, and the fraction over each of
    SERVER_ITL_OVER_S (every stream the server ran then, background ones included)."""
    if before is None or after is None or math.inf not in after:
        return None
    count = after[math.inf] - before.get(math.inf, 0.0)
    if count <= 0:
        return {"count": 0, "fraction_over_s": {}}
    over = {
        f"{le:g}": round(1.0 - (after[le] - before.get(le, 0.0)) / count, 6)
        for le in SERVER_ITL_OVER_S
        if le in after
    }
    return {"count": int(count), "fraction_over_s": over}


def prefix_cache_delta(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, Any] | None:
    """Prompt tokens the server looked up and found cached between two counter readings (the
    engine counts each request once, when it is admitted)."""
    if before is None or after is None:
        return None
    hit = after["hit_tokens"] - before["hit_tokens"]
    query = after["query_tokens"] - before["query_tokens"]
    return {
        "hit_tokens": hit,
        "query_tokens": query,
        "hit_rate": hit / query if query > 0 else None,
    }


def engine_failures_delta(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    """Greenlane's failed steps and failed requests between two counter readings; None where
    the server does not report them. A failed step re-runs its requests one at a time: the
    run's latencies then include that recovery, though no request may have failed."""
    keys = ("num_failed_steps", "num_failed_requests")
    if before is None or after is None or not all(k in before and k in after for k in keys):
        return None
    return {k: after[k] - before[k] for k in keys}


async def prime_prefixes(
    base_url: str, gen: WorkloadGenerator, opts: ClientOptions
) -> dict[str, Any]:
    """Send one request per shared-prefix group (user order), one at a time, unrecorded: the
    prefix cache then holds what it keeps of every user's profile, least recent first, as in
    a running service (a fresh cache would make every run start with all users cold)."""
    reqs = gen.group_requests()
    quiet = ClientOptions(**{**{f: getattr(opts, f) for f in opts.__slots__}, "progress": False})
    t0 = time.perf_counter()
    failed = 0
    for req in reqs:
        _, results = await run_once(base_url, [req], [0.0], quiet)
        failed += sum(1 for r in results if not r.success)
    return {"requests": len(reqs), "failed": failed, "wall_s": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------- CLI


def parse_qps(text: str) -> list[float]:
    return [math.inf if v.strip().lower() == "inf" else float(v) for v in text.split(",")]


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Workload and client arguments shared with bench.compare."""
    p.add_argument("--workload", required=True, choices=WORKLOAD_NAMES)
    p.add_argument("--scale", type=float, default=1.0, help="multiply all token lengths (0, 1]")
    count = p.add_mutually_exclusive_group(required=True)
    count.add_argument("--num-requests", type=int)
    count.add_argument("--duration", type=float, help="seconds of arrivals (finite QPS only)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--tokenizer", help="tokenizer.json or model folder (default: default model)")
    p.add_argument("--model", help="model name in request bodies (default: first of /v1/models)")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes a run's requests are dealt to (open loop only): one Python "
        "process sends late past ~80 %% of a core (client_cpu_percent says)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument(
        "--no-chunk-usage",
        action="store_true",
        help="do not ask for usage in every chat chunk (stream_options.continuous_usage_stats: "
        "a server that does not know it answers 400)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo", help="ttft:MS,tpot:MS,e2el:MS (any subset)")
    p.add_argument("--api-key", default=os.environ.get("GREENLANE_API_KEY"))
    p.add_argument(
        "--admin-token",
        default=os.environ.get("GREENLANE_ADMIN_TOKEN"),
        help="Bearer token for /admin/api/* (default: $GREENLANE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--reset-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="empty the server's prefix cache before each run (default: on; "
        "--no-reset-prefix-cache keeps warm caches across runs)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="send N unrecorded requests first, one at a time (from another seed)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--server",
        choices=sorted(SERVER_APIS),
        default="greenlane",
        help="the server's kind: vllm sends scoring to /generative_scoring, resets its prefix "
        "cache at /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1) and reads hits from /metrics; "
        "vllm-completions the same, but scoring as one-token completions with logprobs",
    )
    add_common_args(p)
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--qps", help="one rate or a comma list (a sweep); 'inf' allowed")
    rate.add_argument("--request-rate", help="alias of --qps")
    p.add_argument(
        "--find-max-qps",
        action="store_true",
        help="search the highest QPS meeting the P99 --slo (start: first --qps)",
    )
    p.add_argument("--max-probes", type=int, default=8)
    p.add_argument(
        "--prime-prefixes",
        action="store_true",
        help="before each run (after its reset; once with --no-reset-prefix-cache) send one "
        "request per user of a grouped scoring workload, one at a time, unrecorded",
    )
    p.add_argument(
        "--search-factor",
        type=float,
        default=2.0,
        help="--find-max-qps: multiply (or divide) the QPS by this until the SLO brackets",
    )
    p.add_argument(
        "--record-requests",
        action="store_true",
        help="also write every request's send time (wall clock), TTFT, TPOT and inter-token "
        "gaps (runs[].requests, seconds): to line a background load up with another run",
    )
    p.add_argument(
        "--save-steps",
        metavar="PREFIX",
        help="after each run, write the server's step trace (/admin/api/steps: its last 4,096 "
        "steps) to PREFIX-qps<QPS>.steps.json (Greenlane only; runs[].steps says how much of "
        "the run it spans)",
    )
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--plot", help="PNG of latency percentiles vs QPS")
    return p


def options_from_args(args: argparse.Namespace, tokenizer: TokenizerLike) -> ClientOptions:
    return ClientOptions(
        model=args.model or "",
        ignore_eos=not args.no_ignore_eos,
        chunk_usage=not args.no_chunk_usage,
        temperature=args.temperature,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        progress=not args.no_progress,
        tokenizer=tokenizer,
    )


@dataclass(slots=True)
class Plan:
    """A workload made for one QPS: requests and their arrival times."""

    requests: list[WorkloadRequest]
    arrivals_s: list[float]
    meta: dict[str, Any] = field(default_factory=dict)


def make_plan(gen: WorkloadGenerator, args: argparse.Namespace, qps: float) -> Plan:
    """Arrivals for `qps` (seeded apart from the workload), then that many requests.

    Requests are the generator's first N, so two QPS values share their common prefix of
    requests; only the arrival times differ.
    """
    arrivals = arrival_times_s(qps, args.seed, args.burstiness, args.num_requests, args.duration)
    requests = gen.take(len(arrivals))
    return Plan(requests, arrivals)


def workload_record(gen: WorkloadGenerator, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": gen.name,
        "description": describe(gen.name),
        "scale": gen.scale,
        "seed": gen.seed,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "burstiness": args.burstiness,
    }


def run_record(
    qps: float,
    metrics: dict[str, Any],
    plan: Plan,
    prefix_cache_reset: dict[str, Any] | None = None,
    prefix_cache: dict[str, Any] | None = None,
    prime: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run's JSON; `prefix_cache_reset` is what `reset_prefix_cache` returned before it
    (None: no reset was asked for), `prefix_cache` the server's hit counters over the run
    (`prefix_cache_delta`), `prime` what `prime_prefixes` did before it."""
    prompt = [r.num_prompt_tokens for r in plan.requests]
    out = [r.max_output_tokens for r in plan.requests if r.api == "chat"]
    return {
        "qps": "inf" if math.isinf(qps) else qps,
        "num_requests": len(plan.requests),
        "mean_prompt_tokens": float(np.mean(prompt)) if prompt else 0.0,
        "mean_requested_output_tokens": float(np.mean(out)) if out else None,
        "prefix_cache_reset": prefix_cache_reset,
        "prefix_cache": prefix_cache,
        "prime": prime,
        "metrics": metrics,
    }


async def warm_up(
    base_url: str, args: argparse.Namespace, tok: TokenizerLike, opts: ClientOptions
) -> None:
    """Unrecorded requests, one at a time, drawn with another seed (so the measured requests'
    prefixes are not pre-cached): first-request costs stay out of the first run."""
    if args.warmup_requests <= 0:
        return
    gen = WorkloadGenerator(args.workload, tok, args.seed + 1_000_003, args.scale)
    quiet = ClientOptions(**{**{f: getattr(opts, f) for f in opts.__slots__}, "progress": False})
    for req in gen.take(args.warmup_requests):
        await run_once(base_url, [req], [0.0], quiet)


async def reset_before_run(base_url: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The reset before one run (None when --no-reset-prefix-cache); a failure is recorded and
    warned about, and the run goes on (its result then may include cache carry-over)."""
    if not args.reset_prefix_cache:
        return None
    server = getattr(args, "server", "greenlane")
    reset = await reset_prefix_cache(base_url, args.admin_token, SERVER_APIS[server].reset_path)
    if not reset["done"]:
        print(
            f"\nwarning: prefix-cache reset failed ({reset['error']}); this run may reuse "
            "prefixes cached by earlier runs",
            file=sys.stderr,
        )
    return reset


async def resolve_model(base_url: str, opts: ClientOptions, server: dict[str, Any]) -> None:
    if not opts.model:
        models = server.get("models") or []
        opts.model = models[0] if models else "default"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.url.rstrip("/")
    qps_list = parse_qps(args.qps or args.request_rate)
    slo = SLO.parse(args.slo)
    if args.find_max_qps and slo is None:
        raise SystemExit("--find-max-qps needs --slo")
    if args.client_procs < 1:
        raise SystemExit(f"--client-procs must be at least 1, got {args.client_procs}")
    if args.client_procs > 1 and args.max_concurrency:
        raise SystemExit("--client-procs deals an open loop; --max-concurrency runs in one process")
    if args.save_steps and args.server != "greenlane":
        raise SystemExit(f"--save-steps reads Greenlane's /admin/api/steps, not {args.server}'s")
    tok = load_tokenizer(args.tokenizer)
    gen = WorkloadGenerator(args.workload, tok, args.seed, args.scale)
    opts = options_from_args(args, tok)
    opts.score_path = SERVER_APIS[args.server].score_path
    opts.score_as_completion = SERVER_APIS[args.server].score_as_completion
    record: dict[str, Any] = {
        "tool": "greenlane bench.serve",
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.serve", *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "machine": machine_info(),
        "server": await server_info(base_url, opts, args.admin_token),
        "workload": workload_record(gen, args),
    }
    await resolve_model(base_url, opts, record["server"])
    record["options"] = {
        "model": opts.model,
        "server": args.server,
        "score_path": opts.score_path,
        "score_as_completion": opts.score_as_completion,
        "ignore_eos": opts.ignore_eos,
        "chunk_usage": opts.chunk_usage,
        "temperature": opts.temperature,
        "max_concurrency": opts.max_concurrency,
        "client_procs": args.client_procs,
        "request_timeout_s": opts.request_timeout_s,
        "warmup_requests": args.warmup_requests,
        "reset_prefix_cache": args.reset_prefix_cache,
        "prime_prefixes": args.prime_prefixes,
        "search_factor": args.search_factor,
        "record_requests": args.record_requests,
        "slo": slo.as_dict() if slo else None,
    }
    await warm_up(base_url, args, tok, opts)
    runs: list[dict[str, Any]] = []
    # SIGTERM (e.g. a background load being ended by its harness) stops the run and still
    # writes what completed: a background run's latencies are then not lost.
    stop = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not on every platform
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    primed: list[dict[str, Any]] = []

    async def run_at(qps: float) -> dict[str, Any]:
        plan = make_plan(gen, args, qps)
        reset = await reset_before_run(base_url, args)
        prime = None
        if args.prime_prefixes and (reset is not None or not primed):
            prime = await prime_prefixes(base_url, gen, opts)
            primed.append(prime)
        before = await server_counters(base_url, args.admin_token, args.server)
        itl_before = await server_itl_buckets(base_url, args.admin_token)
        if pool is not None:
            metrics, results = await pool.run(
                base_url, plan.requests, plan.arrivals_s, opts, slo, label=f"qps {qps:g}"
            )
        else:
            metrics, results = await run_once(
                base_url, plan.requests, plan.arrivals_s, opts, slo, f"qps {qps:g}", stop
            )
        after = await server_counters(base_url, args.admin_token, args.server)
        itl_after = await server_itl_buckets(base_url, args.admin_token)
        run = run_record(qps, metrics, plan, reset, prefix_cache_delta(before, after), prime)
        run["server_itl"] = server_itl_delta(itl_before, itl_after)
        run["engine_failures"] = failures = engine_failures_delta(before, after)
        if failures and any(failures.values()):
            print(
                f"WARNING: the server's engine failed {failures['num_failed_steps']} step(s) and "
                f"{failures['num_failed_requests']} request(s) during this run (its log says why)",
                file=sys.stderr,
            )
        if args.record_requests:
            run["requests"] = request_records(results, metrics["started_unix_s"])
        if args.save_steps:
            run["steps"] = await save_steps(
                base_url,
                args.admin_token,
                Path(f"{args.save_steps}-qps{qps:g}.steps.json"),
                metrics["started_unix_s"],
                metrics["ended_unix_s"],
            )
        runs.append(run)
        return metrics

    # "" stands for the default tokenizer in the client processes (load_tokenizer(None)).
    pool = ClientPool(args.client_procs, args.tokenizer or "") if args.client_procs > 1 else None
    try:
        if args.find_max_qps:
            assert slo is not None
            search = await search_max_qps(
                run_at, slo, qps_list[0], args.max_probes, factor=args.search_factor
            )
            record["max_qps_search"] = {k: v for k, v in search.items() if k != "probes"}
        else:
            for qps in qps_list:
                if stop.is_set():
                    break
                await run_at(qps)
    finally:
        if pool is not None:
            pool.close()
    record["stopped_by_signal"] = stop.is_set()
    runs.sort(key=lambda r: math.inf if r["qps"] == "inf" else r["qps"])
    record["runs"] = runs
    record["prefix_cache_reset"] = {
        "requested": args.reset_prefix_cache,
        "done_before_every_run": bool(runs)
        and all((r["prefix_cache_reset"] or {}).get("done", False) for r in runs),
    }
    if len(runs) == 1:
        record["metrics"] = runs[0]["metrics"]
    return record


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


CLIENT_CPU_WARN_PERCENT = 80.0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    from bench.plots import markdown_table

    print(markdown_table({args.workload: record["runs"]}))
    for run in record["runs"]:
        cpu = run["metrics"].get("client_cpu_percent")
        if cpu is not None and cpu > CLIENT_CPU_WARN_PERCENT:
            print(
                f"warning: this client used {cpu:.0f} % of a core at QPS {run.get('qps')}: "
                "its own lag is in these timings (spread the load over processes)"
            )
        steady = run["metrics"].get("steady_state")
        if steady:
            t0, t1 = steady["window_s"]
            print(
                f"while the closed loop was full ({t0:.1f}-{t1:.1f} s, "
                f"{steady['fraction_of_run']:.0%} of the run): "
                f"{steady['output_throughput']:.1f} output tok/s"
            )
        for src, part in (run["metrics"].get("by_source") or {}).items():
            ttft, itl = part["ttft_ms"], part["itl_ms"]
            print(
                f"{src}: {part['completed']} ok, {part['failed']} failed; TTFT P50/P99 "
                f"{_ms(ttft['median'])}/{_ms(ttft['p99'])} ms, gap between tokens P50/P99 "
                f"{_ms(itl['median'])}/{_ms(itl['p99'])} ms, "
                f"{part['itl_tail']['over_ms'].get('50', 0.0):.2%} of gaps over 50 ms "
                f"({part['stalls']['over_ms'].get('50', 0)} stalls: steps that held streams)"
            )
    if "max_qps_search" in record:
        s = record["max_qps_search"]
        print(f"\nmax QPS meeting P99 SLO {s['slo']}: {s['max_qps']}")
    if args.plot:
        from bench.plots import plot_latency_vs_qps

        plot_latency_vs_qps(
            {args.workload: record["runs"]}, args.plot, title=f"{args.workload} ({args.url})"
        )
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
