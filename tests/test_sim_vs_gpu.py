"""bench.sim_vs_gpu: the simulator replays a GPU results file's protocol, and the issue's data
point. Synthetic GPU numbers: this checks the replay and the arithmetic, not the GPU."""

from __future__ import annotations

import gzip
import json

import pytest
from toy_tokenizer import make_tokenizer

from bench import sim_vs_gpu as svg
from bench.sim import build_setup
from bench.workloads import WorkloadGenerator


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _gpu_file(tok, first_requests=None) -> dict:
    wl, scale = "post-recommendation", 0.25
    gen = WorkloadGenerator(wl, tok, 0, scale, verify=False)
    users = gen.group_prefix_tokens()
    shape = first_requests or [[r.group, r.num_prompt_tokens] for r in gen.take(50)]

    def search(repeat, start, max_qps, p99s):
        return {
            "repeat": repeat,
            "start_qps": start,
            "max_qps": max_qps,
            "max_qps_is_lower_bound": False,
            "probes": {str(float(q)): {"p99_ms": v} for q, v in p99s.items()},
        }

    return {
        "settings": {
            "parts": [{"workload": wl, "pool": "0.5", "policies": ["fcfs", "srjf"], "repeats": 1}],
            "slo_p99_ms": {wl: 1000.0},
            "request_timeout_s": {wl: 3.0},
            "duration_s": 4.0,
            "num_requests": None,
            "max_probes": 3,
            "search_factor": 1.5,
            "start_qps": {wl: 8.0},
        },
        "workloads": {
            wl: {
                "scale": scale,
                "working_set_tokens": sum(users.values()),
                "per_seed": {"0": {"users": users, "first_requests": shape}},
            }
        },
        "servers": {f"{wl}@0.5": {"num_kv_blocks": sum(users.values()) // 32}},
        "results": {
            wl: {
                "0.5": {
                    "fcfs": [search(1, 8.0, 8.0, {8: 900.0, 12: 5000.0})],
                    "srjf": [search(1, 8.0, 12.0, {8: 300.0, 12: 800.0})],
                }
            }
        },
    }


def _gpu_argv(tok, tmp_path) -> tuple[list[str], object]:
    """`main`'s command line for `_gpu_file` (written with the tokenizer under tmp_path), and
    the output path it writes."""
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    gpu_path, out = tmp_path / "gpu.json", tmp_path / "out.json"
    gpu_path.write_text(json.dumps(_gpu_file(tok)))
    return ["--gpu", str(gpu_path), "--tokenizer", str(path), "--out", str(out)], out


def test_replay_follows_the_gpu_protocol(tok) -> None:
    gpu = _gpu_file(tok)
    setup = build_setup()
    data = svg.compare(gpu, setup, tok)
    rows = {r["policy"]: r for r in data["rows"]}
    assert set(rows) == {"fcfs", "srjf"}
    assert rows["srjf"]["gpu_ratio_to_fcfs"] == pytest.approx(1.5)
    assert rows["fcfs"]["sim_ratio_to_fcfs"] == pytest.approx(1.0)
    sim = data["replayed"]["post-recommendation@0.5"]["sim"]
    fcfs, srjf = sim["fcfs"][0], sim["srjf"][0]
    assert fcfs["start_qps"] == 8.0  # FCFS starts where the GPU's did
    assert srjf["start_qps"] == fcfs["max_qps"]  # SRJF at the simulated FCFS's max QPS
    assert len(fcfs["probes"]) <= 3  # the GPU's probe budget
    r = rows["srjf"]
    assert r["sim_ratio_to_fcfs"] == pytest.approx(srjf["max_qps"] / fcfs["max_qps"])
    assert r["sim_ratio_relative_error"] == pytest.approx(r["sim_ratio_to_fcfs"] / 1.5 - 1)
    assert data["replayed"]["post-recommendation@0.5"]["pool_tokens"] == (
        gpu["servers"]["post-recommendation@0.5"]["num_kv_blocks"] * 16
    )
    # Deterministic: the same file replays to the same numbers.
    again = svg.compare(gpu, build_setup(), tok)
    assert json.dumps(again["rows"]) == json.dumps(data["rows"])
    assert "| post-recommendation @ 0.5 | srjf |" in svg.markdown_rows(data["rows"])


def test_a_part_of_later_repeats_replays_those_repeats_only(tok) -> None:
    """`srjf:2-2` (a second part, as plan q's `PARTS='...:fcfs,srjf:1-1;...:srjf:2-2'`) is
    repeat 2: replaying it from repeat 1 ran SRJF's first search twice (forty-fourth session)."""
    gpu = _gpu_file(tok)
    wl = "post-recommendation"
    part = gpu["settings"]["parts"][0]
    part["first_repeat"] = 1
    gpu["settings"]["parts"].append(
        {"workload": wl, "pool": "0.5", "policies": ["srjf"], "first_repeat": 2, "repeats": 2}
    )
    seed0 = gpu["workloads"][wl]["per_seed"]["0"]
    gen = WorkloadGenerator(wl, tok, 1, 0.25, verify=False)
    gpu["workloads"][wl]["per_seed"]["1"] = {
        "users": seed0["users"],
        "first_requests": [[r.group, r.num_prompt_tokens] for r in gen.take(50)],
    }
    srjf = gpu["results"][wl]["0.5"]["srjf"]
    srjf.append({**srjf[0], "repeat": 2})
    sim = svg.compare(gpu, build_setup(), tok)["replayed"][f"{wl}@0.5"]["sim"]
    assert [r["repeat"] for r in sim["srjf"]] == [1, 2]
    assert [r["repeat"] for r in sim["fcfs"]] == [1]


def test_replay_refuses_other_requests_than_the_gpu_sent(tok) -> None:
    gpu = _gpu_file(tok, first_requests=[["user0", 12]])
    with pytest.raises(ValueError, match="does not make the requests"):
        svg.compare(gpu, build_setup(), tok)


def test_issue_point_replay(tok) -> None:
    data = svg.issue_point(build_setup(), [1.0], [60], [0], tok)
    assert len(data["summary"]) == 4  # 2 QPS x 2 scheduler models
    at8 = [e for e in data["summary"] if e["qps"] == 8.0]
    for e in at8:
        assert e["mean"]["gpu"] == 0.20 and e["p99"]["gpu"] == 0.33
        assert e["mean"]["sim_mean"] < 1.0  # SRJF helps in overload, as on the GPU
    assert "(0.20)" in svg.markdown_issue(data)


def test_predict_a_planned_run(tok, tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "pred.json"
    argv = ["--predict", "--tokenizer", str(path), "--out", str(out)]
    argv += ["--parts", "post-recommendation:0.5:fcfs,srjf:1", "--scales-map"]
    argv += ["post-recommendation=0.25", "--duration-s", "4", "--max-probes", "3"]
    assert svg.main(argv) == 0
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    assert rows["fcfs"]["ratio_to_fcfs"] == 1.0
    # FCFS started at --start-qps; SRJF at FCFS's predicted max, so its first probe is the
    # P99 comparison at FCFS's max QPS.
    sim = data["replayed"]["post-recommendation@0.5"]["sim"]
    assert sim["srjf"][0]["start_qps"] == sim["fcfs"][0]["max_qps"]
    assert rows["srjf"]["p99_at_start_over_fcfs"] is not None
    assert data["plan"]["duration_s"] == 4.0


def test_first_probe_ratios_and_hit_rates_pair_by_repeat() -> None:
    """P99 / mean at the policy's first probe over FCFS's at that QPS (same repeat), hit rate
    as the mean of the probes'; a search the GPU skipped counts for nothing."""

    def rep(repeat: int, start: float, probes: dict) -> dict:
        return {"repeat": repeat, "start_qps": start, "max_qps": start, "probes": probes}

    by_policy = {
        "fcfs": [
            rep(
                1,
                4.0,
                {
                    "4.0": {"p99_ms": 1000.0, "mean_ms": 500.0, "hit_rate": 0.4},
                    "6.0": {"p99_ms": 9000.0, "mean_ms": 4000.0, "hit_rate": 0.6},
                },
            ),
            rep(2, 4.0, {"4.0": {"p99_ms": 2000.0, "mean_ms": 1000.0, "hit_rate": 0.5}}),
        ],
        "srjf": [
            rep(1, 4.0, {"4.0": {"p99_ms": 500.0, "mean_ms": 100.0, "hit_rate": 0.7}}),
            rep(2, 4.0, {"4.0": {"p99_ms": 3000.0, "mean_ms": None, "hit_rate": 0.9}}),
            {"repeat": 3, "skipped": "device time"},
        ],
    }
    got = svg.at_first_probe(by_policy)
    assert got["fcfs"] == {"p99": 1.0, "mean": 1.0, "hit_rate": pytest.approx((0.5 + 0.5) / 2)}
    assert got["srjf"]["p99"] == pytest.approx((0.5 + 1.5) / 2)
    assert got["srjf"]["mean"] == pytest.approx(0.2)  # repeat 2 has no mean: left out
    assert got["srjf"]["hit_rate"] == pytest.approx(0.8)


def test_gpu_mode_records_revision_date_and_machine(tok, tmp_path, monkeypatch) -> None:
    argv, out = _gpu_argv(tok, tmp_path)
    assert svg.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"command", "date", "git", "machine", "service", "scheduler_jct"} <= set(data)
    assert "revision" in data["git"] and "platform" in data["machine"]
    row = next(r for r in data["rows"] if r["policy"] == "srjf")
    assert row["gpu_p99_at_first_probe_over_fcfs"] == pytest.approx(300.0 / 900.0)
    assert row["sim_hit_rate"] is not None and row["gpu_hit_rate"] is None  # none recorded


def test_srjf_what_if_reaches_the_policy_and_is_recorded(tok, monkeypatch) -> None:
    """--srjf-fairness-lambda: the replay's SRJF is built with it (a setting the GPU did not
    run, so the output names it); without --gpu it is refused."""
    seen: list[tuple[str, dict]] = []
    real = svg.make_policy

    def spy(name, **kw):  # type: ignore[no-untyped-def]
        seen.append((name, kw))
        return real(name, **kw)

    monkeypatch.setattr(svg, "make_policy", spy)
    data = svg.compare(_gpu_file(tok), build_setup(), tok, srjf_options={"fairness_lambda": 0.3})
    srjf = [kw for name, kw in seen if name == "srjf"]
    assert srjf and all(kw.get("fairness_lambda") == 0.3 for kw in srjf)
    assert {r["policy"] for r in data["rows"]} == {"fcfs", "srjf"}
    with pytest.raises(SystemExit):
        svg.main(["--issue-point", "--srjf-fairness-lambda", "0.3", "--out", "/dev/null"])


def test_step_overhead_what_if_reaches_every_forward_and_is_recorded(tok, tmp_path) -> None:
    """--step-overhead-ms: every simulated forward of the replay takes that much longer, so a
    search can only sustain less; the output names the what-if; without --gpu it is refused."""
    base = svg.compare(_gpu_file(tok), build_setup(), tok)
    slow = svg.compare(_gpu_file(tok), build_setup(), tok, step_overhead_s=0.5)

    def probes(d: dict) -> dict:
        return d["replayed"]["post-recommendation@0.5"]["sim"]["fcfs"][0]["probes"]

    first = next(iter(probes(base)))
    assert probes(slow)[first]["p99_ms"] > probes(base)[first]["p99_ms"] + 400
    argv, out = _gpu_argv(tok, tmp_path)
    assert svg.main([*argv, "--step-overhead-ms", "3"]) == 0
    assert json.loads(out.read_text())["step_overhead_what_if_ms"] == 3.0
    with pytest.raises(SystemExit):
        svg.main(["--issue-point", "--step-overhead-ms", "3", "--out", "/dev/null"])


def test_forward_scales_what_if_prices_one_request_and_batched_forwards_apart(
    tok, tmp_path
) -> None:
    """--forward-scales-what-if ONE,BATCH: a one-request forward costs ONE times the profile's
    price, a batched one BATCH times; recorded in the output; refused without --gpu."""
    import random

    base = build_setup().service
    scaled = svg.ScaledForwards(base, 0.5, 2.0)
    one, two = [(4000, 0)], [(500, 3000), (400, 3000)]
    assert scaled.median_forward_s(one) == pytest.approx(0.5 * base.median_forward_s(one))
    assert scaled.median_forward_s(two) == pytest.approx(2.0 * base.median_forward_s(two))
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert scaled.forward_s(two, rng_a) == pytest.approx(2.0 * base.forward_s(two, rng_b))
    argv, out = _gpu_argv(tok, tmp_path)
    assert svg.main([*argv, "--forward-scales-what-if", "3,1"]) == 0
    data = json.loads(out.read_text())
    assert data["forward_scales_what_if"] == {"one_request": 3.0, "batch": 1.0}
    plain = svg.compare(_gpu_file(tok), build_setup(), tok)

    def first_p99_ms(d: dict) -> float:
        probes = d["replayed"]["post-recommendation@0.5"]["sim"]["fcfs"][0]["probes"]
        return next(iter(probes.values()))["p99_ms"]

    # Three times slower one-request forwards: a slower first probe than the plain replay's.
    assert first_p99_ms(data) > 1.5 * first_p99_ms(plain)
    for bad in ("3", "0,1", "a,b"):
        with pytest.raises(SystemExit):
            svg.main([*argv, "--forward-scales-what-if", bad])


def test_plan_ahead_refinements_reach_every_replay_and_are_recorded(
    tok, tmp_path, monkeypatch
) -> None:
    """--plan-lead-ms and --overlap-max-step-ms reach every simulated run as seconds and are named
    in the output; without --plan-ahead they are refused."""
    seen: list[tuple[bool, float | None, float | None]] = []
    real = svg.simulate

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append((kw["plan_ahead"], kw["plan_lead_s"], kw["overlap_max_step_s"]))
        return real(*args, **kw)

    monkeypatch.setattr(svg, "simulate", spy)
    argv, out = _gpu_argv(tok, tmp_path)
    argv.append("--plan-ahead")
    assert svg.main([*argv, "--plan-lead-ms", "60", "--overlap-max-step-ms", "100"]) == 0
    assert seen and all(s == (True, pytest.approx(0.06), pytest.approx(0.1)) for s in seen)
    data = json.loads(out.read_text())
    assert (data["plan_lead_ms"], data["overlap_max_step_ms"]) == (60.0, 100.0)
    with pytest.raises(SystemExit):
        svg.main(argv[:-1] + ["--plan-lead-ms", "60"])


def test_batch_model_check_prices_the_gpus_batches_as_the_simulator_would(tok) -> None:
    from bench.sim_profile import ProfileService

    setup = build_setup()
    assert isinstance(setup.service, ProfileService)
    gpu = _gpu_file(tok)
    band = {
        "num_seqs": [33, 128],
        "num_steps": 4,
        "num_requests": 160,
        "device_ms_per_seq": 9.0,
        "new_tokens_per_seq": 16.2,
        "context_tokens_per_seq": 14_000.4,
    }
    load = {"busy_share": 0.97, "prefill_by_batch": [band]}
    gpu["results"]["post-recommendation"]["0.5"]["fcfs"][0]["steps"] = {"device_load": load}
    rows = svg.batch_model_check(gpu, setup.service)
    assert len(rows) == 1  # srjf's search has no step trace: left out
    r = rows[0]
    assert (r["policy"], r["mean_batch"], r["new_tokens_per_seq"]) == ("fcfs", 40, 16)
    want = setup.service.median_forward_s([(16, 14_000)] * 40) * 1e3 / 40
    assert r["sim_ms_per_seq"] == pytest.approx(want)
    assert r["measured_over_sim"] == pytest.approx(9.0 / want)
    assert "| 33-128 | 4 | 40 |" in svg.markdown_batches(rows)
    assert svg.markdown_batches([]) == ""
    # The committed default profile predates device spans: no device column.
    assert r["sim_device_ms_per_seq"] is None and "| - | - |" in svg.markdown_batches(rows)

    # A profile that recorded each point's device span: the same forward priced by them too.
    prof = setup.service.profile
    spans = {f"{p.uncached}:{p.cached}:{p.batch}": p.median_s / 2 for p in prof.points}
    prof.provenance = {**prof.provenance, "measurement": {"device_s_median": spans}}
    dev = prof.device_priced()
    assert dev is not None and all(len(p.seconds) == 1 for p in dev.points)
    r = svg.batch_model_check(gpu, setup.service)[0]
    want_dev = ProfileService(dev).median_forward_s([(16, 14_000)] * 40) * 1e3 / 40
    assert r["sim_device_ms_per_seq"] == pytest.approx(want_dev)
    assert r["measured_over_sim_device"] == pytest.approx(9.0 / want_dev)
    assert f"| {want_dev:.2f} | {9.0 / want_dev:.2f} |" in svg.markdown_batches([r])
    spans.pop(next(iter(spans)))  # one point without a span: not device-priced at all
    assert prof.device_priced() is None


@pytest.mark.parametrize("gzipped", [False, True])
def test_follow_mode_runs_the_gpus_probes_and_pairs_its_requests(tok, tmp_path, gzipped) -> None:
    """--follow-gpu-probes: each search runs the GPU's probes in the GPU's order (a search of
    its own would take another path) and shows the GPU's figures beside its own; with the
    searches' bench.serve files (plain or gzipped, as committed), the GPU's per-request
    records are paired by request id."""
    gpu = _gpu_file(tok)
    # The SRJF search's bench.serve file, with per-request records at 12 QPS only.
    gpu["results"]["post-recommendation"]["0.5"]["srjf"][0]["file"] = "srjf-r1.json"
    searches = tmp_path / "searches"
    searches.mkdir()
    gen = WorkloadGenerator("post-recommendation", tok, 0, 0.25, verify=False)
    gen.group_requests()  # the priming requests come first, as in bench.serve
    ids = [r.request_id for r in gen.take(3)]
    account = {"server_s": 0.1, "engine_queue_s": 0.05, "engine_ttft_s": 0.09, "cached_tokens": 8}
    records = [{"request_id": i, "ok": True, "ttft_s": 0.12, **account} for i in ids]
    runs = [{"qps": 8.0}, {"qps": 12.0, "requests": records}]
    # The search's server steps: two prefill-only steps while the 12-QPS probe ran, one after.
    t0 = 1000.0
    for r in records:
        r["start_unix_s"] = t0
    step = {"num_prefill_seqs": 1, "num_prefill_tokens": 100, "prefill_context_tokens": 0}
    steps = [
        {**step, "end_unix_s": t0 + 0.05, "device_ms": 40.0, "idle_before_ms": 1.0},
        {**step, "end_unix_s": t0 + 0.1, "device_ms": 40.0, "idle_before_ms": 2.0},
        {**step, "end_unix_s": t0 + 9.0, "device_ms": 40.0, "idle_before_ms": 1.0},
    ]
    gpu["results"]["post-recommendation"]["0.5"]["srjf"][0]["steps"] = {
        "raw_file": "srjf-r1.steps.json.gz"
    }
    (searches / "q-srjf-r1.steps.json.gz").write_bytes(
        gzip.compress(json.dumps({"steps": steps}).encode())
    )
    body = json.dumps({"runs": runs}).encode()
    if gzipped:
        (searches / "q-srjf-r1.json.gz").write_bytes(gzip.compress(body))
    else:
        (searches / "q-srjf-r1.json").write_bytes(body)
    options = svg.ReplayOptions(follow_gpu=True, gpu_searches=searches)
    data = svg.compare(gpu, build_setup(), tok, options=options)
    sim = data["replayed"]["post-recommendation@0.5"]["sim"]
    for policy, first_p99 in (("fcfs", 900.0), ("srjf", 300.0)):
        r = sim[policy][0]
        assert r["followed_gpu_probes"] and list(r["probes"]) == ["8.0", "12.0"]
        assert r["probes"]["8.0"]["gpu_p99_ms"] == first_p99
    srjf = sim["srjf"][0]["probes"]
    assert "paired" not in srjf["8.0"]  # no records at 8 QPS
    paired = srjf["12.0"]["paired"]
    assert paired["num_requests"] == 3
    assert paired["gpu_front_end_ms"] == pytest.approx(20.0)  # ttft - server_s
    assert paired["gpu_engine_queue_ms"] == pytest.approx(50.0)
    assert paired["gpu_after_queue_ms"] == pytest.approx(40.0)
    assert paired["sim_queue_ms"] is not None and paired["sim_forward_ms"] > 0
    # Each side's work on the paired requests, priced alike: the GPU cached 8 tokens of each.
    assert paired["gpu_work_s"] > 0 and paired["sim_work_s"] > 0
    more_cached = paired["cached_tokens_gpu_minus_sim_mean"]
    assert more_cached != 0  # (the replay's first requests are cold)
    assert (paired["gpu_work_s"] < paired["sim_work_s"]) == (more_cached > 0)
    # The GPU's own steps over that probe (first request to last answer, 0.12 s): two.
    gpu_steps = srjf["12.0"]["gpu_steps"]
    assert gpu_steps["num_prefill_steps"] == 2 and gpu_steps["device_ms"] == 80.0
    assert gpu_steps["idle_ms"] == 3.0 and gpu_steps["price_ms"] > 0
    assert "gpu_steps" not in srjf["8.0"]
    assert "| 12 |" in svg.markdown_followed(data["replayed"])


class _PerToken:
    """A service pricing a forward at 0.1 ms a new token plus 0.01 ms a context token."""

    def median_forward_s(self, items: list[tuple[int, int]]) -> float:
        return sum(u * 1e-4 + c * 1e-5 for u, c in items)


def test_steps_in_probe_prices_the_gpus_steps_over_the_probes_window() -> None:
    requests = [
        {"start_unix_s": 10.0, "ttft_s": 1.0},
        {"start_unix_s": 12.0, "ttft_s": None},  # failed: its window ends at the timeout
    ]
    steps = [
        # Before the probe's first request: left out.
        {"end_unix_s": 9.9, "device_ms": 500.0, "num_prefill_seqs": 1, "num_prefill_tokens": 9},
        # One request of 1,000 new tokens over 2,000 cached: priced 120 ms, ran 150.
        {
            "end_unix_s": 10.5,
            "device_ms": 150.0,
            "idle_before_ms": 0.5,
            "num_prefill_seqs": 1,
            "num_prefill_tokens": 1000,
            "prefill_context_tokens": 2000,
        },
        # Two requests sharing 400 new tokens: priced as two of 200, 40 ms; ran 30. A long
        # gap before it (the device waited 80 ms) counts in full.
        {
            "end_unix_s": 13.0,
            "device_ms": 30.0,
            "idle_before_ms": 80.0,
            "num_prefill_seqs": 2,
            "num_prefill_tokens": 400,
        },
        # A decode step: device time in the window, not a priced prefill.
        {"end_unix_s": 13.5, "device_ms": 5.0, "num_decodes": 3, "num_prefill_seqs": 0},
        # After the failed request's timeout (12 + 5 s): left out.
        {"end_unix_s": 17.5, "device_ms": 99.0, "num_prefill_seqs": 1, "num_prefill_tokens": 9},
    ]
    out = svg.steps_in_probe(steps, requests, 5.0, _PerToken())
    assert out["window_ms"] == pytest.approx(7000.0)
    assert out["num_steps"] == 3 and out["num_prefill_steps"] == 2
    assert out["device_ms"] == pytest.approx(180.0)
    assert out["price_ms"] == pytest.approx(160.0)
    assert out["device_over_price"] == pytest.approx(180.0 / 160.0, abs=1e-4)
    assert out["idle_ms"] == pytest.approx(80.5)
    assert out["idle_ms_in_long_gaps"] == pytest.approx(80.0)
    assert out["device_share_of_window"] == pytest.approx(185.0 / 7000.0, abs=1e-4)


def test_step_price_check_prices_each_step_by_kind() -> None:
    """Each prefill-only step priced as its own forward and summed by kind (one cold request,
    one warm, several), against its device time. Steps with decodes or without a device time,
    and searches without a trace, are left out."""
    steps = [
        {"num_prefill_seqs": 1, "num_prefill_tokens": 1000, "device_ms": 110.0},
        {
            "num_prefill_seqs": 1,
            "num_prefill_tokens": 100,
            "prefill_context_tokens": 2000,
            "device_ms": 30.0,
        },
        {
            "num_prefill_seqs": 2,
            "num_prefill_tokens": 200,
            "prefill_context_tokens": 4000,
            "device_ms": 60.0,
        },
        {"num_prefill_seqs": 1, "num_prefill_tokens": 500, "num_decodes": 8, "device_ms": 9.0},
        {"num_prefill_seqs": 1, "num_prefill_tokens": 500, "device_ms": None},
    ]
    search = {"max_qps": 5.0, "repeat": 1}
    gpu = {"results": {"w": {"0.5": {"fcfs": [search], "srjf": [{"max_qps": 6.0, "repeat": 1}]}}}}
    rows = svg.step_price_check(gpu, _PerToken(), lambda r: steps if r is search else None)
    by_kind = {r["kind"]: r for r in rows}
    assert [r["search"] for r in rows] == ["w@0.5 fcfs r1"] * 3
    # cold: 1,000 x 0.1 ms = 100 ms; warm: 10 + 20 = 30 ms; batched: 2 x (10 + 20) = 60 ms.
    assert by_kind["one cold"]["price_ms"] == pytest.approx(100.0)
    assert by_kind["one cold"]["device_over_price"] == pytest.approx(1.1)
    assert by_kind["one warm"]["device_over_price"] == pytest.approx(1.0)
    assert by_kind["batched"]["num_steps"] == 1
    assert by_kind["batched"]["device_over_price"] == pytest.approx(1.0)
    assert "| w@0.5 fcfs r1 | one cold | 1 | 0.1 | 0.1 | 1.100 |" in svg.markdown_step_prices(rows)
    assert svg.markdown_step_prices([]) == ""
