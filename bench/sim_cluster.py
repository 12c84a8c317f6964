"""Discrete-event simulation of N Greenlane replicas behind a router (scoring workloads).

    python -m bench.sim_cluster --replicas 8,64 --routers affinity,power-of-two,round-robin \
        --seed 0 --out bench/results/sim-cluster-post.json

Each replica is the single-GPU model of `bench/sim.py` (imported, not changed): one forward at
a time, waiting requests in policy order (SRJF by default) batched under the token budget,
forward time = the JCT model's batch prediction times seeded log-normal noise, and a whole-prefix
LRU cache of finite capacity. On top of it:

* Workload: the paper's post recommendation scaled to the cluster: `users_per_replica` users
  (20, PrefillOnly's count for one GPU) per replica, profiles U[11k, 17k] tokens, one 150-token
  post per request, users drawn uniformly, Poisson arrivals (unit-rate gaps divided by QPS).
* Each replica's cache holds `cache_fraction` (0.5) of the working set of `users_per_replica`
  users: the single-GPU simulator's default capacity, per GPU.
* Routers see what the real one sees: each replica's count of requests not yet finished
  (waiting + in the running forward), exact at every decision.
  - `affinity`: `app.cluster.routing.choose` (the served rule) with the user as the key;
  - `power-of-two`: two random replicas, the one with fewer requests (Ray's default);
  - `round-robin`: replicas in turn.
* Reported per router: max QPS whose P99 latency meets the SLO (`bench.sim`'s search and SLO:
  10x the predicted uncached JCT of a mean-length prompt), prefix-cache hit rate (token
  fraction) and per-replica load balance (requests and busy time, max / mean) at a reference
  load (a fraction of the lowest router's max QPS, so every router is compared at one QPS).

Deterministic for a seed. The forward-time model is `bench.sim`'s; when that module's service
model changes, this simulator follows (it calls `JCTModel.predict_batch_s` the same way).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from app.cluster.routing import AffinityConfig, KeyHomes, ReplicaLoad, choose
from bench.sim import (
    DEFAULT_TOKEN_BUDGET,
    SLO_MULTIPLE,
    SimRequest,
    max_qps_at_slo,
    percentile,
)
from bench.sim_workloads import POSTS_PER_USER, SPECS, SimRequestSpec, Workload, WorkloadSpec
from policies import JCTModel, Policy, make_policy, prefill_work


class LRUPrefixCache:
    """Whole-prefix LRU with a token capacity per replica: the cluster simulator's cache model (a
    user's profile is cached whole or not at all). Coarser than bench/sim.py's block-level
    cache, which models one GPU's pool exactly; here what matters is which replica holds a
    user's profile."""

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


ROUTERS = ("affinity", "power-of-two", "round-robin")
USERS_PER_REPLICA = 20


def make_cluster_workload(
    num_replicas: int, num_requests: int, seed: int, users_per_replica: int = USERS_PER_REPLICA
) -> Workload:
    """Post recommendation with `users_per_replica * num_replicas` users (seeded)."""
    base = SPECS["post-recommendation"]
    num_users = users_per_replica * num_replicas
    spec = WorkloadSpec(
        base.name,
        num_users,
        base.prefix_min_tokens,
        base.prefix_max_tokens,
        base.suffix_min_tokens,
        base.suffix_max_tokens,
        f"request = one of {num_users} user profiles (11k-17k tokens) + one 150-token post "
        f"({users_per_replica} users per replica)",
    )
    rng = random.Random(f"cluster:{spec.name}:{num_users}:{seed}")
    users = {
        f"user{i}": rng.randint(spec.prefix_min_tokens, spec.prefix_max_tokens)
        for i in range(num_users)
    }
    user_ids = list(users)
    t = 0.0
    reqs: list[SimRequestSpec] = []
    for i in range(num_requests):
        t += rng.expovariate(1.0)
        suffix = rng.randint(spec.suffix_min_tokens, spec.suffix_max_tokens)
        user = rng.choice(user_ids)
        rng.randrange(POSTS_PER_USER)
        reqs.append(SimRequestSpec(f"r{i}", t, user, users[user], users[user] + suffix))
    return Workload(spec, reqs, users)


