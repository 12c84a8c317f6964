"""The scheduling simulator: determinism, JSON shape, the engine-like cache, batching, the
max-QPS search, and service times independent of the scheduler's JCT model."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from bench import sim
from bench.sim_profile import JCTService, PrefillProfile, ProfilePoint, ProfileService
from bench.sim_workloads import SimRequestSpec, make_workload
from policies import JCTModel, make_policy


def test_workloads_match_the_design() -> None:
    post = make_workload("post-recommendation", 300, seed=0)
    assert len(post.prefix_tokens_by_user) == 20
    assert all(11_000 <= t <= 17_000 for t in post.prefix_tokens_by_user.values())
    assert all(r.num_prompt_tokens == r.prefix_tokens + 150 for r in post.requests)
    assert {r.item_key for r in post.requests} <= {f"post{i}" for i in range(50)}
    credit = make_workload("credit-verification", 100, seed=0)
    assert len(credit.prefix_tokens_by_user) == 60
    assert all(40_000 <= t <= 60_000 for t in credit.prefix_tokens_by_user.values())
    assert all(r.item_key is None for r in credit.requests)  # one question per request
    short = make_workload("short-scoring", 300, seed=0)
    assert all(256 <= r.num_prompt_tokens <= 2048 and r.prefix_key is None for r in short.requests)
    arrivals = [r.arrival_unit_s for r in post.requests]
    assert arrivals == sorted(arrivals)
    assert 0.8 < len(arrivals) / arrivals[-1] < 1.2  # unit-rate Poisson
    with pytest.raises(ValueError):
        make_workload("nope", 1, 0)
    # Scale multiplies lengths; the draws (users, order, arrivals) stay the same.
    half = make_workload("post-recommendation", 300, seed=0, scale=0.5)
    assert [r.prefix_key for r in half.requests] == [r.prefix_key for r in post.requests]
    assert [r.arrival_unit_s for r in half.requests] == arrivals
    for a, b in zip(half.requests, post.requests, strict=True):
        assert a.prefix_tokens == round(b.prefix_tokens * 0.5)
        assert a.num_prompt_tokens == a.prefix_tokens + 75


def _req(rid: str, user: str | None, prefix: int, total: int, item=None) -> sim.SimRequest:
    return sim.SimRequest(rid, 0.0, total, user, prefix, item, 0, total)


def _forward(cache: sim.BlockPrefixCache, *reqs: sim.SimRequest) -> list[int]:
    hits = cache.admit(list(reqs))
    cache.release()
    return hits


def test_block_cache_keeps_whole_prompts_and_evicts_tails_first() -> None:
    c = sim.BlockPrefixCache(capacity_tokens=160, block_size=16)  # 10 blocks
    a1 = _req("a1", "a", 96, 136, "p1")  # 6 prefix blocks + 2 post blocks (136 // 16 = 8)
    assert _forward(c, a1) == [0]
    assert c.idle_blocks == 8
    # The same user with another post: the profile hits, the post does not.
    a2 = _req("a2", "a", 96, 136, "p2")
    assert c.peek(a2) == 96
    # The same post again: profile + post blocks hit, capped below the whole prompt.
    a1b = _req("a1b", "a", 96, 136, "p1")
    assert c.peek(a1b) == 128
    # User b needs 5 blocks (4 + 1): 3 must go. a's post blocks (released first, so older) go
    # first, then one block of a's profile, from its tail.
    b = _req("b1", "b", 64, 84, "q")
    assert _forward(c, b) == [0]
    assert c.idle_blocks <= c.capacity_blocks == 10
    assert c.peek(a1b) == 80  # 5 of a's 6 profile blocks are left; the post chain is gone
    assert c.peek(a2) == 80
    assert c.peek(_req("b2", "b", 64, 84, "q")) == 80  # prefix 4 + post 1 = 5 blocks
    # A hit moves the chain to most recently used: after a runs again, b is evicted first.
    assert _forward(c, a2)[0] == 80
    big = _req("c1", "c", 80, 90)  # 5 blocks
    _forward(c, big)
    assert c.peek(_req("b3", "b", 64, 84, "x")) < 64
    assert c.peek(a2) >= 80
    c.reset()
    assert c.idle_blocks == 0 and c.peek(a2) == 0


def test_queue_aware_eviction_spares_the_chains_waiting_requests_would_hit() -> None:
    """The what-if `queue_aware` cache evicts least recently used chains that no waiting
    request would hit before any chain a waiting request would; LRU takes the oldest."""

    def run(queue_aware: bool) -> sim.BlockPrefixCache:
        c = sim.BlockPrefixCache(16 * 10, 16, queue_aware=queue_aware)  # 10 blocks
        _forward(c, _req("a1", "a", 64, 64))  # a: 4 blocks, least recently used
        _forward(c, _req("b1", "b", 64, 64))  # b: 4 blocks
        # c needs 4 blocks: 2 must go. a's next request is waiting; b's is not.
        c.admit([_req("c1", "c", 64, 64)], waiting=[_req("a2", "a", 64, 80, "x")])
        c.release()
        return c

    lru, aware = run(False), run(True)
    a2, b2 = _req("a2", "a", 64, 80, "x"), _req("b2", "b", 64, 80, "y")
    assert (lru.peek(a2), lru.peek(b2)) == (32, 64)  # LRU cut a's chain, the one needed next
    assert (aware.peek(a2), aware.peek(b2)) == (64, 32)  # queue-aware cut b's instead
    assert aware.idle_blocks <= aware.capacity_blocks


def test_block_cache_batch_shares_pinned_prefix_and_respects_capacity() -> None:
    c = sim.BlockPrefixCache(capacity_tokens=16 * 20, block_size=16)
    _forward(c, _req("a0", "a", 160, 170))  # 10 prefix blocks cached
    # Two requests of a in one forward both hit the pinned prefix.
    hits = _forward(c, _req("a1", "a", 160, 200, "x"), _req("a2", "a", 160, 200, "y"))
    assert hits == [160, 160]
    assert c.idle_blocks <= 20
    # A request larger than the pool still runs; it keeps only what fits.
    huge = _req("h", "h", 16 * 50, 16 * 51)
    assert _forward(c, huge) == [0]
    assert c.idle_blocks == 20 and c.peek(_req("h2", "h", 16 * 50, 16 * 51)) == 16 * 20
    # No prefix: nothing is ever hit again, and the pool stays within capacity.
    assert _forward(c, _req("s", None, 0, 500)) == [0]
    assert c.peek(_req("s", None, 0, 500)) == 0 or c.idle_blocks <= 20


def _tiny_profile(batch_point: bool = False) -> PrefillProfile:
    pts = [
        ProfilePoint(100, 0, (0.010, 0.011, 0.009)),
        ProfilePoint(1000, 0, (0.100, 0.104, 0.096)),
        ProfilePoint(10000, 0, (2.0,)),
        ProfilePoint(100, 10000, (0.020,)),
        ProfilePoint(1000, 10000, (0.200,)),
    ]
    if batch_point:
        pts.append(ProfilePoint(100, 10000, (0.050,), batch=4))
    return PrefillProfile(pts, device="test", model="test")


def test_profile_service_interpolates_the_measurements() -> None:
    s = ProfileService(_tiny_profile())
    assert s.median_s(100, 0) == pytest.approx(0.010)
    assert s.median_s(1000, 10000) == pytest.approx(0.200)
    assert s.median_s(550, 0) == pytest.approx(0.055)  # linear between measured points
    assert s.median_s(10, 0) == pytest.approx(0.010)  # flat below: a forward costs its floor
    # ... its attention to a cached prefix too (a tile of query rows per head, however few)
    assert s.median_s(10, 10000) == pytest.approx(s.median_s(100, 10000))
    assert s.median_s(20000, 0) == pytest.approx(2.0 * 2 ** (1.30103), rel=1e-3)  # power law
    assert s.median_s(100, 5000) == pytest.approx(0.015)  # linear in the cached length
    assert s.in_range(500, 5000) and not s.in_range(20000, 0)
    # Attention per pair read off the cached levels: (0.020 - 0.010) / (100 * 10000) and
    # (0.200 - 0.100) / (1000 * 10000): 1e-8 both.
    assert s.k_s_per_pair == pytest.approx(1e-8)
    # A batch: token-wise work of all new tokens together + each member's own attention.
    tw = lambda u: s.median_s(u, 0) - 1e-8 * u * u / 2  # noqa: E731
    assert s.median_forward_s([(100, 10000)] * 4) == pytest.approx(tw(400) + 4 * (0.020 - tw(100)))
    # Noise: ratios of the nearest point's measured repeats to its median, nothing invented.
    rng = random.Random(0)
    assert {round(s.noise_ratio(120, 0, rng), 6) for _ in range(200)} == {0.9, 1.0, 1.1}
    assert {round(s.noise_ratio(1000, 0, rng), 6) for _ in range(200)} == {0.96, 1.0, 1.04}
    # A measured batch point corrects the batch rule by measured / rule.
    sb = ProfileService(_tiny_profile(batch_point=True))
    rule = s.median_forward_s([(100, 10000)] * 4)
    assert sb.batch_correction == pytest.approx(0.050 / rule)
    assert sb.median_forward_s([(100, 10000)] * 4) == pytest.approx(0.050)
    assert sb.median_s(100, 0) == s.median_s(100, 0)  # single forwards are not corrected


def test_profile_format_round_trip_and_validation(tmp_path) -> None:
    prof = _tiny_profile(batch_point=True)
    path = tmp_path / "p.json"
    prof.save(path)
    back = PrefillProfile.load(path)
    assert back.points == prof.points and back.device == "test"
    data = json.loads(path.read_text())
    for bad in (
        {**data, "format": "nope"},
        {**data, "points": [{"uncached": 10, "cached": 0, "seconds": [-1.0]}]},
        {**data, "points": [{"uncached": 10, "seconds": [1.0]}]},
        {**data, "points": data["points"][:1]},  # one point: nothing to interpolate
    ):
        with pytest.raises(ValueError):
            PrefillProfile.from_dict(bad)


def test_profiles_pool_their_repeats_point_by_point(tmp_path) -> None:
    """Two profiles of one model and device, loaded as "a.json,b.json": each point's repeats
    are both files' (in file order); a point one file lacks is kept; the service's median
    moves to the pooled one; another model is refused."""
    a = _tiny_profile()
    b = PrefillProfile(
        [
            ProfilePoint(100, 0, (0.012, 0.013)),
            ProfilePoint(1000, 0, (0.110,)),
            ProfilePoint(100, 10000, (0.030, 0.028)),
        ],
        device="test",
        model="test",
    )
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    pooled = PrefillProfile.load(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}")
    by = {(p.uncached, p.cached, p.batch): p.seconds for p in pooled.points}
    assert by[(100, 0, 1)] == (0.010, 0.011, 0.009, 0.012, 0.013)
    assert by[(100, 10000, 1)] == (0.020, 0.030, 0.028)
    assert by[(10000, 0, 1)] == (2.0,) and len(by) == 5
    assert ProfileService(pooled).median_s(100, 10000) == pytest.approx(0.028)
    assert pooled.provenance["paths"] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    other = PrefillProfile(list(b.points), device="test", model="another")
    with pytest.raises(ValueError, match="another"):
        PrefillProfile.pooled([a, other])


def test_split_halves_are_disjoint_repeats() -> None:
    calib, service = _tiny_profile().split_repeats()
    assert calib.points[0].seconds == (0.010, 0.009) and service.points[0].seconds == (0.011,)
    assert calib.points[2].seconds == service.points[2].seconds == (2.0,)  # single: both halves


def test_service_times_do_not_depend_on_the_scheduler_model() -> None:
    """FCFS never asks the JCT model: with the profile service, a wildly wrong scheduler model
    changes nothing; with the old JCT service it changes the service times themselves."""
    wl = make_workload("post-recommendation", 200, seed=0)
    cache = wl.working_set_tokens // 2
    honest = sim.build_setup()
    wrong = JCTModel(1.0, 1e-3, 0.0)

    def run(service, jct: JCTModel) -> sim.RunStats:
        pol = make_policy("fcfs", jct_model=jct)
        return sim.simulate(
            wl, pol, 4.0, service=service, cache_tokens=cache, seed=0, jct_model=jct
        )

    def latencies(st: sim.RunStats) -> tuple:
        return (st.mean_latency_s, st.p99_latency_s, st.max_latency_s, st.makespan_s)

    good = run(honest.service, honest.new_jct())
    assert latencies(good) == latencies(run(honest.service, JCTModel(1.0, 1e-3, 0.0)))
    old = latencies(run(JCTService(JCTModel()), JCTModel()))
    assert old != latencies(run(JCTService(wrong), wrong))
    # The scheduler's model is fitted on other repeats than the service draws from, and the
    # online refinement observes the simulated forwards (an error is measured, not assumed).
    st = run(honest.service, honest.new_jct())
    assert st.jct_mape is not None and st.jct_mape > 0


def test_simulator_is_deterministic_and_json_has_required_keys(tmp_path) -> None:
    args = [
        "--workload",
        "post-recommendation",
        "--policies",
        "fcfs,srjf,srjf-oneshot",
        "--qps",
        "2,6",
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
    assert {"results", "slo_p99_s", "max_qps_at_slo", "service", "scheduler_jct"} <= set(d1)
    assert d1["service"]["kind"] == "profile" and d1["service"]["origin"] == "measured"
    assert "calibration half" in d1["scheduler_jct"]["how"]
    assert len(d1["results"]) == 6
    for row in d1["results"]:
        assert {"policy", "qps", "mean_latency_s", "p99_latency_s", "completed"} <= set(row)
        # At least 200 requests, more when 200 arrive within 10 SLOs (finite runs flatter).
        span = d1["min_span_slos"] * d1["slo_p99_s"]
        assert row["completed"] == max(200, math.ceil(row["qps"] * span))
    assert d1["results"][0]["completed"] == 200 and d1["results"][1]["completed"] > 200
    assert set(d1["burst_capacity_qps"]) == set(d1["max_qps_at_slo"])
    for name, q in d1["max_qps_at_slo"].items():
        assert q <= d1["burst_capacity_qps"][name]  # no search beyond what a burst sustains
    assert set(d1["max_qps_at_slo"]) == {"fcfs", "srjf", "srjf-oneshot"}
    # Another seed draws other requests.
    assert sim.main([*args[:-3], "8", "--num-requests", "200", "--out", str(out2)]) == 0
    assert json.loads(out2.read_text())["results"] != d1["results"]
    # A parameter that would be ignored is refused.
    with pytest.raises(SystemExit):
        sim.main([*args, "--noise", "0.1", "--out", str(out2)])


def test_max_qps_search_brackets_and_bisects() -> None:
    # A fake system whose P99 equals the QPS: with an SLO of 3 s the answer is 3 QPS.
    def run(qps: float, fail_above_s: float | None = None) -> sim.RunStats:
        return sim.RunStats("x", qps, 1, 1, qps, qps, qps, qps, qps, 0.0, 0.0)

    assert sim.max_qps_at_slo(run, 3.0) == pytest.approx(3.0, rel=0.02)
    assert sim.max_qps_at_slo(run, 0.01) == pytest.approx(0.01, rel=0.02)
    assert sim.max_qps_at_slo(run, 3.0) <= 3.0
    # A cap (the burst capacity) ends the doubling: a system that always passes gets the cap.
    assert sim.max_qps_at_slo(run, 1e9, max_qps=5.0) == 5.0
    assert sim.max_qps_at_slo(run, 3.0, max_qps=2.5) == 2.5


def test_batching_packs_short_prompts_up_to_the_budget() -> None:
    wl = make_workload("short-scoring", 300, seed=1)
    model = JCTModel()
    old = JCTService(model, noise_sigma=0.0)
    kwargs = dict(cache_tokens=0)
    batched = sim.simulate(wl, make_policy("fcfs"), 100.0, service=old, token_budget=8192, **kwargs)
    alone = sim.simulate(wl, make_policy("fcfs"), 100.0, service=old, token_budget=1, **kwargs)
    # With the JCT service, serving one at a time pays only the per-forward floor per request.
    assert 0 < alone.makespan_s - batched.makespan_s < model.a_s * len(wl.requests)
    # With the profile, batching amortises small forwards that cost their floor (the measured
    # H200 profile: ~8.5-9 ms for any forward of 64-150 tokens).
    prof = sim.build_setup().service
    small = [SimRequestSpec(f"r{i}", i / 1000, None, 0, 100) for i in range(200)]
    swl = sim.Workload(wl.spec, small, {})
    b = sim.simulate(swl, make_policy("fcfs"), 1.0, service=prof, token_budget=8192, **kwargs)
    a = sim.simulate(swl, make_policy("fcfs"), 1.0, service=prof, token_budget=1, **kwargs)
    assert a.makespan_s > 2 * b.makespan_s
    # The run reports the simulated GPU's work: one request a forward alone, 200 in few
    # forwards batched, and the summed forward seconds never exceed the run's span.
    assert a.num_forwards == 200 and a.max_batch == 1
    assert b.num_forwards < 20 and b.max_batch > 10
    assert b.num_forwards * b.max_batch >= 200
    for run in (a, b):
        assert 0 < run.busy_s <= run.makespan_s + 1e-9


def test_explicit_arrivals_and_a_carried_cache() -> None:
    reqs = [SimRequestSpec(f"r{i}", float(i), "u", 1000, 1150, "p") for i in range(3)]
    wl = sim.Workload(make_workload("post-recommendation", 1, 0).spec, reqs, {"u": 1000})
    svc = sim.build_setup().service
    cache = sim.BlockPrefixCache(10_000)
    st = sim.simulate(
        wl, make_policy("fcfs"), 1.0, service=svc, cache=cache, arrivals_s=[0.0, 5.0, 10.0]
    )
    assert st.completed == 3 and st.makespan_s > 10.0
    assert st.cache_hit_token_fraction == pytest.approx(2 * 1136 / (3 * 1150))
    # The same cache, carried into another run: every request hits from the start.
    again = sim.simulate(
        wl, make_policy("fcfs"), 1.0, service=svc, cache=cache, arrivals_s=[0.0, 5.0, 10.0]
    )
    assert again.cache_hit_token_fraction == pytest.approx(1136 / 1150)
    with pytest.raises(ValueError):
        sim.simulate(wl, make_policy("fcfs"), 1.0, service=svc, cache=cache, arrivals_s=[0.0])


def test_srjf_raises_cache_hits_and_cuts_tail_on_post_recommendation() -> None:
    """The policy effect the docs report, at a small size: not a tuned threshold, a direction."""
    wl = make_workload("post-recommendation", 400, seed=0)
    cache = wl.working_set_tokens // 2
    setup = sim.build_setup()
    runs = {}
    for name in ("fcfs", "srjf"):
        jct = setup.new_jct()
        runs[name] = sim.simulate(
            wl,
            make_policy(name, jct_model=jct),
            7.0,
            service=setup.service,
            cache_tokens=cache,
            seed=0,
            jct_model=jct,
        )
    assert runs["srjf"].cache_hit_token_fraction > runs["fcfs"].cache_hit_token_fraction
    assert runs["srjf"].p99_latency_s < runs["fcfs"].p99_latency_s


def test_interim_profile_is_what_the_committed_results_give() -> None:
    """The shipped interim profile is reproducible from the committed H200 result files:
    measured points carry those files' numbers, everything else says it is derived."""
    from bench.derive_profile import SOURCES, derive
    from bench.sim_profile import INTERIM_PROFILE

    shipped = PrefillProfile.load(INTERIM_PROFILE)
    assert shipped.origin == "derived" and "INTERIM" in shipped.note
    assert [p.to_dict() for p in derive().points] == [p.to_dict() for p in shipped.points]
    measured = [p for p in shipped.points if p.origin == "measured"]
    assert {p.uncached for p in measured} == {1024, 4096, 16384, 32768}
    assert all(p.cached == 0 and len(p.seconds) == len(SOURCES) for p in measured)
    assert all(p.origin == "derived" for p in shipped.points if p.cached > 0)


