"""Discrete-event simulation of prefill scheduling on one GPU.

    python -m bench.sim --workload post-recommendation --policies fcfs,spf,srjf,srjf-oneshot \
        --qps 0.5,1,2,4 --seed 0 --out bench/results/sim-post.json --plot bench/results/sim-post.png

Model (docs/scheduling.md, "Simulator"):
* One GPU runs one forward at a time, non-preemptively. A forward takes waiting requests in
  policy order (lowest score first, ties by arrival) while their uncached tokens fit the token
  budget; a request larger than the budget runs alone (PrefillOnly's one-at-a-time regime for
  long prompts, batching for short ones).
* A forward's duration is the JCT model's batch prediction (the fallback default or
  `--calibration FILE`) times a seeded log-normal noise factor (`--noise`, sigma), so the
  policies' predictions are good but not exact.
* The prefix cache is an LRU over whole prefixes (a user's profile) with a finite token
  capacity; a request's prefix is inserted when its forward completes (its KV exists from
  then on) and looked up when its forward starts. The default capacity is half the workload's
  working set (`--cache-fraction 0.5`), i.e. smaller than the working set.
* The policies are the real `policies` objects, fed views that carry the cache hit *now*.

Deterministic for a seed: no wall clock, no unseeded randomness, ordered containers only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.sim_workloads import WORKLOAD_NAMES, Workload, make_workload
from policies import JCTModel, Policy, make_policy, prefill_work

SLO_MULTIPLE = 10.0  # default P99 SLO = 10x the predicted uncached JCT of a mean-length prompt
DEFAULT_TOKEN_BUDGET = 8192  # EngineConfig.prefill_token_budget's default


class LRUPrefixCache:
    """Whole-prefix LRU with a token capacity (a stand-in for the block-level prefix cache)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._entries: OrderedDict[str, int] = OrderedDict()

    def peek(self, key: str | None) -> int:
        """Cached tokens for `key` without touching recency (what a policy looks up)."""
        return self._entries.get(key, 0) if key is not None else 0

    def touch(self, key: str | None) -> int:
        """Cached tokens for `key`, marking it most recently used (a forward reads it)."""
        if key is None or key not in self._entries:
            return 0
        self._entries.move_to_end(key)
        return self._entries[key]

    def insert(self, key: str | None, num_tokens: int) -> None:
        if key is None or num_tokens <= 0 or num_tokens > self.capacity_tokens:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        while self.used_tokens + num_tokens > self.capacity_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.used_tokens -= evicted
        self._entries[key] = num_tokens
        self.used_tokens += num_tokens


