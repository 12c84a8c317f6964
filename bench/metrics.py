"""Per-request timings -> benchmark metrics, with `vllm bench serve`'s definitions.

- TTFT: from sending the request to the first streamed chunk that carries content (a role-only
  first chunk does not count). For scoring (no stream), TTFT = E2EL = time to the full response.
- E2EL: from sending to the last byte of the response.
- TPOT (per request): (E2EL - TTFT) / (output_tokens - 1), only for requests with > 1 output token.
- ITL: every gap between consecutive content chunks, pooled over all requests.
- Percentiles are numpy's linear-interpolation percentiles over successful requests, in ms.
- Throughputs divide by the benchmark duration (first send to last completion).
- Goodput: requests per second that succeeded and met every given SLO (TTFT, TPOT, TBT,
  E2EL; a request without a TPOT or any token gap, i.e. one output token, meets those).
- TBT SLO: for the P99 check, the P99 of the pooled inter-token gaps (ITL); per request (goodput),
  the 99th percentile of that request's own gaps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What the client saw for one request. Times are seconds on the client's monotonic clock."""

    request_id: str
    api: str
    source: str = ""
    success: bool = False
    error: str = ""  # failure reason (HTTP status + message, exception name, timeout)
    scheduled_s: float = 0.0  # planned send time (arrival process), relative to the run start
    send_s: float = 0.0  # actual send time, relative to the run start
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    # Tokens each of those gaps' chunks carried (the usage in every chunk a server sends under
    # `stream_options.continuous_usage_stats`); empty when the server does not say. A token
    # without text (a partial UTF-8 sequence) sends no chunk: the gap after it spans two.
    itl_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0  # from the workload
    num_prompt_tokens_server: int | None = None  # usage.prompt_tokens, when the server says
    # A score's own account, when the server gives one (Greenlane's /v1/score): prompt tokens
    # found in its prefix cache, seconds from handing the request to the engine to its answer,
    # and the engine's queue (arrival -> first scheduled) and time to the probabilities.
    num_cached_tokens_server: int | None = None
    server_s: float | None = None
    engine_queue_s: float | None = None
    engine_ttft_s: float | None = None
    num_output_tokens: int = 0
    expected_output_tokens: int = 0
    output_tokens_from_usage: bool = False  # False: counted from chunks (a fallback)

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.num_output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency objectives in ms; None = no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    tbt_ms: float | None = None  # inter-token gap (the metrics' itl_ms)

    @classmethod
    def parse(cls, text: str | None) -> SLO | None:
        """Parse 'ttft:500,tpot:50,tbt:100,e2el:2000' (any subset)."""
        if not text:
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "tbt", "e2el"):
                raise ValueError(
                    f"bad SLO item {part!r}; expected ttft:MS, tpot:MS, tbt:MS or e2el:MS"
                )
            values[f"{key}_ms"] = float(value)
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        out = {
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "tbt_ms": self.tbt_ms,
            "e2el_ms": self.e2el_ms,
        }
        return {k: v for k, v in out.items() if v is not None}

    def met_by(self, r: RequestResult) -> bool:
        if not r.success:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        if self.tbt_ms is not None and r.itl_s:
            if float(np.percentile(np.asarray(r.itl_s), 99)) * 1e3 > self.tbt_ms:
                return False
        return not (self.e2el_ms is not None and r.e2el_s * 1e3 > self.e2el_ms)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 and std in ms; all None when there are no values."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(arr, PERCENTILES)
    return {
        "mean": float(arr.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "std": float(arr.std()),
    }


# Gaps between tokens longer than these (ms) are counted in `itl_tail`.
GAP_TAIL_MS: tuple[int, ...] = (25, 50, 100, 200)


def gap_tail(gaps_s: list[float]) -> dict[str, Any]:
    """How many gaps between tokens were long, as fractions of all gaps, the longest gap and
    the time spent beyond the median gap (ms, summed over streams). P99 alone sits on a knee
    when about 1 % of the gaps are steps that carry a long prefill: two servers with the same
    stalls either side of that 1 % read 30 vs 67 ms (issue 18's long-prompt runs), while these
    counts and the summed excess move smoothly."""
    if not gaps_s:
        return {"num_gaps": 0, "over_ms": {}, "max_ms": None, "excess_over_median_s": None}
    arr = np.asarray(gaps_s, dtype=np.float64)
    median = float(np.median(arr))
    return {
        "num_gaps": int(arr.size),
        "over_ms": {str(t): float(np.mean(arr > t / 1e3)) for t in GAP_TAIL_MS},
        "max_ms": float(arr.max() * 1e3),
        "excess_over_median_s": float(np.sum(np.clip(arr - median, 0.0, None))),
    }


def stalls(ok: list[RequestResult]) -> dict[str, Any]:
    """Steps that held the streams, counted once however many streams they held: every gap
    longer than a bound ends when its step ends, at about the same instant on every stream
    the step held, so the ends within half the bound of a group's first are one stall (two
    steps that each took longer than the bound end at least that far apart). `over_ms`: the
    stalls over each bound; `held_s`: their summed length (each stall's longest gap), over
    each bound. Unlike the gap fractions of `gap_tail` this does not scale with how many
    streams were running, so two servers' counts compare as numbers of long steps, seen
    from the client (a server's own step counters need not agree on what a step is)."""
    ends: list[tuple[float, float]] = []  # (the instant a long gap ended, its length), seconds
    floor_s = min(GAP_TAIL_MS) / 1e3
    for r in ok:
        if not r.itl_s:
            continue
        times = np.cumsum([r.send_s + r.ttft_s, *r.itl_s])
        gaps = np.asarray(r.itl_s)
        long_gaps = np.nonzero(gaps > floor_s)[0]
        ends.extend((float(times[i + 1]), float(gaps[i])) for i in long_gaps)
    ends.sort()
    over: dict[str, int] = {}
    held: dict[str, float] = {}
    for bound_ms in GAP_TAIL_MS:
        bound_s = bound_ms / 1e3
        count, total, group_start, group_max = 0, 0.0, None, 0.0
        for end_s, gap_s in ends:
            if gap_s <= bound_s:
                continue
            if group_start is None or end_s - group_start > bound_s / 2:
                total += group_max
                count, group_start, group_max = count + 1, end_s, gap_s
            else:
                group_max = max(group_max, gap_s)
        over[str(bound_ms)] = count
        held[str(bound_ms)] = total + group_max
    return {"over_ms": over, "held_s": held}


def steady_state(
    results: list[RequestResult], max_concurrency: int, duration_s: float
) -> dict[str, Any] | None:
    """A closed loop's output tokens/s while it was full: from the first moment
    `max_concurrency` requests were in flight to the last send, after which the loop drains
    and fewer and fewer streams remain (the longest requests alone at the end). The whole
    run's tokens/s mixes that drain in, and how long it lasts hangs on which requests happen
    to finish last: 48-stream chat runs of one server differed by 15 % that way (H200,
    2026-12-02). None when the loop never filled or never sent after filling.

    Token times: a request's first content chunk at send + TTFT, each later one a gap later;
    its output tokens spread evenly over its chunks (one a chunk when the server streams one
    token a step)."""
    ok = [r for r in results if r.success]
    edges = sorted(
        [(r.send_s, 1) for r in ok] + [(r.send_s + r.e2el_s, -1) for r in ok],
        key=lambda e: (e[0], e[1]),  # at a tie an end comes first: a slot handed over
    )
    in_flight, full_s = 0, None
    for t, d in edges:
        in_flight += d
        if in_flight >= max_concurrency:
            full_s = t
            break
    if full_s is None:
        return None
    end_s = max(r.send_s for r in ok)
    if end_s <= full_s:
        return None
    tokens = 0.0
    for r in ok:
        times = np.cumsum([r.send_s + r.ttft_s, *r.itl_s])
        per_chunk = r.num_output_tokens / len(times)
        tokens += per_chunk * int(np.count_nonzero((times >= full_s) & (times < end_s)))
    window_s = end_s - full_s
    return {
        "output_throughput": tokens / window_s,
        "window_s": [full_s, end_s],
        "fraction_of_run": window_s / max(duration_s, 1e-9),
    }


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    slo: SLO | None = None,
    max_concurrency: int | None = None,
) -> dict[str, Any]:
    """Aggregate one run. `duration_s` is the benchmark wall time (first send to last finish).
    `max_concurrency` (a closed loop): also the loop's full-window throughput (`steady_state`)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.num_prompt_tokens for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    lags = [r.send_s - r.scheduled_s for r in results if r.send_s > 0]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "failure_reasons": dict(Counter(r.error or "unknown" for r in failed).most_common()),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **latencies(ok),
        # How late the client sent requests versus the arrival plan: a large value means the
        # load generator, not the server, limited the offered load.
        "send_lag_ms": summarize_ms(lags),
    }
    expected = [r for r in ok if r.expected_output_tokens > 0 and r.api != "score"]
    if expected:
        exact = sum(r.num_output_tokens == r.expected_output_tokens for r in expected)
        metrics["output_len_exact_fraction"] = exact / len(expected)
        metrics["output_tokens_from_usage_fraction"] = sum(
            r.output_tokens_from_usage for r in expected
        ) / len(expected)
    if max_concurrency:
        metrics["steady_state"] = steady_state(results, max_concurrency, duration_s)
    sources = sorted({r.source for r in results})
    if len(sources) > 1:
        # A mix (e.g. `mixed`: chat next to long prompts): each part's latencies alone, since
        # the pooled TTFT mostly says how long the long prompts are, and the chat streams' gaps
        # are what the long prefills cost them.
        metrics["by_source"] = {src: _part(results, src) for src in sources}
    if slo is not None:
        good = sum(slo.met_by(r) for r in results)
        metrics["slo"] = slo.as_dict()
        metrics["goodput"] = good / duration_s
        metrics["slo_attainment"] = good / max(len(results), 1)
    return metrics


def token_gaps(itl_s: list[float], itl_tokens: list[int]) -> list[float]:
    """The gaps between tokens as the server produced them: a chunk's gap shared evenly by the
    tokens it carried (`RequestResult.itl_tokens`). Empty without token counts."""
    if not itl_tokens or len(itl_tokens) != len(itl_s):
        return []
    out: list[float] = []
    for gap, k in zip(itl_s, itl_tokens, strict=True):
        k = max(1, k)  # text held back (a stop string's prefix) may come with no new token
        out += [gap / k] * k
    return out


def latencies(ok: list[RequestResult]) -> dict[str, Any]:
    """TTFT, TPOT, the gaps between tokens (summary and tail) and E2EL of successful requests.
    `itl_ms`: the gaps between chunks, what a client sees; `token_itl_ms` (when the server
    counts tokens in every chunk): those gaps shared by the tokens each chunk carried."""
    itls = [gap for r in ok for gap in r.itl_s]
    out = {
        "ttft_ms": summarize_ms([r.ttft_s for r in ok]),
        "tpot_ms": summarize_ms([t for t in (r.tpot_s for r in ok) if t is not None]),
        "itl_ms": summarize_ms(itls),
        "itl_tail": gap_tail(itls),
        "stalls": stalls(ok),
        "e2el_ms": summarize_ms([r.e2el_s for r in ok]),
    }
    tokens = [gap for r in ok for gap in token_gaps(r.itl_s, r.itl_tokens)]
    if tokens:
        out["token_itl_ms"] = summarize_ms(tokens)
    return out


def _part(results: list[RequestResult], source: str) -> dict[str, Any]:
    """One source's requests of a mixed run: counts and latency summaries."""
    part = [r for r in results if r.source == source]
    ok = [r for r in part if r.success]
    return {
        "completed": len(ok),
        "failed": len(part) - len(ok),
        "prompt_tokens_mean": float(np.mean([r.num_prompt_tokens for r in ok])) if ok else None,
        **latencies(ok),
    }


# SLO key -> the metrics key it bounds (TBT is measured as pooled inter-token latency).
METRIC_OF_SLO = {"tbt_ms": "itl_ms"}


def meets_p99_slo(metrics: dict[str, Any], slo: SLO, max_failed_fraction: float = 0.0) -> bool:
    """True when each SLO'd metric's P99 is within its objective and failures are tolerated."""
    total = metrics["completed"] + metrics["failed"]
    if total == 0 or metrics["failed"] > max_failed_fraction * total:
        return False
    for key, limit in slo.as_dict().items():
        p99 = metrics[METRIC_OF_SLO.get(key, key)]["p99"]
        if p99 is not None and p99 > limit:
            return False
    return True
