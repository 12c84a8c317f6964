"""Synthetic scoring workloads for the scheduling simulator (seeded; DESIGN.md "Measuring").

Each request is a cacheable prefix (a user's profile or history, shared by all of that user's
requests) plus a unique suffix (the post or question; its KV is discarded after scoring, as
PrefillOnly's suffix discard does). Users are drawn uniformly. Arrivals are Poisson: unit-rate
exponential gaps drawn once per seed and divided by the QPS, so runs at different QPS see the
same requests in the same order (common random numbers make latency-vs-QPS curves smooth and
the max-QPS search well behaved).

`from_bench_requests` turns the HTTP benchmark's requests (`bench.workloads`) into simulator
requests, so the simulator can replay exactly what a GPU run sent (bench/sim_vs_gpu.py).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

WORKLOAD_NAMES = ("post-recommendation", "credit-verification", "short-scoring")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    num_users: int  # 0: no shared prefixes
    prefix_min_tokens: int
    prefix_max_tokens: int
    suffix_min_tokens: int
    suffix_max_tokens: int
    note: str


SPECS: dict[str, WorkloadSpec] = {
    # PrefillOnly: 20 users, 11k-17k-token profiles, 50 posts x 150 tokens per user.
    "post-recommendation": WorkloadSpec(
        "post-recommendation",
        20,
        11_000,
        17_000,
        150,
        150,
        "request = one of 20 user profiles (11k-17k tokens) + one 150-token post",
    ),
    # PrefillOnly: 60 users, 40k-60k-token histories. The 100-token question is our assumption.
    "credit-verification": WorkloadSpec(
        "credit-verification",
        60,
        40_000,
        60_000,
        100,
        100,
        "request = one of 60 credit histories (40k-60k tokens) + a 100-token question",
    ),
    # The reviewers' missing experiment: short prompts, nothing shared.
    "short-scoring": WorkloadSpec(
        "short-scoring",
        0,
        0,
        0,
        256,
        2048,
        "request = a unique prompt of 256-2,048 tokens (uniform), no shared prefix",
    ),
}

POSTS_PER_USER = 50  # post-recommendation: which post is drawn does not change its length


@dataclass(frozen=True, slots=True)
class SimRequestSpec:
    request_id: str
    arrival_unit_s: float  # arrival time at QPS 1; divide by the QPS
    prefix_key: str | None  # identity of the cacheable prefix (user), None if none
    prefix_tokens: int
    num_prompt_tokens: int
    # Identity of the suffix (a user's post): a repeated (user, post) pair finds the post's
    # blocks cached too. None: unique to this request.
    item_key: Hashable | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    requests: list[SimRequestSpec]
    prefix_tokens_by_user: dict[str, int]

    @property
    def working_set_tokens(self) -> int:
        """Tokens of all cacheable prefixes (what a cache must hold to never miss twice)."""
        return sum(self.prefix_tokens_by_user.values())

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(r.num_prompt_tokens for r in self.requests) / max(len(self.requests), 1)


def make_workload(name: str, num_requests: int, seed: int, scale: float = 1.0) -> Workload:
    """Draw `num_requests` requests of workload `name` (deterministic for `seed`).

    `scale` multiplies every token length (as `bench.serve --scale` does); the random draws are
    the same for every scale."""
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    if not 0 < scale <= 1.0:
        raise ValueError("scale must be in (0, 1]")
    spec = SPECS[name]

    def scaled(n: int) -> int:
        return max(1, round(n * scale))

    rng = random.Random(f"{name}:{seed}")
    users = {
        f"user{i}": scaled(rng.randint(spec.prefix_min_tokens, spec.prefix_max_tokens))
        for i in range(spec.num_users)
    }
    user_ids = list(users)
    t = 0.0
    reqs: list[SimRequestSpec] = []
    for i in range(num_requests):
        t += rng.expovariate(1.0)
        suffix = scaled(rng.randint(spec.suffix_min_tokens, spec.suffix_max_tokens))
        if user_ids:
            user = rng.choice(user_ids)
            post = rng.randrange(POSTS_PER_USER)  # which post: its blocks are cached too
            # Credit verification's question is per request (no repeats): item_key None.
            item = f"post{post}" if name == "post-recommendation" else None
            reqs.append(SimRequestSpec(f"r{i}", t, user, users[user], users[user] + suffix, item))
        else:
            reqs.append(SimRequestSpec(f"r{i}", t, None, 0, suffix))
    return Workload(spec, reqs, users)


def from_bench_requests(name: str, requests: Iterable[Any]) -> Workload:
    """A simulator workload replaying `bench.workloads.WorkloadRequest`s (scoring only).

    Prefix = the request's query (its user's profile, shared by `group`), item = the rest;
    identical items of one user share an `item_key`. Arrival times are not part of the bench
    requests: pass them to `bench.sim.simulate(arrivals_s=...)`."""
    if name not in SPECS:
        raise ValueError(f"no simulator spec for workload {name!r}")
    reqs: list[SimRequestSpec] = []
    users: dict[str, int] = {}
    for i, r in enumerate(requests):
        if r.api != "score":
            raise ValueError(f"request {r.request_id} is {r.api!r}; the simulator models scoring")
        if r.group:
            users[r.group] = len(r.query_token_ids)
            item = hash(tuple(r.item_token_ids))  # ints hash deterministically
            reqs.append(
                SimRequestSpec(
                    r.request_id,
                    float(i),
                    r.group,
                    len(r.query_token_ids),
                    r.num_prompt_tokens,
                    item,
                )
            )
        else:
            reqs.append(SimRequestSpec(r.request_id, float(i), None, 0, r.num_prompt_tokens))
    return Workload(SPECS[name], reqs, users)