def test_overheads_delay_requests_and_only_step_overhead_loads_the_gpu() -> None:
    reqs = [SimRequestSpec(f"r{i}", 0.0, None, 0, 1000) for i in range(3)]
    wl = sim.Workload(make_workload("short-scoring", 1, 0).spec, reqs, {})
    svc = JCTService(JCTModel(), noise_sigma=0.0)

    def run(**kw) -> sim.RunStats:
        return sim.simulate(
            wl, make_policy("fcfs"), 1.0, service=svc, cache_tokens=0, token_budget=1, **kw
        )

    base = run()
    step = run(step_overhead_s=0.1)
    req = run(request_overhead_s=0.1)
    assert step.makespan_s == pytest.approx(base.makespan_s + 0.3)  # three forwards
    assert step.max_latency_s == pytest.approx(base.max_latency_s + 0.3)
    assert req.makespan_s == base.makespan_s
    assert req.max_latency_s == pytest.approx(base.max_latency_s + 0.1)


def test_sweep_reports_mean_and_spread_over_seeds(tmp_path) -> None:
    from bench import sim_sweep

    out = tmp_path / "s.json"
    argv = ["--workload", "post-recommendation", "--sweep", "lambda", "--values", "0,0.1"]
    argv += ["--seeds", "0,1", "--policies", "srjf", "--qps", "6", "--num-requests", "150"]
    assert sim_sweep.main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["policies"] == ["fcfs", "srjf"]  # FCFS joins as the baseline
    assert len(data["raw"]) == 4
    agg = {(e["value"], e["policy"]): e for e in data["aggregate"]}
    for lam in (0.0, 0.1):
        per_seed = [r["max_qps_at_slo"]["srjf"] for r in data["raw"] if r["value"] == lam]
        s = agg[(lam, "srjf")]["max_qps"]
        assert s["mean"] == pytest.approx(sum(per_seed) / 2)
        assert (s["min"], s["max"]) == (min(per_seed), max(per_seed))
        ratios = [
            r["max_qps_at_slo"]["srjf"] / r["max_qps_at_slo"]["fcfs"]
            for r in data["raw"]
            if r["value"] == lam
        ]
        assert agg[(lam, "srjf")]["max_qps_over_fcfs"]["mean"] == pytest.approx(sum(ratios) / 2)
    # FCFS does not depend on lambda: it ran once per seed and is the same for every value.
    assert agg[(0.0, "fcfs")]["max_qps"] == agg[(0.1, "fcfs")]["max_qps"]
    assert "λ" in sim_sweep.markdown(data)