@dataclass(slots=True)
class Replica:
    name: str
    policy: Policy
    cache: LRUPrefixCache
    noise: random.Random
    waiting: list[SimRequest] = field(default_factory=list)
    running: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, cached)
    busy_s: float = 0.0
    num_served: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)


@dataclass(slots=True)
class ClusterRun:
    router: str
    qps: float
    completed: int
    num_requests: int
    p50_latency_s: float
    p99_latency_s: float
    cache_hit_token_fraction: float
    max_over_mean_requests: float
    max_over_mean_busy: float
    spill_fraction: float
    stopped_early: bool = False


class Router:
    """The three routing rules, fed the replicas' request counts."""

    def __init__(
        self, name: str, affinity: AffinityConfig, seed: int, two_choice_homes: bool = False
    ) -> None:
        if name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}")
        self.homes = KeyHomes() if two_choice_homes else None
        self.name, self.affinity = name, affinity
        self.rng = random.Random(f"router:{name}:{seed}")
        self.next_rr = 0
        self.num_spill = self.num_routed = 0

    def pick(self, key: str | None, replicas: list[Replica]) -> Replica:
        self.num_routed += 1
        if self.name == "round-robin":
            r = replicas[self.next_rr % len(replicas)]
            self.next_rr += 1
            return r
        by_name = {r.name: r for r in replicas}
        loads = {r.name: ReplicaLoad(queue=r.num_requests) for r in replicas}
        affine = self.name == "affinity"
        choice = choose(key if affine else None, loads, self.affinity, self.rng, self.homes)
        if choice.reason == "spill":
            self.num_spill += 1
        # Ray tries the first rank; within it, the replica with the fewest requests.
        rank = choice.ranks[0]
        least = min(by_name[n].num_requests for n in rank)
        best = [n for n in rank if by_name[n].num_requests == least]
        return by_name[best[0] if len(best) == 1 else self.rng.choice(best)]


def simulate_cluster(
    workload: Workload,
    num_replicas: int,
    router_name: str,
    qps: float,
    *,
    service_model: JCTModel,
    cache_tokens: int,
    policy_name: str = "srjf",
    affinity: AffinityConfig | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    noise_sigma: float = 0.05,
    seed: int = 0,
    fail_above_s: float | None = None,
    two_choice_homes: bool = False,
) -> ClusterRun:
    """One (router, QPS) point; `fail_above_s` stops early once >1% are certain to miss it."""
    router = Router(router_name, affinity or AffinityConfig(), seed, two_choice_homes)
    replicas = [
        Replica(
            f"r{i:03d}",
            make_policy(policy_name, jct_model=service_model),
            LRUPrefixCache(cache_tokens),
            random.Random(f"noise:{seed}:{i}"),
        )
        for i in range(num_replicas)
    ]
    arrivals = [
        SimRequest(
            r.request_id,
            r.arrival_unit_s / qps,
            r.num_prompt_tokens,
            r.prefix_key,
            r.prefix_tokens,
            num_cached_tokens_now=0,
            remaining_prompt_tokens=r.num_prompt_tokens,
        )
        for r in workload.requests
    ]
    n = len(arrivals)
    violation_limit = math.floor(0.01 * n)
    events: list[tuple[float, int, int]] = []  # (time, seq, replica index): forward completions
    seq = 0
    latencies: list[float] = []
    violations = hit_tokens = prompt_tokens = 0

    def start_forward(i: int, now: float) -> None:
        nonlocal seq
        rep = replicas[i]
        for r in rep.waiting:
            r.num_cached_tokens_now = min(rep.cache.peek(r.prefix_key), r.num_prompt_tokens - 1)
        order = sorted(rep.waiting, key=lambda r: (rep.policy.score(r, now), r.arrival_s))
        batch: list[tuple[SimRequest, int]] = []
        items: list[tuple[int, int]] = []
        used = 0
        for r in order:
            u, c = prefill_work(r)
            if batch and used + u > token_budget:
                break
            batch.append((r, c))
            items.append((u, c))
            used += u
            if used >= token_budget:
                break
        for r, _ in batch:
            rep.cache.touch(r.prefix_key)
        duration = service_model.predict_batch_s(items)
        if noise_sigma > 0:
            duration *= math.exp(rep.noise.gauss(0.0, noise_sigma))
        chosen = {id(r) for r, _ in batch}
        rep.waiting = [r for r in rep.waiting if id(r) not in chosen]
        rep.running = batch
        rep.busy_s += duration
        heapq.heappush(events, (now + duration, seq, i))
        seq += 1

    next_arrival = 0
    now = 0.0
    while len(latencies) < n:
        # The next event: an arrival, or a forward completing (completions first on ties).
        t_arrival = arrivals[next_arrival].arrival_s if next_arrival < n else math.inf
        if events and events[0][0] <= t_arrival:
            now, _, i = heapq.heappop(events)
            rep = replicas[i]
            for r, c in rep.running:
                rep.cache.insert(r.prefix_key, r.prefix_tokens)
                latency = now - r.arrival_s
                latencies.append(latency)
                hit_tokens += c
                prompt_tokens += r.num_prompt_tokens
                rep.num_served += 1
                if fail_above_s is not None and latency > fail_above_s:
                    violations += 1
            rep.running = []
            if rep.waiting:
                start_forward(i, now)
            if fail_above_s is not None:
                certain = violations + sum(
                    1 for p in replicas for r in p.waiting if now - r.arrival_s > fail_above_s
                )
                if certain > violation_limit:
                    return _run(
                        router, qps, latencies, n, hit_tokens, prompt_tokens, replicas, True
                    )
            continue
        now = t_arrival
        req = arrivals[next_arrival]
        next_arrival += 1
        rep = router.pick(req.prefix_key, replicas)
        rep.waiting.append(req)
        if not rep.running:
            start_forward(replicas.index(rep), now)
    return _run(router, qps, latencies, n, hit_tokens, prompt_tokens, replicas, False)


