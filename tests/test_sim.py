"""The scheduling simulator: determinism, JSON shape, cache, batching, max-QPS search."""

from __future__ import annotations

import json

import pytest

from bench import sim
from bench.sim_workloads import make_workload
from policies import JCTModel, make_policy


def test_workloads_match_the_design() -> None:
    post = make_workload("post-recommendation", 300, seed=0)
    assert len(post.prefix_tokens_by_user) == 20
    assert all(11_000 <= t <= 17_000 for t in post.prefix_tokens_by_user.values())
    assert all(r.num_prompt_tokens == r.prefix_tokens + 150 for r in post.requests)
    credit = make_workload("credit-verification", 100, seed=0)
    assert len(credit.prefix_tokens_by_user) == 60
    assert all(40_000 <= t <= 60_000 for t in credit.prefix_tokens_by_user.values())
    short = make_workload("short-scoring", 300, seed=0)
    assert all(256 <= r.num_prompt_tokens <= 2048 and r.prefix_key is None for r in short.requests)
    arrivals = [r.arrival_unit_s for r in post.requests]
    assert arrivals == sorted(arrivals)
    assert 0.8 < len(arrivals) / arrivals[-1] < 1.2  # unit-rate Poisson
    with pytest.raises(ValueError):
        make_workload("nope", 1, 0)


def test_lru_prefix_cache() -> None:
    c = sim.LRUPrefixCache(30)
    c.insert("a", 10)
    c.insert("b", 10)
    c.insert("c", 10)
    assert c.touch("a") == 10  # a is now most recent; b is the LRU
    c.insert("d", 10)
    assert c.peek("b") == 0 and c.peek("a") == 10 and c.peek("d") == 10
    c.insert("huge", 31)  # larger than the cache: not cached, nothing evicted
    assert c.peek("huge") == 0 and c.used_tokens == 30


def test_default_cache_is_smaller_than_working_set() -> None:
    data = sim.run_experiment(
        "post-recommendation", ["fcfs"], [1.0], num_requests=100, search=False
    )
    assert data["cache_tokens"] < data["working_set_tokens"]


def test_simulator_is_deterministic_and_json_has_required_keys(tmp_path) -> None:
    args = [
        "--workload",
        "post-recommendation",
        "--policies",
        "fcfs,srjf,srjf-oneshot",
        "--qps",
        "1,3",
        "--seed",
        "7",
        "--num-requests",
        "200",
    ]
    out1, out2 = tmp_path / "a.json", tmp_path / "b.json"
    assert sim.main([*args, "--out", str(out1), "--plot", str(tmp_path / "a.png")]) == 0
    assert sim.main([*args, "--out", str(out2)]) == 0
    d1, d2 = json.loads(out1.read_text()), json.loads(out2.read_text())
    d1.pop("command"), d2.pop("command")
    assert d1 == d2
    assert (tmp_path / "a.png").stat().st_size > 0
    assert {"results", "slo_p99_s", "max_qps_at_slo"} <= set(d1)
    assert len(d1["results"]) == 6
    for row in d1["results"]:
        assert {"policy", "qps", "mean_latency_s", "p99_latency_s", "completed"} <= set(row)
        assert row["completed"] == 200
    assert set(d1["max_qps_at_slo"]) == {"fcfs", "srjf", "srjf-oneshot"}
    # Another seed draws other requests.
    assert sim.main([*args[:-3], "8", "--num-requests", "200", "--out", str(out2)]) == 0
    assert json.loads(out2.read_text())["results"] != d1["results"]


def test_max_qps_search_brackets_and_bisects() -> None:
    # A fake system whose P99 equals the QPS: with an SLO of 3 s the answer is 3 QPS.
    def run(qps: float, fail_above_s: float | None = None) -> sim.RunStats:
        return sim.RunStats("x", qps, 1, 1, qps, qps, qps, qps, qps, 0.0, 0.0)

    assert sim.max_qps_at_slo(run, 3.0) == pytest.approx(3.0, rel=0.02)
    assert sim.max_qps_at_slo(run, 0.01) == pytest.approx(0.01, rel=0.02)
    assert sim.max_qps_at_slo(run, 3.0) <= 3.0


def test_batching_packs_short_prompts_up_to_the_budget() -> None:
    wl = make_workload("short-scoring", 300, seed=1)
    model = JCTModel()
    kwargs = dict(service_model=model, cache_tokens=0, noise_sigma=0.0)
    batched = sim.simulate(wl, make_policy("fcfs"), 100.0, token_budget=8192, **kwargs)
    alone = sim.simulate(wl, make_policy("fcfs"), 100.0, token_budget=1, **kwargs)
    # Serving one at a time pays the per-forward floor for every request.
    floor_total = model.a_s * len(wl.requests)
    assert alone.makespan_s > batched.makespan_s
    assert alone.makespan_s - batched.makespan_s < floor_total


def test_srjf_raises_cache_hits_and_cuts_tail_on_post_recommendation() -> None:
    """The policy effect the docs report, at a small size: not a tuned threshold, a direction."""
    wl = make_workload("post-recommendation", 400, seed=0)
    cache = wl.working_set_tokens // 2
    runs = {
        name: sim.simulate(
            wl, make_policy(name), 4.0, service_model=JCTModel(), cache_tokens=cache, seed=0
        )
        for name in ("fcfs", "srjf")
    }
    assert runs["srjf"].cache_hit_token_fraction > runs["fcfs"].cache_hit_token_fraction
    assert runs["srjf"].p99_latency_s < runs["fcfs"].p99_latency_s