def test_primed_runs_start_with_the_users_cached() -> None:
    wl = make_workload("post-recommendation", 100, seed=0)
    prime = sim.priming_requests(wl)
    assert [r.prefix_key for r in prime] == list(wl.prefix_tokens_by_user)
    cache = sim.BlockPrefixCache(wl.working_set_tokens * 2)
    svc = sim.build_setup().service
    sim.prime_cache(cache, prime, svc)
    # A cache as large as the working set keeps every profile: each user's next request hits.
    for r in prime:
        view = sim.SimRequest("x", 0.0, r.prefix_tokens + 150, r.prefix_key, r.prefix_tokens)
        assert cache.peek(view) == r.prefix_tokens // 16 * 16
    cold = sim.run_experiment(
        "post-recommendation", ["fcfs"], [2.0], num_requests=100, search=False
    )
    warm = sim.run_experiment(
        "post-recommendation", ["fcfs"], [2.0], num_requests=100, search=False, prime=True
    )
    assert warm["primed"] and not cold["primed"]
    hit = lambda d: d["results"][0]["cache_hit_token_fraction"]  # noqa: E731
    assert hit(warm) > hit(cold)


def test_default_profile_is_the_measured_h200_one() -> None:
    """The simulator's default service times are the profile plan o measured on the H200
    (every point measured, with its provenance), the one the GPU scheduling run belongs to;
    and the scheduler model fitted on its calibration half is the calibration the GPU servers
    loaded, so a replay ranks with the servers' model."""
    from bench.sim_profile import DEFAULT_PROFILE, INTERIM_PROFILE, REPO_DIR

    assert DEFAULT_PROFILE != INTERIM_PROFILE
    prof = PrefillProfile.load(DEFAULT_PROFILE)
    assert prof.origin == "measured" and prof.device == "NVIDIA H200"
    assert prof.model == "random:llama-3.1-8b"
    assert all(p.origin == "measured" and len(p.seconds) == 5 for p in prof.points)
    assert {p.cached for p in prof.points} >= {0, 4096, 16384, 32768}
    assert any(p.batch > 1 for p in prof.points)  # batch points: the batch rule is corrected
    prov = prof.provenance
    assert prov["git_revision"]["given"] and "bench.prefill_profile" in prov["command"]
    results = REPO_DIR / "bench" / "results"
    gpu = json.loads((results / "gpu-scheduling-2026-12-01.json").read_text())
    assert Path(gpu["profile"]["path"]).name == DEFAULT_PROFILE.name
    served = json.loads((results / "jct-calibration-h200.json").read_text())["coefficients"]
    fitted = sim.build_setup().jct_template.coefficients
    for k, v in served.items():
        assert fitted[k] == pytest.approx(v, rel=1e-9)


