"""The multi-replica simulator (bench/sim_cluster.py): workload scaling, determinism, and the
routers behaving as their rules say."""

from __future__ import annotations

import json

from bench import sim_cluster
from bench.sim_cluster import make_cluster_workload, simulate_cluster
from policies import JCTModel


def run(router: str, qps: float, num_replicas: int = 4, seed: int = 0):
    wl = make_cluster_workload(num_replicas, 60 * num_replicas, seed)
    cache = int(0.5 * wl.working_set_tokens / num_replicas)
    return simulate_cluster(
        wl, num_replicas, router, qps, service_model=JCTModel(), cache_tokens=cache, seed=seed
    )


def test_workload_scales_users_with_replicas() -> None:
    wl = make_cluster_workload(8, 500, seed=0)
    assert len(wl.prefix_tokens_by_user) == 8 * 20
    assert all(11_000 <= t <= 17_000 for t in wl.prefix_tokens_by_user.values())
    assert all(r.num_prompt_tokens == r.prefix_tokens + 150 for r in wl.requests)


def test_deterministic_for_a_seed() -> None:
    assert run("affinity", 4.0) == run("affinity", 4.0)
    assert run("power-of-two", 4.0) == run("power-of-two", 4.0)


def test_affinity_keeps_users_cached_and_round_robin_balances() -> None:
    aff, p2c, rr = (run(r, 4.0) for r in ("affinity", "power-of-two", "round-robin"))
    for r in (aff, p2c, rr):
        assert r.completed == r.num_requests
    # Each replica's cache holds half its share of users: affinity hits up to ~0.5, the
    # others, which send every user everywhere, far less.
    assert aff.cache_hit_token_fraction > 2 * p2c.cache_hit_token_fraction
    assert aff.cache_hit_token_fraction > 2 * rr.cache_hit_token_fraction
    assert rr.max_over_mean_requests < 1.05  # 240 requests, 4 replicas, in turn
    assert p2c.spill_fraction == 0 and rr.spill_fraction == 0


def test_experiment_json(tmp_path) -> None:
    out = tmp_path / "c.json"
    args = ["--replicas", "2", "--requests-per-replica", "40", "--seed", "3", "--out", str(out)]
    assert sim_cluster.main(args) == 0
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert set(res["max_qps_at_slo"]) == {"affinity", "power-of-two", "round-robin"}
    assert all(q > 0 for q in res["max_qps_at_slo"].values())
    assert {r["router"] for r in res["at_reference_qps"]} == set(res["max_qps_at_slo"])
    assert data["command"].startswith("python -m bench.sim_cluster")