def _run(
    router: Router,
    qps: float,
    latencies: list[float],
    n: int,
    hit: int,
    total: int,
    replicas: list[Replica],
    stopped_early: bool,
) -> ClusterRun:
    lat = sorted(latencies)
    served = [r.num_served for r in replicas]
    busy = [r.busy_s for r in replicas]

    def max_over_mean(xs: list[float] | list[int]) -> float:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean > 0 else math.nan

    return ClusterRun(
        router=router.name,
        qps=qps,
        completed=len(lat),
        num_requests=n,
        p50_latency_s=percentile(lat, 50),
        p99_latency_s=percentile(lat, 99),
        cache_hit_token_fraction=hit / total if total else 0.0,
        max_over_mean_requests=max_over_mean(served),
        max_over_mean_busy=max_over_mean(busy),
        spill_fraction=router.num_spill / max(router.num_routed, 1),
        stopped_early=stopped_early,
    )


def run_experiment(
    replica_counts: list[int],
    router_names: list[str],
    *,
    seed: int = 0,
    requests_per_replica: int = 150,
    users_per_replica: int = USERS_PER_REPLICA,
    cache_fraction: float = 0.5,
    policy_name: str = "srjf",
    affinity: AffinityConfig | None = None,
    service_model: JCTModel | None = None,
    noise_sigma: float = 0.05,
    reference_load: float = 0.8,
    two_choice_homes: bool = True,
) -> dict[str, object]:
    """Everything `python -m bench.sim_cluster` writes, as a JSON-ready dict."""
    model = service_model if service_model is not None else JCTModel()
    affinity = affinity or AffinityConfig()
    out: list[dict[str, object]] = []
    for num_replicas in replica_counts:
        wl = make_cluster_workload(
            num_replicas, requests_per_replica * num_replicas, seed, users_per_replica
        )
        per_gpu_working_set = wl.working_set_tokens / num_replicas
        cache_tokens = int(cache_fraction * per_gpu_working_set)
        slo_p99_s = SLO_MULTIPLE * model.predict_s(round(wl.mean_prompt_tokens), 0)

        def runner(
            name: str,
            wl: Workload = wl,
            num_replicas: int = num_replicas,
            cache_tokens: int = cache_tokens,
        ) -> Callable[[float, float | None], ClusterRun]:
            def run(qps: float, fail_above_s: float | None = None) -> ClusterRun:
                return simulate_cluster(
                    wl,
                    num_replicas,
                    name,
                    qps,
                    service_model=model,
                    cache_tokens=cache_tokens,
                    policy_name=policy_name,
                    affinity=affinity,
                    noise_sigma=noise_sigma,
                    seed=seed,
                    fail_above_s=fail_above_s,
                    two_choice_homes=two_choice_homes,
                )

            return run

        max_qps = {
            name: round(max_qps_at_slo(runner(name), slo_p99_s, start_qps=0.125 * num_replicas), 4)
            for name in router_names
        }
        ref_qps = reference_load * min(q for q in max_qps.values() if q > 0)
        at_ref = [runner(name)(ref_qps) for name in router_names]
        out.append(
            {
                "num_replicas": num_replicas,
                "num_users": wl.spec.num_users,
                "num_requests": len(wl.requests),
                "workload_note": wl.spec.note,
                "cache_tokens_per_replica": cache_tokens,
                "working_set_tokens_per_replica": round(per_gpu_working_set),
                "slo_p99_s": slo_p99_s,
                "max_qps_at_slo": max_qps,
                "reference_qps": ref_qps,
                "at_reference_qps": [
                    {k: getattr(r, k) for k in r.__slots__ if k != "stopped_early"} for r in at_ref
                ],
            }
        )
    return {
        "tool": "greenlane bench.sim_cluster",
        "seed": seed,
        "policy": policy_name,
        "affinity": {
            "max_queue_gap": affinity.max_queue_gap,
            "max_backlog_gap_s": affinity.max_backlog_gap_s,
            "spill": affinity.spill,
            "two_choice_homes": two_choice_homes,
            "note": "backlog is not simulated (the engine does not report it yet): queue only",
        },
        "cache_fraction": cache_fraction,
        "users_per_replica": users_per_replica,
        "noise_sigma": noise_sigma,
        "reference_load": reference_load,
        "jct_model": {**model.coefficients, "source": model.source},
        "results": out,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_cluster", description=__doc__.split("\n")[0]
    )
    p.add_argument("--replicas", default="8,64", help="comma-separated replica counts")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests-per-replica", type=int, default=150)
    p.add_argument("--users-per-replica", type=int, default=USERS_PER_REPLICA)
    p.add_argument("--cache-fraction", type=float, default=0.5)
    p.add_argument("--policy", default="srjf")
    p.add_argument("--max-queue-gap", type=int, default=AffinityConfig().max_queue_gap)
    p.add_argument("--spill", default=AffinityConfig().spill)
    p.add_argument(
        "--rendezvous-homes",
        action="store_true",
        help="place homes by rendezvous hashing alone (default: two-choice placement)",
    )
    p.add_argument("--calibration", help="JCT calibration file (default: the fallback model)")
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--reference-load", type=float, default=0.8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model = JCTModel.load(args.calibration) if args.calibration else JCTModel()
    data = run_experiment(
        [int(x) for x in args.replicas.split(",") if x],
        [r for r in args.routers.split(",") if r],
        seed=args.seed,
        requests_per_replica=args.requests_per_replica,
        users_per_replica=args.users_per_replica,
        cache_fraction=args.cache_fraction,
        policy_name=args.policy,
        affinity=AffinityConfig(
            max_queue_gap=args.max_queue_gap, max_backlog_gap_s=None, spill=args.spill
        ),
        service_model=model,
        noise_sigma=args.noise,
        reference_load=args.reference_load,
        two_choice_homes=not args.rendezvous_homes,
    )
    data["command"] = "python -m bench.sim_cluster " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    from bench.serve import git_revision, machine_info

    data["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    data["git"] = git_revision()
    data["machine"] = machine_info()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    for res in data["results"]:
        print(
            f"{res['num_replicas']} replicas, {res['num_users']} users, SLO P99 "
            f"{res['slo_p99_s']:.3g} s, cache {res['cache_tokens_per_replica']:,} of "
            f"{res['working_set_tokens_per_replica']:,} tokens per replica"
        )
        for name, q in res["max_qps_at_slo"].items():
            print(f"  max QPS at SLO {name:>13}: {q:g}")
        for r in res["at_reference_qps"]:
            print(
                f"  at {res['reference_qps']:.3g} QPS {r['router']:>13}: hit "
                f"{r['cache_hit_token_fraction']:.2f} p99 {r['p99_latency_s']:.3g}s "
                f"max/mean requests {r['max_over_mean_requests']:.2f} busy "
                f"{r['max_over_mean_busy']:.2f} spills {r['spill_fraction']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