def test_srjf_given_the_slo_runs_under_its_own_name() -> None:
    """`srjf-slo` (SRJF told the run's SLO) is reported as itself, not as the policy object's
    name (srjf), so it never overwrites plain SRJF's results."""
    from bench import sim

    data = sim.run_experiment(
        "post-recommendation",
        ["srjf", sim.SLO_AWARE_SRJF],
        [2.0],
        num_requests=100,
        search=False,
        prime=True,
    )
    assert [r["policy"] for r in data["results"]] == ["srjf", "srjf-slo"]


def test_ttft_slo_and_fairness_lambda_are_exclusive() -> None:
    from runtime.config import EngineConfig

    assert EngineConfig(ttft_slo_ms=3000).ttft_slo_ms == 3000
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(ttft_slo_ms=3000, fairness_lambda=0.1)
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        EngineConfig(ttft_slo_ms=0)


def test_a_forward_holds_at_most_max_num_seqs_requests() -> None:
    """Nearly fully cached requests of a few tokens each fill the engine's max_num_seqs long
    before its token budget: the simulator caps a forward there too."""
    svc = JCTService(JCTModel(), noise_sigma=0.0)
    reqs = [SimRequestSpec(f"r{i}", 0.0, None, 0, 4) for i in range(40)]
    wl = sim.Workload(make_workload("short-scoring", 1, seed=0).spec, reqs, {})
    st = sim.simulate(wl, make_policy("fcfs"), 1.0, service=svc, cache_tokens=0, max_num_seqs=16)
    assert st.max_batch == 16 and st.num_forwards == 3  # 16 + 16 + 8
    default = sim.simulate(wl, make_policy("fcfs"), 1.0, service=svc, cache_tokens=0)
    assert default.max_batch == 40 and default.num_forwards == 1  # under 256 and the budget


