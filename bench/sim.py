"""Discrete-event simulation of prefill scheduling on one GPU.

    python -m bench.sim --workload post-recommendation --policies fcfs,spf,srjf,srjf-oneshot \
        --qps 2,4,6,8 --seed 0 --out bench/results/sim-post.json --plot bench/results/sim-post.png

Model (docs/scheduling.md, "Simulator"):
* One GPU runs one forward at a time, non-preemptively. A forward takes waiting requests in
  policy order (lowest score first, ties by arrival) while their uncached tokens fit the token
  budget and their number `max_num_seqs` (256, the engine's default); a request larger than
  the budget runs alone (the engine's rule for scoring requests).
* Service times come from a measured prefill profile (`--profile`, bench/sim_profile.py):
  interpolated medians times the profile's measured noise. They do not come from the JCT model
  the scheduler ranks with: that model is fitted on the other half of the profile's repeats
  (or `--jct-profile`, or loaded with `--calibration`) and refined online from the simulated
  forward times, as the engine refines its own. `--service jct` restores the old flattering
  model (service = the scheduler's own prediction x log-normal noise) for comparison.
* The prefix cache is the engine's KV pool at block granularity (`BlockPrefixCache`): a
  request keeps the full blocks of its whole prompt (profile and post) as far as the pool
  allows; released blocks enter an LRU tail first; eviction takes the least recently used
  blocks, so a profile can be partly cached. Capacity defaults to half the workload's working
  set (`--cache-fraction 0.5`).
* The policies are the real `policies` objects, fed views that carry the cache hit *now*.

Deterministic for a seed: no wall clock, no unseeded randomness, ordered containers only.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim_profile import (
    DEFAULT_PROFILE,
    JCTService,
    PrefillProfile,
    ProfileService,
    fit_jct,
)
from bench.sim_workloads import WORKLOAD_NAMES, SimRequestSpec, Workload, make_workload
from policies import JCTModel, Policy, make_policy, prefill_work

SLO_MULTIPLE = 10.0  # default P99 SLO = 10x the median cold prefill of a mean-length prompt
MIN_SPAN_SLOS = 10.0  # a run's arrivals span at least this many SLOs (run_experiment)
# A simulator-only policy name: SRJF told the run's P99 SLO (`--latency-slo-ms` in the engine),
# each request aging by its own slack instead of one fairness lambda (policies/srjf.py).
SLO_AWARE_SRJF = "srjf-slo"
DEFAULT_TOKEN_BUDGET = 8192  # EngineConfig.prefill_token_budget's default
DEFAULT_MAX_NUM_SEQS = 256  # EngineConfig.max_num_seqs's default: requests in one step at most
DEFAULT_BLOCK_SIZE = 16  # EngineConfig.block_size's default
PLAN_AHEAD_HELP = (  # bench.sim's and bench.sim_sweep's --plan-ahead
    "each forward chosen when the one before it starts, as the engine's overlapped scheduling "
    "plans a step ahead (simulate's `plan_ahead`; default: when it ends)"
)


def add_plan_ahead_args(p: argparse.ArgumentParser, plan_ahead_help: str = PLAN_AHEAD_HELP) -> None:
    """--plan-ahead and its two refinements (bench.sim, bench.sim_sweep, bench.sim_vs_gpu)."""
    p.add_argument("--plan-ahead", action="store_true", help=plan_ahead_help)
    p.add_argument(
        "--plan-lead-ms",
        type=float,
        help="--plan-ahead: the next forward is chosen this long before the current one ends "
        "(at its start if shorter), as when a launch waits on the device; default: at its "
        "start, the upper bound (recorded as plan_lead_ms)",
    )
    p.add_argument(
        "--overlap-max-step-ms",
        type=float,
        help="--plan-ahead: nothing chosen ahead of a forward the scheduler's JCT model predicts "
        "this long, a what-if modelling the engine's former --overlap-max-step-ms (removed in "
        "the forty-fifth session; kept for replays of earlier GPU runs; recorded as "
        "overlap_max_step_ms)",
    )


def plan_ahead_from_args(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[float | None, float | None]:
    """(`plan_lead_s`, `overlap_max_step_s`) from `add_plan_ahead_args`'s flags; refuses the
    refinements without --plan-ahead."""
    lead_ms, max_ms = args.plan_lead_ms, args.overlap_max_step_ms
    if (lead_ms is not None or max_ms is not None) and not args.plan_ahead:
        p.error("--plan-lead-ms and --overlap-max-step-ms refine --plan-ahead: give it too")
    for name, ms in (("--plan-lead-ms", lead_ms), ("--overlap-max-step-ms", max_ms)):
        if ms is not None and not ms >= 0:
            p.error(f"{name} must be >= 0")
    return (
        None if lead_ms is None else lead_ms / 1e3,
        None if max_ms is None else max_ms / 1e3,
    )


def plan_ahead_record(
    plan_ahead: bool, plan_lead_s: float | None, overlap_max_step_s: float | None
) -> dict[str, float | None]:
    """The refinements a run used, for its JSON (none without plan-ahead)."""
    if not plan_ahead:
        return {}
    return {
        "plan_lead_ms": None if plan_lead_s is None else plan_lead_s * 1e3,
        "overlap_max_step_ms": None if overlap_max_step_s is None else overlap_max_step_s * 1e3,
    }


Service = ProfileService | JCTService


class BlockPrefixCache:
    """The engine's prefix cache in a KV pool of `capacity_tokens`, at block granularity.

    A request's full prompt blocks form two chains: its prefix's (`prefix_tokens // block`
    blocks, shared by every request of the user) and a branch after it (the post's blocks,
    shared only by a repeat of the same post). A chain is cached as its leading blocks
    [0, k). As in `runtime.kv.block_manager`: a forward pins the blocks it hits, allocates fresh
    blocks for as much of the rest as the pool can hold (evicting least recently used cached
    blocks), and on completion releases all of them, tail first, into the LRU; eviction takes
    a chain's tail blocks first. One forward at a time: `admit` then `release`.

    `queue_aware` (a what-if, not the engine's rule): eviction first takes the least recently
    used chains that no waiting request (`admit`'s `waiting`) would hit, and only then the
    rest in LRU order.
    """

    def __init__(
        self, capacity_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE, queue_aware: bool = False
    ) -> None:
        self.block_size = block_size
        self.queue_aware = queue_aware
        self._protected: set[Hashable] = set()  # chains waiting requests would hit (queue_aware)
        self.capacity_blocks = max(0, capacity_tokens) // block_size
        self._idle: OrderedDict[Hashable, int] = OrderedDict()  # chain -> blocks, LRU first
        self.idle_blocks = 0
        self._pinned: dict[Hashable, int] = {}  # chain -> blocks held by the running forward
        self._pin_refs: dict[Hashable, int] = {}
        self.pinned_blocks = 0
        self._new_blocks = 0  # fresh blocks the running forward holds
        self._running: list[tuple[Hashable, Hashable, int, int]] = []

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def _chains(self, req: SimRequest) -> tuple[Hashable, Hashable, int, int, int]:
        """(prefix chain, branch chain, prefix blocks, full blocks, most blocks a hit may have)."""
        bs = self.block_size
        pkey = ("p", req.prefix_key)
        item = req.item_key if req.item_key is not None else ("r", req.request_id)
        bkey = ("b", req.prefix_key, item)
        num_prefix = req.prefix_tokens // bs if req.prefix_key is not None else 0
        return (
            pkey,
            bkey,
            num_prefix,
            req.num_prompt_tokens // bs,
            (req.num_prompt_tokens - 1) // bs,
        )

    def _cached(self, key: Hashable) -> int:
        return self._pinned.get(key, 0) or self._idle.get(key, 0)

    def peek(self, req: SimRequest) -> int:
        """Cached tokens of `req`'s prompt now, without touching recency (a policy's lookup)."""
        pkey, bkey, num_prefix, _, max_hit = self._chains(req)
        hit = self._cached(pkey) if num_prefix else 0
        if hit >= num_prefix:
            hit = num_prefix + self._cached(bkey)
        return min(hit, max_hit) * self.block_size

    def _pin(self, key: Hashable) -> None:
        if key in self._pinned:
            self._pin_refs[key] += 1
            return
        n = self._idle.pop(key, 0)
        self.idle_blocks -= n
        self._pinned[key] = n
        self._pin_refs[key] = 1
        self.pinned_blocks += n

    def _evict(self, num_blocks: int) -> None:
        if self._protected:
            for key in [k for k in self._idle if k not in self._protected]:
                if num_blocks <= 0:
                    return
                n = self._idle[key]
                take = min(n, num_blocks)
                if take == n:
                    del self._idle[key]
                else:
                    self._idle[key] = n - take
                self.idle_blocks -= take
                num_blocks -= take
        while num_blocks > 0 and self._idle:
            key, n = next(iter(self._idle.items()))
            take = min(n, num_blocks)
            if take == n:
                del self._idle[key]
            else:
                self._idle[key] = n - take  # its head stays least recently used
            self.idle_blocks -= take
            num_blocks -= take

    def admit(self, batch: Sequence[SimRequest], waiting: Sequence[SimRequest] = ()) -> list[int]:
        """Start a forward over `batch`; returns each request's cached tokens (in order).
        `waiting`: the requests still queued (their chains are evicted last if `queue_aware`)."""
        self._protected = set()
        if self.queue_aware:
            for req in waiting:
                pkey, bkey, *_ = self._chains(req)
                self._protected.update((pkey, bkey))
        hits = []
        for req in batch:
            hit_tokens = self.peek(req)
            pkey, bkey, num_prefix, num_full, _ = self._chains(req)
            hit = hit_tokens // self.block_size
            if num_prefix and self._cached(pkey):
                self._pin(pkey)
            if hit > num_prefix and self._cached(bkey):
                self._pin(bkey)
            free = self.capacity_blocks - self.pinned_blocks - self._new_blocks
            keep_new = max(0, min(num_full - hit, free))
            self._evict(
                self.idle_blocks
                + self.pinned_blocks
                + self._new_blocks
                + keep_new
                - self.capacity_blocks
            )
            self._new_blocks += keep_new
            kept = hit + keep_new
            self._running.append((pkey, bkey, min(kept, num_prefix), max(kept - num_prefix, 0)))
            hits.append(hit_tokens)
        return hits

    def release(self) -> None:
        """End the forward: every kept block becomes cached and idle, tail (branch) first."""
        lengths: dict[Hashable, int] = {}
        for pkey, bkey, kp, kb in self._running:
            for key, k in ((bkey, kb), (pkey, kp)):
                if k > 0 or key in self._pinned:
                    old = max(self._pinned.get(key, 0), self._idle.get(key, 0))
                    lengths[key] = max(lengths.get(key, 0), k, old)
        self._pinned.clear()
        self._pin_refs.clear()
        self.pinned_blocks = 0
        self._new_blocks = 0
        for pkey, bkey, _, _ in self._running:
            for key in (bkey, pkey):
                n = lengths.get(key, 0)
                if n <= 0:
                    continue
                self.idle_blocks += n - self._idle.pop(key, 0)
                self._idle[key] = n  # most recently used
        self._running.clear()
        assert self.idle_blocks <= self.capacity_blocks, "cache over capacity"

    def reset(self) -> None:
        """Drop every cached block (`POST /admin/api/prefix-cache/reset`)."""
        self._idle.clear()
        self.idle_blocks = 0


@dataclass(slots=True)
class SimRequest:
    """A waiting request as the scheduler shows it to a policy (`WaitingView`)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    prefix_key: str | None
    prefix_tokens: int
    item_key: Hashable | None = None
    num_cached_tokens_now: int = 0
    remaining_prompt_tokens: int = field(default=0)


@dataclass(slots=True)
class RunStats:
    policy: str
    qps: float
    completed: int
    num_requests: int
    mean_latency_s: float
    p50_latency_s: float
    p90_latency_s: float
    p99_latency_s: float
    max_latency_s: float
    cache_hit_token_fraction: float
    makespan_s: float
    stopped_early: bool = False
    extrapolated_forward_fraction: float = 0.0  # forwards outside the profile's measured grid
    jct_mape: float | None = None  # the scheduler's prediction error (online, like the engine)
    # The simulated GPU's work: forwards run, their summed seconds, the largest batch. Busy
    # seconds per completed request near saturation are the simulator's capacity, to set
    # beside a GPU run's completions per second.
    num_forwards: int = 0
    busy_s: float = 0.0
    max_batch: int = 0


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def simulate(
    workload: Workload,
    policy: Policy,
    qps: float,
    *,
    service: Service,
    cache_tokens: int | None = None,
    cache: BlockPrefixCache | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    seed: int = 0,
    fail_above_s: float | None = None,
    jct_model: JCTModel | None = None,
    arrivals_s: Sequence[float] | None = None,
    latencies_out: list[float] | None = None,
    step_overhead_s: float = 0.0,
    request_overhead_s: float = 0.0,
    plan_ahead: bool = False,
    plan_lead_s: float | None = None,
    overlap_max_step_s: float | None = None,
    records_out: list[dict[str, Any]] | None = None,
) -> RunStats:
    """Run one (policy, QPS) point.

    `cache` carries a prefix cache across runs (else a fresh one of `cache_tokens`).
    `jct_model`, when given, observes every forward (the engine's online refinement: pass the
    model the policy ranks with). `arrivals_s` replaces the workload's unit-rate arrivals / QPS
    (one per request). With `fail_above_s`, stop as soon as more than 1% of the requests are
    certain to exceed that latency (the max-QPS search; the result is then `stopped_early`).
    `latencies_out` receives every completed request's latency (completion order);
    `records_out` one dict per completed request (`request_id`, `latency_s`, `queue_s`: arrival
    to its forward's start, `cached_tokens`, `batch`: its forward's size), to set beside a GPU
    run's per-request records.
    `step_overhead_s` is added to every forward (host work on the engine thread between
    forwards: it delays everything behind it); `request_overhead_s` to every request's latency
    only (HTTP and front-end work done beside the GPU). Both are 0 unless measured.

    `plan_ahead`: the engine's overlapped scheduling (runtime/engine.py, on by default there).
    The engine plans step N+1 as soon as step N starts on the device (when launching a step is
    quicker than running it; a launch that waits on the device decides later, so this is an
    upper bound), from the requests queued then: a request that arrives during step N can run
    in step N+2 at the earliest; when
    nothing is queued at N's start it plans N+1 at N's end, as the simulator does without this.
    Requests whose prefix step N is computing are passed over then (the scheduler's wait for a
    shared prefix being prefilled). Off: every forward is chosen when the one before it ends.
    `plan_lead_s` (with `plan_ahead`): a launch that waits on the device (its launch queue
    full) returns about this long before its step ends (at once if the step is shorter). So
    step N+1 is chosen `plan_lead_s` before step N ends, arrivals until then included; and
    step N's answers, which the engine applies after launching step N+1, come out when that
    launch returns, `plan_lead_s` before step N+1 ends (at N's end when N+1 was not planned
    ahead). None: N+1 chosen at N's start and answers at their step's end, the upper bound
    of the stale plan. `overlap_max_step_s` (with `plan_ahead`): a what-if modelling the
    engine's former `overlap_max_step_ms` (removed in the forty-fifth session; kept for replays
    of earlier GPU runs): a forward that `jct_model` (else its own time) predicts this long
    runs alone (the one before it is answered first; nothing is planned ahead of it)."""
    noise_rng = random.Random(f"noise:{seed}")
    if cache is None:
        if cache_tokens is None:
            raise ValueError("simulate needs cache_tokens or a cache")
        cache = BlockPrefixCache(cache_tokens)
    if arrivals_s is not None and len(arrivals_s) != len(workload.requests):
        raise ValueError("arrivals_s needs one arrival per request")
    pending = [
        SimRequest(
            r.request_id,
            arrivals_s[i] if arrivals_s is not None else r.arrival_unit_s / qps,
            r.num_prompt_tokens,
            r.prefix_key,
            r.prefix_tokens,
            r.item_key,
            0,
            r.num_prompt_tokens,
        )
        for i, r in enumerate(workload.requests)
    ]
    pending.sort(key=lambda r: r.arrival_s)
    n = len(pending)
    violation_limit = math.floor(0.01 * n)
    waiting: list[SimRequest] = []
    latencies: list[float] = []
    violations = forwards = extrapolated = max_batch = 0
    busy_s = 0.0
    hit_tokens = prompt_tokens = 0
    now = pending[0].arrival_s if pending else 0.0
    next_arrival = 0

    def stats(stopped: bool = False) -> RunStats:
        if latencies_out is not None:
            latencies_out.extend(latencies)
        return _stats(
            policy.name,
            qps,
            latencies,
            n,
            hit_tokens,
            prompt_tokens,
            now,
            stopped,
            extrapolated / forwards if forwards else 0.0,
            jct_model.mape() if jct_model is not None else None,
            forwards,
            busy_s,
            max_batch,
        )

    def choose(candidates: list[SimRequest], at_s: float) -> list[SimRequest]:
        """One scheduling decision: refresh every cache hit (continuous calibration), score,
        fill the step in policy order."""
        for r in candidates:
            r.num_cached_tokens_now = cache.peek(r)
        order = sorted(candidates, key=lambda r: (policy.score(r, at_s), r.arrival_s))
        batch: list[SimRequest] = []
        used = 0
        for r in order:
            u, _ = prefill_work(r)
            # The engine's two caps on a step: its token budget and max_num_seqs (nearly
            # fully cached requests of a few tokens each reach the second one first).
            if batch and (used + u > token_budget or len(batch) >= max_num_seqs):
                break
            batch.append(r)
            used += u
            if used >= token_budget:
                break
        return batch

    planned: list[SimRequest] = []  # the next forward, chosen when the current one started
    # The last forward whose answers are not out yet: (batch, items, its end). With a plan
    # lead they come out when the next forward's launch returns (see the docstring).
    undelivered: tuple[list[SimRequest], list[tuple[int, int]], float, float] | None = None

    def deliver(
        done: tuple[list[SimRequest], list[tuple[int, int]], float, float], at_s: float
    ) -> None:
        nonlocal hit_tokens, prompt_tokens, violations
        batch, items, start_s, _end_s = done
        for r, (_u, c) in zip(batch, items, strict=True):
            latency = at_s - r.arrival_s + request_overhead_s
            latencies.append(latency)
            if records_out is not None:
                records_out.append(
                    {
                        "request_id": r.request_id,
                        "latency_s": latency,
                        "queue_s": start_s - r.arrival_s,
                        "cached_tokens": c,
                        "prompt_tokens": r.num_prompt_tokens,
                        "batch": len(batch),
                    }
                )
            hit_tokens += c
            prompt_tokens += r.num_prompt_tokens
            if fail_above_s is not None and latency > fail_above_s:
                violations += 1

    while len(latencies) < n:
        while next_arrival < n and pending[next_arrival].arrival_s <= now:
            waiting.append(pending[next_arrival])
            next_arrival += 1
        if not waiting:
            if undelivered is not None:  # nothing to launch: the engine waits for it
                deliver(undelivered, undelivered[3])
                undelivered = None
                continue
            now = pending[next_arrival].arrival_s
            continue
        from_plan = bool(planned)
        batch, planned = (planned, []) if planned else (choose(waiting, now), [])
        # Admission: pin hits, allocate (evicting); the forward runs; its blocks are released.
        hits = cache.admit(batch, waiting)
        items = []
        for r, hit in zip(batch, hits, strict=True):
            r.num_cached_tokens_now = hit
            items.append(prefill_work(r))
        duration = service.forward_s(items, noise_rng) + step_overhead_s
        if plan_ahead and overlap_max_step_s is not None:
            predicted_s = jct_model.predict_batch_s(items) if jct_model is not None else duration
            long_step = predicted_s >= overlap_max_step_s
        else:
            long_step = False
        if undelivered is not None:
            # The previous forward's answers: with a plan lead, this forward was launched while
            # it ran (planned ahead, not a long one) and the host is in that launch until
            # `plan_lead_s` before this one ends; otherwise they come at its end.
            late = plan_ahead and plan_lead_s is not None and from_plan and not long_step
            deliver(
                undelivered, undelivered[3] + (max(0.0, duration - plan_lead_s) if late else 0.0)
            )
            undelivered = None
        if plan_ahead and not long_step:
            # Step N+1 from the queue as it stands when it is planned (see the docstring).
            plan_at = now if plan_lead_s is None else max(now, now + duration - plan_lead_s)
            while next_arrival < n and pending[next_arrival].arrival_s <= plan_at:
                waiting.append(pending[next_arrival])
                next_arrival += 1
            chosen = {id(r) for r in batch}
            computing = {
                r.prefix_key
                for r, (_u, c) in zip(batch, items, strict=True)
                if r.prefix_key is not None and c < r.prefix_tokens
            }
            rest = [r for r in waiting if id(r) not in chosen and r.prefix_key not in computing]
            if rest:
                planned = choose(rest, plan_at)
        forwards += 1
        busy_s += duration
        max_batch = max(max_batch, len(batch))
        extrapolated += not all(service.in_range(u, c) for u, c in items)
        if jct_model is not None:
            jct_model.observe_batch(items, duration)  # the engine times the whole step
        start_s = now
        now += duration
        cache.release()
        # (The forward's requests all finish at its end: scoring answers come with the logits.)
        chosen = {id(r) for r in batch}
        waiting = [r for r in waiting if id(r) not in chosen]
        undelivered = (batch, items, start_s, now)
        if not (plan_ahead and plan_lead_s is not None):
            deliver(undelivered, now)  # no launch holds the host: answered at its end
            undelivered = None
        if fail_above_s is not None:
            certain = violations + sum(1 for r in waiting if now - r.arrival_s > fail_above_s)
            if certain > violation_limit:
                return stats(stopped=True)
    return stats()


def prime_cache(
    cache: BlockPrefixCache,
    requests: Sequence[Any],
    service: Service,
    jct_model: JCTModel | None = None,
) -> None:
    """One forward per request, in order, before a run (`bench.serve --prime-prefixes`): the
    cache then holds what it keeps of every user's profile, least recent first. The scheduler's
    model observes these forwards, as the engine's does. `requests`: SimRequestSpec-like."""
    rng = random.Random("prime")
    for r in requests:
        view = SimRequest(
            r.request_id,
            0.0,
            r.num_prompt_tokens,
            r.prefix_key,
            r.prefix_tokens,
            r.item_key,
            0,
            r.num_prompt_tokens,
        )
        view.num_cached_tokens_now = cache.admit([view])[0]
        items = [prefill_work(view)]
        duration = service.forward_s(items, rng)
        if jct_model is not None:
            jct_model.observe_batch(items, duration)
        cache.release()


def priming_requests(workload: Workload) -> list[SimRequestSpec]:
    """One request per user, in user order: the user's first request in the workload (its
    post), or its profile plus the shortest suffix if it never appears."""
    first: dict[str, SimRequestSpec] = {}
    for r in workload.requests:
        if r.prefix_key is not None and r.prefix_key not in first:
            first[r.prefix_key] = r
    out = []
    for user, tokens in workload.prefix_tokens_by_user.items():
        r = first.get(user)
        suffix = r.num_prompt_tokens - r.prefix_tokens if r else workload.spec.suffix_min_tokens
        item = r.item_key if r else None
        out.append(SimRequestSpec(f"prime-{user}", 0.0, user, tokens, tokens + suffix, item))
    return out


def _stats(
    name: str,
    qps: float,
    latencies: list[float],
    n: int,
    hit: int,
    total: int,
    makespan_s: float,
    stopped_early: bool = False,
    extrapolated_fraction: float = 0.0,
    jct_mape: float | None = None,
    num_forwards: int = 0,
    busy_s: float = 0.0,
    max_batch: int = 0,
) -> RunStats:
    lat = sorted(latencies)
    return RunStats(
        policy=name,
        qps=qps,
        completed=len(lat),
        num_requests=n,
        mean_latency_s=sum(lat) / len(lat) if lat else math.nan,
        p50_latency_s=percentile(lat, 50),
        p90_latency_s=percentile(lat, 90),
        p99_latency_s=percentile(lat, 99),
        max_latency_s=lat[-1] if lat else math.nan,
        cache_hit_token_fraction=hit / total if total else 0.0,
        makespan_s=makespan_s,
        stopped_early=stopped_early,
        extrapolated_forward_fraction=extrapolated_fraction,
        jct_mape=jct_mape,
        num_forwards=num_forwards,
        busy_s=busy_s,
        max_batch=max_batch,
    )


def max_qps_at_slo(
    run: Callable[[float, float | None], RunStats],
    slo_p99_s: float,
    *,
    start_qps: float = 0.125,
    max_qps: float = 4096.0,
    rel_tol: float = 0.01,
) -> float:
    """Highest QPS whose P99 meets the SLO: doubling to bracket, then bisection.

    `run(qps, fail_above_s)` returns RunStats. Assumes P99 grows with QPS (it does with the
    common-random-number arrivals, up to noise); returns 0.0 if even `start_qps` fails and
    `max_qps` if that passes (a cap, e.g. the burst capacity: no longer run sustains more).
    """

    def meets(qps: float) -> bool:
        st = run(qps, slo_p99_s)
        return not st.stopped_early and st.p99_latency_s <= slo_p99_s

    start_qps = min(start_qps, max_qps)
    if not meets(start_qps):
        lo, hi = 0.0, start_qps
    else:
        lo, hi = start_qps, min(start_qps * 2, max_qps)
        while hi > lo and meets(hi):
            lo, hi = hi, min(hi * 2, max_qps)
        if hi <= lo:
            return lo
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------------------
# Setup: where service times and the scheduler's JCT model come from
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SimSetup:
    """Service-time model, the scheduler's JCT model (a template copied per run), and how
    they were made (recorded in every result)."""

    service: Service
    jct_template: JCTModel
    online_refit: bool = True
    record: dict[str, Any] = field(default_factory=dict)

    def new_jct(self) -> JCTModel:
        """A fresh copy of the scheduler's model (each simulated server starts from it)."""
        return copy.deepcopy(self.jct_template)


def build_setup(
    *,
    service: str = "profile",
    profile_path: str | None = None,
    jct_profile_path: str | None = None,
    calibration_path: str | None = None,
    noise_sigma: float | None = None,
    online_refit: bool = True,
) -> SimSetup:
    """Service `profile` (default): times from `profile_path` (default: DEFAULT_PROFILE, the
    H200 profile measured on 2026-12-01); the scheduler's JCT model from `calibration_path` if
    given, else fitted on `jct_profile_path` if given, else on the calibration half of the
    profile's repeats (the service then uses the other half). Service `jct`: the old model,
    service = the scheduler's JCT (fallback default or `calibration_path`) x
    log-normal(`noise_sigma`, default 0.05)."""
    if service == "jct":
        if profile_path or jct_profile_path:
            raise ValueError(
                "--service jct takes no --profile/--jct-profile (its service is the JCT)"
            )
        model = JCTModel.load(calibration_path) if calibration_path else JCTModel()
        sigma = 0.05 if noise_sigma is None else noise_sigma
        svc = JCTService(copy.deepcopy(model), sigma)
        return SimSetup(
            svc,
            model,
            online_refit,
            {
                "service": svc.describe(),
                "scheduler_jct": _jct_record(model),
                "online_refit": online_refit,
            },
        )
    if service != "profile":
        raise ValueError(f"unknown service model {service!r} (profile | jct)")
    if noise_sigma is not None:
        raise ValueError("--noise applies to --service jct; a profile carries its measured noise")
    profile = PrefillProfile.load(profile_path or DEFAULT_PROFILE)
    if calibration_path or jct_profile_path:
        service_profile = profile
        if calibration_path:
            jct = JCTModel.load(calibration_path)
            how = f"loaded from {calibration_path}"
        else:
            assert jct_profile_path is not None
            jct = fit_jct(PrefillProfile.load(jct_profile_path))
            how = f"fitted on the separate profile {jct_profile_path}"
    else:
        calib, service_profile = profile.split_repeats()
        jct = fit_jct(calib)
        how = "fitted on the calibration half (even repeats) of the profile; service: odd repeats"
    svc = ProfileService(service_profile)
    return SimSetup(
        svc,
        jct,
        online_refit,
        {
            "service": svc.describe(),
            "scheduler_jct": {**_jct_record(jct), "how": how},
            "online_refit": online_refit,
        },
    )


def _jct_record(model: JCTModel) -> dict[str, Any]:
    return {**model.coefficients, "source": model.source}


def cold_slo_s(
    service: Service, mean_prompt_tokens: float, multiple: float = SLO_MULTIPLE
) -> float:
    """The default P99 SLO: `multiple` x the median cold prefill of a mean-length prompt."""
    return multiple * service.median_s(round(mean_prompt_tokens), 0)


def run_experiment(
    workload_name: str,
    policy_names: list[str],
    qps_list: list[float],
    *,
    seed: int = 0,
    num_requests: int = 1000,
    scale: float = 1.0,
    setup: SimSetup | None = None,
    cache_tokens: int | None = None,
    cache_fraction: float = 0.5,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    block_size: int = DEFAULT_BLOCK_SIZE,
    slo_p99_s: float | None = None,
    slo_multiple: float = SLO_MULTIPLE,
    gamma: float | None = None,
    fairness_lambda: float | None = None,
    search: bool = True,
    prime: bool = False,
    min_span_slos: float = MIN_SPAN_SLOS,
    queue_aware_eviction: bool = False,
    plan_ahead: bool = False,
    plan_lead_s: float | None = None,
    overlap_max_step_s: float | None = None,
) -> dict[str, Any]:
    """Everything `python -m bench.sim` writes, as a JSON-ready dict. Every run starts with an
    empty cache (with `prime`: one request per user first, as a running service's cache) and
    a fresh copy of the scheduler's JCT model. The SLO is `slo_p99_s`, else `slo_multiple` x
    the median cold prefill of a mean-length prompt.

    Finite runs flatter a max-QPS search: a run shorter than the SLO passes at any load its
    backlog can drain within the SLO. So a run at `qps` has at least `qps * min_span_slos *
    SLO` requests (arrivals spanning that many SLOs; the first `num_requests` are the same
    for every QPS), and the search is capped at the policy's burst capacity (all
    `num_requests` at once: requests / makespan; a steady load above it cannot be served)."""
    setup = setup or build_setup()
    wl = make_workload(workload_name, num_requests, seed, scale)
    if cache_tokens is None:
        cache_tokens = int(cache_fraction * wl.working_set_tokens)
    if slo_p99_s is None:
        slo_p99_s = cold_slo_s(setup.service, wl.mean_prompt_tokens, slo_multiple)
    priming = priming_requests(wl) if prime else []
    longer: dict[int, Workload] = {num_requests: wl}

    def workload_for(qps: float) -> Workload:
        n = max(num_requests, math.ceil(qps * min_span_slos * slo_p99_s))
        if n not in longer:
            longer[n] = make_workload(workload_name, n, seed, scale)
        return longer[n]

    def runner(name: str) -> Callable[[float, float | None], RunStats]:
        def run(qps: float, fail_above_s: float | None = None, burst: bool = False) -> RunStats:
            # A fresh policy and model per run: srjf-oneshot's memory and the online
            # refinement must not leak across runs.
            jct = setup.new_jct()
            if name == SLO_AWARE_SRJF:  # SRJF given the SLO: each request ages by its slack
                pol = make_policy("srjf", jct_model=jct, latency_slo_s=slo_p99_s)
            else:
                pol = make_policy(name, jct_model=jct, gamma=gamma, fairness_lambda=fairness_lambda)
            cache = BlockPrefixCache(cache_tokens, block_size, queue_aware_eviction)
            if prime:
                prime_cache(cache, priming, setup.service, jct if setup.online_refit else None)
            return simulate(
                wl if burst else workload_for(qps),
                pol,
                qps,
                service=setup.service,
                cache=cache,
                token_budget=token_budget,
                seed=seed,
                fail_above_s=fail_above_s,
                jct_model=jct if setup.online_refit else None,
                plan_ahead=plan_ahead,
                plan_lead_s=plan_lead_s,
                overlap_max_step_s=overlap_max_step_s,
            )

        return run

    results = []
    max_qps: dict[str, float] = {}
    capacity: dict[str, float] = {}
    for name in policy_names:
        run = runner(name)
        for qps in qps_list:
            st = run(qps)
            row = {k: getattr(st, k) for k in st.__slots__ if k != "stopped_early"}
            row["policy"] = name  # the name asked for (srjf-slo's policy calls itself srjf)
            results.append(row)
        if search:
            burst = run(1e9, None, True)
            capacity[name] = round(num_requests / burst.makespan_s, 4)
            max_qps[name] = round(max_qps_at_slo(run, slo_p99_s, max_qps=capacity[name]), 4)
    return {
        "workload": workload_name,
        "workload_note": wl.spec.note,
        "scale": scale,
        "seed": seed,
        "num_requests": num_requests,
        "working_set_tokens": wl.working_set_tokens,
        "cache_tokens": cache_tokens,
        "block_size": block_size,
        "token_budget": token_budget,
        **setup.record,
        "gamma_tokens_per_s": gamma,
        "fairness_lambda": fairness_lambda,
        "primed": prime,
        "eviction": "queue-aware" if queue_aware_eviction else "lru",
        "plan_ahead": plan_ahead,
        **plan_ahead_record(plan_ahead, plan_lead_s, overlap_max_step_s),
        "slo_p99_s": slo_p99_s,
        "min_span_slos": min_span_slos,
        "results": results,
        "max_qps_at_slo": max_qps,
        "burst_capacity_qps": capacity,
    }


def plot(data: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = data["results"]
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        pts = sorted(
            (r["qps"], r["mean_latency_s"], r["p99_latency_s"]) for r in rows if r["policy"] == name
        )
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=color, label=f"{name} P99")
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{name} mean",
        )
    ax.axhline(data["slo_p99_s"], color="gray", linestyle=":", label="P99 SLO")
    ax.set_xlabel("offered load (QPS)")
    ax.set_ylabel("latency (s)")
    ax.set_yscale("log")
    kind = (data.get("service") or {}).get("kind", "?")
    ax.set_title(
        f"{data['workload']} (simulated, service: {kind}; cache {data['cache_tokens']:,} of "
        f"{data['working_set_tokens']:,} tokens)",
        fontsize=8,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_setup_args(p: argparse.ArgumentParser) -> None:
    """Service / scheduler-model options (shared with bench.sim_sweep and bench.sim_vs_gpu)."""
    p.add_argument(
        "--service",
        choices=("profile", "jct"),
        default="profile",
        help="service times from a measured profile (default) or the old JCT-model-based ones",
    )
    p.add_argument(
        "--profile",
        help=f"prefill profile JSON, or several separated by commas, their repeats pooled "
        f"(default: {DEFAULT_PROFILE.name})",
    )
    p.add_argument("--jct-profile", help="fit the scheduler's JCT model on this separate profile")
    p.add_argument(
        "--calibration",
        help="the scheduler's JCT model from this greenlane-jct file (with --service jct: also "
        "the service model, as before)",
    )
    p.add_argument(
        "--noise", type=float, help="--service jct only: log-normal sigma (default 0.05)"
    )
    p.add_argument(
        "--no-online-refit",
        action="store_true",
        help="the scheduler's JCT model does not learn from simulated forwards",
    )


def setup_from_args(args: argparse.Namespace) -> SimSetup:
    return build_setup(
        service=args.service,
        profile_path=args.profile,
        jct_profile_path=args.jct_profile,
        calibration_path=args.calibration,
        noise_sigma=args.noise,
        online_refit=not args.no_online_refit,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    p.add_argument("--policies", default="fcfs,spf,srjf,srjf-oneshot")
    p.add_argument("--qps", default="0.5,1,2,4", help="comma-separated offered loads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--scale", type=float, default=1.0, help="multiply all token lengths (0, 1]")
    add_setup_args(p)
    p.add_argument("--cache-tokens", type=int, help="KV pool (prefix cache) capacity in tokens")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.5,
        help="capacity as a fraction of the working set (when --cache-tokens unset)",
    )
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--prefill-token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    p.add_argument("--slo-p99", type=float, help=f"seconds (default {SLO_MULTIPLE:g}x cold JCT)")
    p.add_argument("--gamma", type=float, help="SPF aging, tokens per second of wait")
    p.add_argument("--fairness-lambda", type=float, help="SRJF offset, s of JCT per s of wait")
    p.add_argument("--no-search", action="store_true", help="skip the max-QPS-at-SLO search")
    p.add_argument(
        "--prime",
        action="store_true",
        help="each run starts from a primed cache (one request per user), not an empty one",
    )
    p.add_argument(
        "--eviction",
        choices=("lru", "queue-aware"),
        default="lru",
        help="lru: the engine's rule; queue-aware (a what-if): evict chains no waiting request "
        "would hit first",
    )
    add_plan_ahead_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    plan_lead_s, overlap_max_step_s = plan_ahead_from_args(p, args)
    try:
        setup = setup_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    data = run_experiment(
        args.workload,
        [s for s in args.policies.split(",") if s],
        [float(q) for q in args.qps.split(",") if q],
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        setup=setup,
        cache_tokens=args.cache_tokens,
        cache_fraction=args.cache_fraction,
        token_budget=args.prefill_token_budget,
        block_size=args.block_size,
        slo_p99_s=args.slo_p99,
        gamma=args.gamma,
        fairness_lambda=args.fairness_lambda,
        search=not args.no_search,
        prime=args.prime,
        queue_aware_eviction=args.eviction == "queue-aware",
        plan_ahead=args.plan_ahead,
        plan_lead_s=plan_lead_s,
        overlap_max_step_s=overlap_max_step_s,
    )
    data["command"] = "python -m bench.sim " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    if args.plot:
        plot(data, args.plot)
    print(
        f"{data['workload']}: SLO P99 {data['slo_p99_s']:.3g} s, cache "
        f"{data['cache_tokens']:,}/{data['working_set_tokens']:,} tokens, service "
        f"{data['service']['kind']}"
    )
    for r in data["results"]:
        print(
            f"  {r['policy']:>13} qps={r['qps']:<6g} mean={r['mean_latency_s']:8.3f}s "
            f"p99={r['p99_latency_s']:8.3f}s hit={r['cache_hit_token_fraction']:.2f}"
        )
    for name, q in data["max_qps_at_slo"].items():
        print(f"  max QPS at SLO  {name:>13}: {q:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
