"""Issue 17's GPU tooling on the CPU: the prefill profile through the real engine (random:tiny),
and the HTTP plan (bench/gpu_scheduling.py) against a real random:tiny server with tiny
parameters. Proves the plumbing (profile -> JCT calibration -> servers, pool sizing, admin
switches, priming, search, ratios, the report), not performance."""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import pytest

from bench import gpu_scheduling as gs
from bench import prefill_profile
from bench.sim_profile import PrefillProfile
from policies import JCTModel

pytest.importorskip("runtime.engine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_parts_maps_and_pool_sizing() -> None:
    parts = gs.parse_parts("post-recommendation:0.5:fcfs,srjf:2; credit-verification:default:spf:1")
    assert parts[0] == {
        "workload": "post-recommendation",
        "pool": "0.5",
        "policies": ["fcfs", "srjf"],
        "first_repeat": 1,
        "repeats": 2,
    }
    assert parts[1]["pool"] == "default"
    only_second = gs.parse_parts("post-recommendation:0.5:fcfs,srjf:2-2")[0]
    assert (only_second["first_repeat"], only_second["repeats"]) == (2, 2)
    bad_parts = ("x:0.5:fcfs", "x:-1:fcfs:1", "x:0.5::1", "x:0.5:fcfs:0", "x:0.5:fcfs:2-1", "")
    for bad in bad_parts + ("x:0.5:fcfs:0-1", "x:0.5:fcfs:-1"):
        with pytest.raises(ValueError):
            gs.parse_parts(bad)
    assert gs.parse_map("a=1,b=0.25") == {"a": 1.0, "b": 0.25}
    assert gs.pool_blocks(274_245, 0.5) == 8571  # ceil(137,122.5 / 16)
    assert gs.pool_blocks(16, 0.01) == 1


def _search(repeat: int, start: float, max_qps: float, probes: dict) -> dict:
    failing = [q for q in probes if q > max_qps]
    return {
        "repeat": repeat,
        "start_qps": start,
        "max_qps": max_qps,
        "lowest_failing_qps": min(failing) if failing else None,
        "max_qps_is_lower_bound": False,
        "hit_rate_over_search": 0.5,
        "probes": {str(float(q)): {"p99_ms": p99, "mean_ms": p99 / 2} for q, p99 in probes.items()},
    }


def test_the_p99_slope_at_the_slo_reads_only_the_probes_near_it() -> None:
    # SLO 3,000 ms: the band is [2,000, 4,000]; 1,000 and 9,000 lie outside it.
    probes = {
        "4.0": {"p99_ms": 1000.0},
        "5.0": {"p99_ms": 2000.0},
        "6.0": {"p99_ms": 2500.0},
        "7.0": {"p99_ms": 4000.0},
        "9.0": {"p99_ms": 9000.0},
    }
    # Least squares through (5, 2000), (6, 2500), (7, 4000): slope 1000 ms a QPS.
    assert gs.p99_rise_per_qps(probes, 3000) == pytest.approx(1000.0)
    assert gs.p99_rise_per_qps({"4.0": {"p99_ms": 2500.0}}, 3000) is None  # one point
    assert gs.p99_rise_per_qps(probes, 30_000) is None  # nothing in the band


def test_summary_arithmetic() -> None:
    """Max-QPS ratios per repeat; the P99 ratio at the policy's first probe (FCFS's max QPS of
    repeat 1), which FCFS also probed in every repeat."""
    results = {
        "post": {
            "0.5": {
                "fcfs": [
                    _search(1, 4.0, 4.0, {4: 1000.0, 6: 9000.0, 5: 4000.0}),
                    _search(2, 4.0, 5.0, {4: 800.0, 6: 7000.0, 5: 2000.0}),
                ],
                "srjf": [
                    _search(1, 4.0, 8.0, {4: 500.0, 6: 900.0, 9: 5000.0, 8: 2000.0}),
                    _search(2, 4.0, 6.0, {4: 200.0, 6: 2500.0, 9: 9000.0}),
                    {"repeat": 3, "skipped": "device time"},
                ],
            }
        }
    }
    s = gs.summarize(results)["post@0.5"]
    assert s["srjf"]["max_qps_over_fcfs"]["mean"] == pytest.approx((8 / 4 + 6 / 5) / 2)
    assert s["srjf"]["max_qps_over_fcfs"]["min"] == pytest.approx(1.2)
    assert s["srjf"]["p99_at_fcfs_max_qps_over_fcfs"]["mean"] == pytest.approx((0.5 + 0.25) / 2)
    assert s["srjf"]["max_qps"] == {"mean": 7.0, "min": 6.0, "max": 8.0, "n": 2}
    assert s["srjf"]["skipped_or_failed"] == [{"repeat": 3, "skipped": "device time"}]
    assert s["fcfs"]["max_qps_over_fcfs"]["mean"] == 1.0
    assert s["srjf"]["p99_ms_per_qps_near_slo"]["n"] == 0  # no SLO given
    with_slo = gs.summarize(results, {"post": 3000})["post@0.5"]
    # FCFS r1 (4, 1000) (5, 4000) -> only 5 is in [2000, 4000]: None; r2 (5, 2000) only: None.
    assert with_slo["fcfs"]["p99_ms_per_qps_near_slo"]["n"] == 0
    # SRJF r1: (8, 2000) only -> None; r2: (6, 2500) only -> None; so add one probe near it.
    results["post"]["0.5"]["srjf"][0]["probes"]["8.5"] = {"p99_ms": 3000.0, "mean_ms": 1.0}
    with_slo = gs.summarize(results, {"post": 3000})["post@0.5"]
    assert with_slo["srjf"]["p99_ms_per_qps_near_slo"]["mean"] == pytest.approx(2000.0)
    assert with_slo["srjf"]["max_qps_per_5pct_p99"]["mean"] == pytest.approx(150 / 2000)
    del results["post"]["0.5"]["srjf"][0]["probes"]["8.5"]
    table = gs.markdown(
        {"summary": gs.summarize(results), "settings": {"slo_p99_ms": {"post": 3000}}}
    )
    # The brackets: repeat 1 SRJF [8, 9) vs FCFS [4, 5) -> [8/5, 9/4); repeat 2 SRJF [6, 9)
    # vs FCFS [5, 6) -> [6/6, 9/5).
    assert s["srjf"]["max_qps_over_fcfs_bracket"] == [
        pytest.approx([1.6, 2.25]),
        pytest.approx([1.0, 1.8]),
    ]
    assert (
        "| post@0.5 | srjf | 7.00 [6.00, 8.00] | 1.60 [1.20, 2.00] | [1.60, 2.25) [1.00, 1.80) |"
        in table
    )
    # A probe whose client ran past 80 % of a core is named under the table.
    assert "CLIENT-BOUND" not in table
    results["post"]["0.5"]["fcfs"][0]["probes"]["6.0"] |= {
        "client_cpu_percent": 91.0,
        "send_lag_p99_ms": 2985.8,
    }
    results["post"]["0.5"]["fcfs"][0]["probes"]["5.0"]["client_cpu_percent"] = 80.0
    table = gs.markdown(
        {
            "summary": gs.summarize(results),
            "results": results,
            "settings": {"slo_p99_ms": {"post": 3000}},
        }
    )
    assert (
        "CLIENT-BOUND post@0.5 fcfs r1 at 6 QPS: the client at 91 % of a core, send lag P99 "
        "2986 ms: that probe measured the load generator" in table
    )
    assert table.count("CLIENT-BOUND") == 1
    # A search whose step trace has gathered steps is named too; one with none, or an old
    # trace without the field (None), is not.
    assert "GATHERED" not in table
    results["post"]["0.5"]["srjf"][0]["steps"] = {
        "device_load": {
            "num_steps": 400,
            "device_ms": 2000.0,
            "gathered_steps": 12,
            "gathered_device_ms": 250.0,
        }
    }
    results["post"]["0.5"]["srjf"][1]["steps"] = {
        "device_load": {"num_steps": 400, "device_ms": 2000.0, "gathered_steps": None}
    }
    table = gs.markdown({"summary": gs.summarize(results), "results": results, "settings": {}})
    assert (
        "GATHERED post@0.5 srjf r1: 12 of 400 traced steps, 12.5% of their device time copied "
        "their contexts (no room to keep a suffix)" in table
    )
    assert table.count("GATHERED") == 1
    # Two calls of one repeat each merge into the same summary.
    post = results["post"]["0.5"]
    calls = [
        {"results": {"post": {"0.5": {k: [v[i]] for k, v in post.items()}}}, "errors": {"a": "x"}}
        for i in (0, 1)
    ]
    merged = gs.merge_results(calls)
    assert (
        gs.summarize(merged["results"])["post@0.5"]["srjf"]["max_qps_over_fcfs"]
        == (s["srjf"]["max_qps_over_fcfs"])
    )
    assert sorted(merged["errors"]) == ["a (file 1)", "a (file 2)"]


def test_prefill_profile_through_the_real_engine(tmp_path: Path) -> None:
    out, jct_out = tmp_path / "p.json", tmp_path / "jct.json"
    rc = prefill_profile.main(
        [
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--uncached",
            "8,32",
            "--cached",
            "0,64",
            "--batch-points",
            "8:64:2",
            "--repeats",
            "2",
            "--warmup-passes",
            "0",
            "--rev",
            "abc",
            "--out",
            str(out),
            "--jct-out",
            str(jct_out),
        ]
    )
    assert rc == 0
    prof = PrefillProfile.load(out)
    assert prof.origin == "measured" and prof.device == "cpu"
    keys = {(p.uncached, p.cached, p.batch) for p in prof.points}
    assert keys == {(8, 0, 1), (32, 0, 1), (8, 64, 1), (32, 64, 1), (8, 64, 2)}
    assert all(len(p.seconds) == 2 and min(p.seconds) > 0 for p in prof.points)
    prov = prof.provenance
    assert prov["git_revision"]["given"] == "abc" and prov["measurement"]["passes_done"] == 2
    assert prov["command"].startswith("python -m bench.prefill_profile")
    assert prov["engine"]["prefill_chunk_tokens"] == 2048  # the CPU's (unsized) chunk
    # Every point on the path a served request takes (the pool holds them all: kept), with its
    # device span's median beside the wall times.
    assert prov["kv_path"] == {f"{u}:{c}:{b}": "kept" for u, c, b in keys}
    spans = prov["measurement"]["device_s_median"]
    assert set(spans) == set(prov["kv_path"]) and all(v > 0 for v in spans.values())
    # The calibration file is the engine's format, fitted on the first pass (even repeats).
    jct = JCTModel.load(str(jct_out))
    assert jct.model == "random:tiny"
    assert [s.seconds for s in jct._base] == [p.seconds[0] for p in prof.points if p.batch == 1]


def test_prefill_profile_reads_cheap_points_more_often(tmp_path: Path) -> None:
    """--cheap-samples: a point whose warm-up reading is under --cheap-below-ms gets that many
    readings a pass (in pass order), the others one; the record says which."""
    out = tmp_path / "p.json"
    args = ["--model", "random:tiny", "--device", "cpu", "--uncached", "8,32", "--cached", "0"]
    args += ["--repeats", "2", "--cheap-samples", "3", "--cheap-below-ms", "1e6", "--out", str(out)]
    assert prefill_profile.main(args) == 0
    prof = PrefillProfile.load(out)
    assert all(len(p.seconds) == 6 for p in prof.points)
    record = prof.provenance["measurement"]
    want = {f"{p.uncached}:{p.cached}:{p.batch}": 3 for p in prof.points}
    assert record["samples_per_pass"] == want and "8:0:1" in want
    calib, service = prof.split_repeats()  # halves by position: both passes in each
    assert all(len(p.seconds) == 3 for p in calib.points + service.points)
    # Nothing under the bar: one reading a pass.
    assert prefill_profile.main([*args[:-4], "--cheap-below-ms", "0", "--out", str(out)]) == 0
    assert all(len(p.seconds) == 2 for p in PrefillProfile.load(out).points)


def test_plan_against_a_real_tiny_server(tmp_path: Path) -> None:
    rc = gs.main(
        [
            "--smoke",
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--rev",
            "test-rev",
            "--out-dir",
            str(tmp_path),
            "--deadline-s",
            "240",
            "--port",
            str(_free_port()),
            "--parts",
            "post-recommendation:0.5:fcfs,srjf:2",
            "--scales",
            "post-recommendation=0.02",
            "--start-qps",
            "post-recommendation=2",
            "--slo-ms",
            "post-recommendation=20000",
            "--max-probes",
            "2",
            "--num-requests",
            "4",
            "--start-s",
            "60",
            "--profile-s",
            "90",
            "--profile-args",
            "--uncached 8,32 --cached 0,64 --batch-points 8:64:2 --repeats 2 --warmup-passes 0",
            "--per-request",
        ]
    )
    res = json.loads(next(tmp_path.glob("gpu-scheduling-*.json")).read_text())
    assert rc == 0, res["errors"]
    for key in ("command", "git_revision", "device", "date", "plan", "summary", "results"):
        assert key in res
    assert res["git_revision"]["given"] == "test-rev"
    # The profile ran first and every server served with its calibration.
    assert res["profile"]["ok"]
    server = res["servers"]["post-recommendation@0.5"]
    assert "--jct-calibration" in server["server_cmd"]
    # The pool: half the working set of the workload actually sent, in blocks.
    ws = res["workloads"]["post-recommendation"]["working_set_tokens"]
    assert server["num_kv_blocks"] == gs.pool_blocks(ws, 0.5)
    assert server["kv_at_start"]["blocks_total"] == server["num_kv_blocks"]
    runs = res["results"]["post-recommendation"]["0.5"]
    assert [r["repeat"] for r in runs["fcfs"]] == [1, 2] and len(runs["srjf"]) == 2
    for policy, reps in runs.items():
        for r in reps:
            assert r["server_policy"] == policy  # the admin switch reached the server
            assert r["probes"] and r["hit_rate_over_search"] is not None
            first = r["probes"][str(float(r["start_qps"]))]
            assert first["prime"]["requests"] == 20  # primed once per search, before it
            # The client's own load per probe, from its (four) processes' busiest.
            assert first["client_cpu_percent"] is not None and first["send_lag_p99_ms"] >= 0
            # The server's step trace: scoring alone runs prefill-only steps, host times kept.
            pre = r["steps"]["prefill_steps"]
            assert pre["num_steps"] > 0 and pre["launch_ms_p50"] > 0 and pre["plan_ms_p50"] > 0
    # --per-request: every probe's requests, one record each, in the search's own file.
    search = json.loads(next(tmp_path.rglob(runs["srjf"][0]["file"])).read_text())
    assert all(len(run["requests"]) == run["num_requests"] for run in search["runs"])
    # Each search's trace holds its own steps only: the four share one server (a ring of
    # 4,096 steps, far from full here), so every search but the first leaves earlier ones out.
    traces = [r["steps"] for reps in runs.values() for r in reps]
    assert all(t["whole_search"] and t["num_steps"] > 0 for t in traces)
    assert sum(t["steps_before_search"] > 0 for t in traces) >= len(traces) - 1
    # And the steps themselves, gzipped beside the search's file, each with its end on the
    # per-request records' clock: within the search, the last after its last request was sent.
    for r in (r for reps in runs.values() for r in reps):
        raw_file = next(tmp_path.rglob(r["steps"]["raw_file"]))
        raw = json.loads(gzip.decompress(raw_file.read_bytes()))
        assert len(raw["steps"]) == r["steps"]["num_steps"]
        ends = [st["end_unix_s"] for st in raw["steps"]]
        assert raw["answered_unix_s"] - r["wall_s"] - 5 < min(ends) <= max(ends)
        assert max(ends) <= raw["answered_unix_s"]
        search = json.loads(next(tmp_path.rglob(r["file"])).read_text())
        last_sent = max(q["start_unix_s"] for run in search["runs"] for q in run["requests"])
        assert max(ends) > last_sent
    # Every search after FCFS's first starts at FCFS's max QPS of repeat 1.
    q1 = runs["fcfs"][0]["max_qps"]
    assert all(r["start_qps"] == q1 for r in runs["srjf"] + runs["fcfs"][1:])
    s = res["summary"]["post-recommendation@0.5"]["srjf"]
    assert s["max_qps_over_fcfs"]["n"] == 2 and s["p99_at_fcfs_max_qps_over_fcfs"]["n"] == 2
    # The report renders the table and the plot from the file alone.
    png = tmp_path / "plot.png"
    assert (
        gs.main(["--report", str(next(tmp_path.glob("gpu-scheduling-*.json"))), "--plot", str(png)])
        == 0
    )
    assert png.stat().st_size > 0


def test_parts_past_the_deadline_are_skipped_and_recorded(tmp_path: Path) -> None:
    rc = gs.main(
        [
            "--smoke",
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--out-dir",
            str(tmp_path),
            "--deadline-s",
            "20",
            "--port",
            str(_free_port()),
            "--parts",
            "post-recommendation:0.5:fcfs,srjf:1",
            "--scales",
            "post-recommendation=0.02",
            "--start-s",
            "60",
            "--profile-s",
            "90",
        ]
    )
    res = json.loads(next(tmp_path.glob("gpu-scheduling-*.json")).read_text())
    assert rc == 0
    assert res["skipped"][0].startswith("profile")
    assert any(s.startswith("post-recommendation@0.5") for s in res["skipped"])
    assert res["results"] == {} and res["summary"] == {}