def test_results_say_which_path_the_profiles_warm_points_were_timed_on() -> None:
    """Profiles before 2026-12-05 timed warm points with the new KV discarded (the context
    copied in every layer); the simulator's service description says so, and what a newer
    profile's `kv_path` recorded."""
    from bench.sim_profile import warm_points_path

    pts = [
        ProfilePoint(16, 0, (0.01,)),
        ProfilePoint(64, 0, (0.02,)),
        ProfilePoint(16, 256, (0.03,)),
    ]
    old = PrefillProfile(pts, provenance={"command": "x"})
    assert warm_points_path(old).startswith("gathered")
    new = PrefillProfile(
        pts, provenance={"kv_path": {"16:0:1": "kept", "16:256:1": "kept", "16:256:4": "discarded"}}
    )
    assert warm_points_path(new) == "served: discarded, kept"
    pooled = PrefillProfile(pts, provenance={"pooled": [old.provenance, new.provenance]})
    assert warm_points_path(pooled).startswith("mixed")
    assert ProfileService(new).describe()["warm_points_path"] == "served: discarded, kept"
    # A point whose batch did not fit the pool priced nothing: its planned path is not told
    # (the H100 profile of 2026-12-05 read "served: discarded, kept" for one such point).
    unvalued = PrefillProfile(
        pts,
        provenance={
            "kv_path": {"16:256:1": "kept", "16:256:32": "discarded"},
            "points_without_values": ["16:256:32"],  # as bench.prefill_profile writes it
        },
    )
    assert warm_points_path(unvalued) == "served: kept"