@dataclass(slots=True)
class SimRequest:
    """A waiting request as the scheduler shows it to a policy (`WaitingView`)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    prefix_key: str | None
    prefix_tokens: int
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
    service_model: JCTModel,
    cache_tokens: int,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    noise_sigma: float = 0.05,
    seed: int = 0,
    fail_above_s: float | None = None,
) -> RunStats:
    """Run one (policy, QPS) point. With `fail_above_s`, stop as soon as more than 1% of the
    requests are certain to exceed that latency (used by the max-QPS search; the result is
    then marked `stopped_early` and its latencies are partial)."""
    noise_rng = random.Random(f"noise:{seed}")
    cache = LRUPrefixCache(cache_tokens)
    pending = [
        SimRequest(
            r.request_id,
            r.arrival_unit_s / qps,
            r.num_prompt_tokens,
            r.prefix_key,
            r.prefix_tokens,
            0,
            r.num_prompt_tokens,
        )
        for r in workload.requests
    ]
    n = len(pending)
    violation_limit = math.floor(0.01 * n)
    waiting: list[SimRequest] = []
    latencies: list[float] = []
    violations = 0
    hit_tokens = 0
    prompt_tokens = 0
    now = 0.0
    next_arrival = 0
    while len(latencies) < n:
        while next_arrival < n and pending[next_arrival].arrival_s <= now:
            waiting.append(pending[next_arrival])
            next_arrival += 1
        if not waiting:
            now = pending[next_arrival].arrival_s
            continue
        # One scheduling decision: refresh every cache hit (continuous calibration), score.
        for r in waiting:
            r.num_cached_tokens_now = min(cache.peek(r.prefix_key), r.num_prompt_tokens - 1)
        order = sorted(waiting, key=lambda r: (policy.score(r, now), r.arrival_s))
        batch: list[SimRequest] = []
        items: list[tuple[int, int]] = []
        used = 0
        for r in order:
            u, c = prefill_work(r)
            if batch and used + u > token_budget:
                break
            batch.append(r)
            items.append((u, c))
            used += u
            if used >= token_budget:
                break
        # The forward reads the cached prefixes (touch), runs, then inserts its prefixes.
        for r in batch:
            cache.touch(r.prefix_key)
        duration = service_model.predict_batch_s(items)
        if noise_sigma > 0:
            duration *= math.exp(noise_rng.gauss(0.0, noise_sigma))
        now += duration
        chosen = {id(r) for r in batch}
        waiting = [r for r in waiting if id(r) not in chosen]
        for r, (_u, c) in zip(batch, items, strict=True):
            cache.insert(r.prefix_key, r.prefix_tokens)
            latency = now - r.arrival_s
            latencies.append(latency)
            hit_tokens += c
            prompt_tokens += r.num_prompt_tokens
            if fail_above_s is not None and latency > fail_above_s:
                violations += 1
        if fail_above_s is not None:
            certain = violations + sum(1 for r in waiting if now - r.arrival_s > fail_above_s)
            if certain > violation_limit:
                return _stats(
                    policy.name,
                    qps,
                    latencies,
                    n,
                    hit_tokens,
                    prompt_tokens,
                    now,
                    stopped_early=True,
                )
    return _stats(policy.name, qps, latencies, n, hit_tokens, prompt_tokens, now)


def _stats(
    name: str,
    qps: float,
    latencies: list[float],
    n: int,
    hit: int,
    total: int,
    makespan_s: float,
    stopped_early: bool = False,
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
    common-random-number arrivals, up to noise); returns 0.0 if even `start_qps` fails.
    """

    def meets(qps: float) -> bool:
        st = run(qps, slo_p99_s)
        return not st.stopped_early and st.p99_latency_s <= slo_p99_s

    if not meets(start_qps):
        lo, hi = 0.0, start_qps
    else:
        lo, hi = start_qps, start_qps * 2
        while hi <= max_qps and meets(hi):
            lo, hi = hi, hi * 2
        if hi > max_qps:
            return lo
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def run_experiment(
    workload_name: str,
    policy_names: list[str],
    qps_list: list[float],
    *,
    seed: int = 0,
    num_requests: int = 1000,
    service_model: JCTModel | None = None,
    cache_tokens: int | None = None,
    cache_fraction: float = 0.5,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    noise_sigma: float = 0.05,
    slo_p99_s: float | None = None,
    gamma: float | None = None,
    fairness_lambda: float | None = None,
    search: bool = True,
) -> dict[str, object]:
    """Everything `python -m bench.sim` writes, as a JSON-ready dict."""
    model = service_model if service_model is not None else JCTModel()
    wl = make_workload(workload_name, num_requests, seed)
    if cache_tokens is None:
        cache_tokens = int(cache_fraction * wl.working_set_tokens)
    if slo_p99_s is None:
        slo_p99_s = SLO_MULTIPLE * model.predict_s(round(wl.mean_prompt_tokens), 0)

    def runner(name: str):
        def run(qps: float, fail_above_s: float | None = None) -> RunStats:
            # A fresh policy per run: srjf-oneshot's memory must not leak across runs.
            pol = make_policy(name, jct_model=model, gamma=gamma, fairness_lambda=fairness_lambda)
            return simulate(
                wl,
                pol,
                qps,
                service_model=model,
                cache_tokens=cache_tokens,
                token_budget=token_budget,
                noise_sigma=noise_sigma,
                seed=seed,
                fail_above_s=fail_above_s,
            )

        return run

    results = []
    max_qps: dict[str, float] = {}
    for name in policy_names:
        run = runner(name)
        for qps in qps_list:
            st = run(qps)
            row = {k: getattr(st, k) for k in st.__slots__ if k != "stopped_early"}
            results.append(row)
        if search:
            max_qps[name] = round(max_qps_at_slo(run, slo_p99_s), 4)
    return {
        "workload": workload_name,
        "workload_note": wl.spec.note,
        "seed": seed,
        "num_requests": num_requests,
        "working_set_tokens": wl.working_set_tokens,
        "cache_tokens": cache_tokens,
        "token_budget": token_budget,
        "noise_sigma": noise_sigma,
        "jct_model": {**model.coefficients, "source": model.source},
        "gamma_tokens_per_s": gamma,
        "fairness_lambda": fairness_lambda,
        "slo_p99_s": slo_p99_s,
        "results": results,
        "max_qps_at_slo": max_qps,
    }


def plot(data: dict[str, object], path: str) -> None:
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
    ax.set_title(
        f"{data['workload']} (simulated; cache {data['cache_tokens']:,} of "
        f"{data['working_set_tokens']:,} tokens)",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    p.add_argument("--policies", default="fcfs,spf,srjf,srjf-oneshot")
    p.add_argument("--qps", default="0.5,1,2,4", help="comma-separated offered loads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--calibration", help="JCT calibration file (default: the fallback model)")
    p.add_argument("--cache-tokens", type=int, help="prefix-cache capacity in tokens")
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.5,
        help="capacity as a fraction of the working set (when --cache-tokens unset)",
    )
    p.add_argument("--prefill-token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    p.add_argument("--noise", type=float, default=0.05, help="log-normal sigma of service time")
    p.add_argument("--slo-p99", type=float, help=f"seconds (default {SLO_MULTIPLE:g}x mean JCT)")
    p.add_argument("--gamma", type=float, help="SPF aging, tokens per second of wait")
    p.add_argument("--fairness-lambda", type=float, help="SRJF offset, s of JCT per s of wait")
    p.add_argument("--no-search", action="store_true", help="skip the max-QPS-at-SLO search")
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    model = JCTModel.load(args.calibration) if args.calibration else JCTModel()
    data = run_experiment(
        args.workload,
        [s for s in args.policies.split(",") if s],
        [float(q) for q in args.qps.split(",") if q],
        seed=args.seed,
        num_requests=args.num_requests,
        service_model=model,
        cache_tokens=args.cache_tokens,
        cache_fraction=args.cache_fraction,
        token_budget=args.prefill_token_budget,
        noise_sigma=args.noise,
        slo_p99_s=args.slo_p99,
        gamma=args.gamma,
        fairness_lambda=args.fairness_lambda,
        search=not args.no_search,
    )
    data["command"] = "python -m bench.sim " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    if args.plot:
        plot(data, args.plot)
    print(
        f"{data['workload']}: SLO P99 {data['slo_p99_s']:.3g} s, cache "
        f"{data['cache_tokens']:,}/{data['working_set_tokens']:,} tokens"
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