def test_plan_ahead_chooses_the_next_forward_when_the_current_one_starts() -> None:
    """The engine's overlapped scheduling: step N+1 is planned from the queue as it stands when
    step N starts. A short request arriving during a long step then waits for the long step
    planned behind it; SRJF loses what it would gain, FCFS's order is the same."""
    svc = JCTService(JCTModel(), noise_sigma=0.0)
    long_s = svc.forward_s([(4000, 0)], random.Random(0))
    reqs = [
        SimRequestSpec("a", 0.0, None, 0, 4000),
        SimRequestSpec("b", 0.0, None, 0, 4000),
        SimRequestSpec("c", long_s / 2, None, 0, 100),  # arrives during a's forward
    ]
    wl = sim.Workload(make_workload("short-scoring", 1, 0).spec, reqs, {})

    def latencies(policy: str, plan_ahead: bool) -> list[float]:
        out: list[float] = []
        sim.simulate(
            wl,
            make_policy(policy),
            1.0,
            service=svc,
            cache_tokens=0,
            token_budget=4096,  # one long request a forward
            arrivals_s=[r.arrival_unit_s for r in reqs],
            latencies_out=out,
            plan_ahead=plan_ahead,
        )
        return out  # completion order

    short_s = svc.forward_s([(100, 0)], random.Random(0))
    # Without it, SRJF runs c as soon as a ends; with it, b was planned when a started.
    assert latencies("srjf", False) == pytest.approx(
        [long_s, long_s / 2 + short_s, 2 * long_s + short_s]  # a, c, b
    )
    assert latencies("srjf", True) == pytest.approx(
        [long_s, 2 * long_s, 1.5 * long_s + short_s]  # a, b, c
    )
    assert latencies("fcfs", True) == pytest.approx(latencies("fcfs", False))


def test_plan_ahead_with_a_lead_or_a_limit() -> None:
    """`plan_lead_s`: a launch returns that long before its step ends, so step N+1 is chosen
    then (a request arriving before is among the candidates) and step N's answers wait for
    step N+1's launch to return. `overlap_max_step_s`: a forward predicted that long runs alone
    (a what-if: the engine's former `overlap_max_step_ms`, removed in the forty-fifth session):
    the one before it is answered first, and nothing is planned ahead of it."""
    svc = JCTService(JCTModel(), noise_sigma=0.0)
    long_s = svc.forward_s([(4000, 0)], random.Random(0))
    short_s = svc.forward_s([(100, 0)], random.Random(0))
    assert short_s < long_s / 4
    reqs = [
        SimRequestSpec("a", 0.0, None, 0, 4000),
        SimRequestSpec("b", 0.0, None, 0, 4000),
        SimRequestSpec("c", long_s / 2, None, 0, 100),  # arrives during a's forward
    ]
    wl = sim.Workload(make_workload("short-scoring", 1, 0).spec, reqs, {})

    def latencies(**kw: float) -> list[float]:
        out: list[float] = []
        sim.simulate(
            wl,
            make_policy("srjf"),
            1.0,
            service=svc,
            cache_tokens=0,
            token_budget=4096,
            arrivals_s=[r.arrival_unit_s for r in reqs],
            latencies_out=out,
            plan_ahead=True,
            **kw,
        )
        return out  # answer order

    a_c_b = [long_s, long_s / 2 + short_s, 2 * long_s + short_s]
    a_b_c = [long_s, 2 * long_s, 1.5 * long_s + short_s]
    # c is planned after it came (3/4 into a); a's answer is out at once (c's launch is
    # short), c's only when b's launch returns, 1/4 before b ends.
    assert latencies(plan_lead_s=long_s / 4) == pytest.approx(
        [long_s, 1.25 * long_s + short_s, 2 * long_s + short_s]
    )
    # b is planned before c came (1/4 into a); a's answer waits for b's launch.
    assert latencies(plan_lead_s=0.75 * long_s) == pytest.approx(
        [1.25 * long_s, 2 * long_s, 1.5 * long_s + short_s]
    )
    assert latencies(plan_lead_s=2 * long_s) == pytest.approx(a_b_c)  # at a's start
    assert latencies(overlap_max_step_s=long_s / 2) == pytest.approx(a_c_b)  # a is long
    assert latencies(overlap_max_step_s=2 * long_s) == pytest.approx(a_b_c)
    # Both: a and b run alone, so every answer is out at its forward's end.
    assert latencies(plan_lead_s=long_s / 4, overlap_max_step_s=long_s / 2) == pytest.approx(a_c_b)


def test_plan_ahead_passes_over_a_prefix_being_computed() -> None:
    """A request whose prefix the running forward computes is not planned behind it (the
    scheduler's wait for a shared prefix): it runs later, with the prefix as a hit."""
    svc = JCTService(JCTModel(), noise_sigma=0.0)
    reqs = [
        SimRequestSpec("a", 0.0, "u", 3000, 3100, "p1"),
        SimRequestSpec("b", 0.0, "u", 3000, 3100, "p2"),  # same user, other post
        SimRequestSpec("d", 0.0, "v", 3000, 3100, "p1"),
    ]
    wl = sim.Workload(make_workload("short-scoring", 1, 0).spec, reqs, {"u": 3000, "v": 3000})
    stats, lat = {}, {}
    for plan_ahead in (False, True):
        lat[plan_ahead] = []
        stats[plan_ahead] = sim.simulate(
            wl,
            make_policy("fcfs"),
            1.0,
            service=svc,
            cache_tokens=100_000,
            token_budget=3100,  # one request a forward
            arrivals_s=[0.0, 0.0, 0.0],
            latencies_out=lat[plan_ahead],
            plan_ahead=plan_ahead,
        )
    cold_s = svc.forward_s([(3100, 0)], random.Random(0))
    warm_s = svc.forward_s([(3100 - 2992, 2992)], random.Random(0))  # u's 187 blocks cached
    assert lat[False] == pytest.approx([cold_s, cold_s + warm_s, 2 * cold_s + warm_s])  # a b d
    assert lat[True] == pytest.approx([cold_s, 2 * cold_s, 2 * cold_s + warm_s])  # a d b
    # Either way b finds u's profile cached.
    assert stats[True].cache_hit_token_fraction == pytest.approx(2992 / 9300)
    assert stats[False].cache_hit_token_fraction == pytest.approx(2992 / 9300)


def test_long_runs_take_plan_ahead_too() -> None:
    """`run_experiment` (bench.sim, bench.sim_sweep) passes `plan_ahead` to every run and says
    so; under load SRJF's short jobs then wait longer."""
    kw = dict(seed=0, num_requests=120, search=False, prime=True, min_span_slos=0)
    base = sim.run_experiment("post-recommendation", ["srjf"], [6.0], **kw)
    ahead = sim.run_experiment("post-recommendation", ["srjf"], [6.0], plan_ahead=True, **kw)
    assert (base["plan_ahead"], ahead["plan_ahead"]) == (False, True)
    assert ahead["results"][0]["mean_latency_s"] > base["results"][0]["mean_latency_s"]
    # The refinements reach the runs and are recorded; without --plan-ahead they are refused.
    late = sim.run_experiment(
        "post-recommendation", ["srjf"], [6.0], plan_ahead=True, plan_lead_s=1e-3, **kw
    )
    assert (late["plan_lead_ms"], late["overlap_max_step_ms"]) == (1.0, None)
    assert "plan_lead_ms" not in base
    # Chosen 1 ms before the step ends (as fresh as without plan-ahead), but each step's
    # answers wait for the next launch: later than without plan-ahead.
    assert late["results"][0]["mean_latency_s"] > base["results"][0]["mean_latency_s"]
    with pytest.raises(SystemExit):
        sim.main(["--plan-lead-ms", "70", "--out", "/dev/null"])
