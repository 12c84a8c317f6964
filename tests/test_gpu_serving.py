"""CPU dry run of bench/gpu_serving.py: a real `app serve` child (random:tiny, partition off),
sides switched by policy, a few requests per run. Proves the plumbing (server start and stop,
admin switches, harness subprocesses, deadline skipping), the JSON shape and the summary
arithmetic; says nothing about performance."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

from bench import gpu_serving as gs

pytest.importorskip("runtime.engine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_compare_modes_and_summary_arithmetic() -> None:
    def side(max_qps, probes):
        return {
            "max_qps": max_qps,
            "probes": {
                q: {"ttft_ms": {"p99": t, "mean": t / 2}, "tbt_ms": {"p99": b, "mean": b / 2}}
                for q, (t, b) in probes.items()
            },
        }

    off = side(4.0, {"2.0": (100.0, 10.0), "4.0": (200.0, 20.0), "6.0": (900.0, 90.0)})
    auto = side(6.0, {"2.0": (50.0, 5.0), "4.0": (100.0, 14.0), "8.0": (800.0, 50.0)})
    c = gs.compare_modes(off, auto)
    assert c["common_qps"] == 4.0  # highest rate both probed, not either side's max
    assert c["throughput_ratio"] == pytest.approx(1.5)
    assert c["p99_ttft_ratio"] == pytest.approx(0.5)
    assert c["p99_tbt_ratio"] == pytest.approx(0.7)
    models = {
        "m1": {
            "workloads": {
                "long-data": {"auto_vs_off": c},
                "mixed": {
                    "auto_vs_off": {
                        "throughput_ratio": 0.6,
                        "p99_tbt_ratio": None,
                        "p99_ttft_ratio": 2.0,
                    }
                },
            },
            "cost_model_mape": 0.2,
        },
        "m2": {"workloads": {}, "cost_model_mape": float("nan")},
    }
    s = gs.build_summary(models)
    assert s["throughput_ratio_auto_vs_off"] == pytest.approx(math.sqrt(1.5 * 0.6))
    assert s["p99_tbt_ratio_auto_vs_off"] == pytest.approx(0.7)  # the None is left out
    assert s["p99_ttft_ratio_auto_vs_off"] == pytest.approx(1.0)
    assert s["cost_model_mape"] == pytest.approx(0.2)  # NaN (not reported) left out
    assert gs.ratio(0.0, 1.0) is None and gs.ratio(None, 1.0) is None


def test_custom_sides_and_auto_against_the_best_baseline() -> None:
    """#13's comparison: several tuned baselines (sides named off*) in one run; auto is judged
    against the one with the highest max QPS."""
    sides = gs.custom_sides(
        ["off-2k:partition=off,budget=2048", "off-8k:partition=off", "auto:partition=auto"]
    )
    assert list(sides) == ["off-2k", "off-8k", "auto"]
    with pytest.raises(SystemExit):
        gs.custom_sides(["off-2k:partition=off", "off-2k:partition=auto"])
    with pytest.raises(SystemExit):
        gs.custom_sides(["no-settings"])

    def side(max_qps: float) -> dict:
        probe = {"ttft_ms": {"p99": 100.0, "mean": 50.0}, "tbt_ms": {"p99": 10.0, "mean": 5.0}}
        return {"max_qps": max_qps, "probes": {"2.0": probe}}

    w = {"off-2k": side(6.0), "off-8k": side(4.0), "auto": side(5.0), "off-tbt": {"error": "x"}}
    gs.add_comparisons(w)
    assert w["best_baseline"] == "off-2k"
    assert w["auto_vs_best_baseline"]["throughput_ratio"] == pytest.approx(5.0 / 6.0)


def test_auto_is_checked_against_every_baseline_at_every_probe() -> None:
    """Issue 13's first target, per load level: P99 TBT and TTFT P50 at most 5 % worse, total
    tokens/s at most 5 % lower, all three at once."""

    def probe(tbt_p99: float, ttft_p50: float | None, tokens: float) -> dict:
        return {
            "ttft_ms": {"mean": 500.0, "p50": ttft_p50, "p99": 1000.0},
            "tbt_ms": {"mean": 10.0, "p99": tbt_p99},
            "total_token_throughput": tokens,
        }

    base = {"probes": {"2.0": probe(50.0, 100.0, 1000.0), "4.0": probe(50.0, 100.0, 1000.0)}}
    auto = {
        "probes": {
            "2.0": probe(52.0, 104.0, 960.0),  # inside 5 % on all three
            "4.0": probe(40.0, 80.0, 940.0),  # better latencies, 6 % fewer tokens/s
            "8.0": probe(40.0, 80.0, 2000.0),  # the baseline never probed it
        }
    }
    c = gs.probe_check(base, auto)
    assert list(c["by_probe"]) == ["2.0", "4.0"]
    assert c["by_probe"]["2.0"]["within_target"] is True
    assert c["by_probe"]["4.0"]["within_target"] is False
    assert c["by_probe"]["4.0"]["total_tokens_ratio"] == pytest.approx(0.94)
    assert c["within_target_at_every_probe"] is False
    # A record without the P50 (kept since 2026-12-04) leaves that ratio out, not the check.
    old = {"probes": {"2.0": probe(50.0, None, 1000.0)}}
    c = gs.probe_check(old, {"probes": {"2.0": probe(50.0, 500.0, 1000.0)}})
    assert c["by_probe"]["2.0"]["p50_ttft_ratio"] is None
    assert c["within_target_at_every_probe"] is True
    w = {
        "off-2k": {"max_qps": 4.0, **base},
        "off-tbt": {"max_qps": 2.0, **base},
        "auto": {"max_qps": 4.0, **auto},
    }
    gs.add_comparisons(w)
    assert set(w["auto_by_probe"]) == {"off-2k", "off-tbt", gs.BEST_PER_FIGURE}


def test_the_best_baseline_is_taken_figure_by_figure() -> None:
    """Read strictly, "the best baseline" is the best of each figure at each probe, whichever
    baseline had it: auto within 5 % of each baseline alone can miss it."""

    def probe(tbt_p99: float, ttft_p50: float, tokens: float) -> dict:
        return {
            "ttft_ms": {"mean": ttft_p50, "p50": ttft_p50, "p99": 2 * ttft_p50},
            "tbt_ms": {"mean": tbt_p99 / 4, "p99": tbt_p99},
            "total_token_throughput": tokens,
        }

    smooth = {"max_qps": 4.0, "probes": {"2.0": probe(50.0, 120.0, 1000.0)}}
    fast = {"max_qps": 4.0, "probes": {"2.0": probe(80.0, 100.0, 1000.0), "4.0": probe(90, 1, 9)}}
    best = gs.best_per_figure({"off-2k": smooth, "off-tbt": fast})
    assert best["probes"]["2.0"] == {
        "tbt_ms": {"p99": 50.0},
        "ttft_ms": {"p50": 100.0},
        "total_token_throughput": 1000.0,
    }
    assert best["probes"]["4.0"]["tbt_ms"]["p99"] == 90  # only one baseline ran it
    auto = {"max_qps": 4.0, "probes": {"2.0": probe(52.0, 125.0, 1000.0)}}
    w = {"off-2k": smooth, "off-tbt": fast, "auto": auto}
    gs.add_comparisons(w)
    checks = w["auto_by_probe"]
    assert checks["off-2k"]["by_probe"]["2.0"]["within_target"] is True
    strict = checks[gs.BEST_PER_FIGURE]["by_probe"]["2.0"]
    assert strict["p50_ttft_ratio"] == pytest.approx(1.25) and strict["within_target"] is False


def test_scoring_beside_chat_is_checked_on_the_chats_gaps() -> None:
    """Scoring requests have no gaps between tokens: beside chat, the P99 TBT checked per probe
    is the background chat's during that probe; the latency is the scoring one."""

    def side(latency_p50: float, chat_p99: float, tokens: float) -> dict:
        probe = {
            "ttft_ms": {"p50": latency_p50, "p99": 2 * latency_p50},
            "tbt_ms": {"p50": None, "p99": None},
            "total_token_throughput": tokens,
        }
        return {
            "max_qps": 16.0,
            "probes": {"16.0": probe},
            "chat_background_by_probe": {"16.0": {"tbt_ms": {"p50": 2.6, "p99": chat_p99}}},
        }

    sc = {
        "chat_qps": 2,
        "off-2k": side(339.0, 48.3, 1.9e5),
        "off-tbt": side(422.0, 72.3, 1.9e5),
        "auto": side(236.0, 79.4, 1.9e5),
    }
    gs.add_score_chat_by_probe(sc)
    tbt = sc["auto_by_probe"]["off-tbt"]["by_probe"]["16.0"]
    assert tbt["p99_tbt_ratio"] == pytest.approx(79.4 / 72.3)
    assert tbt["p50_ttft_ratio"] == pytest.approx(236.0 / 422.0)
    assert tbt["within_target"] is False  # the chat's gap is 10 % worse
    assert sc["auto_by_probe"]["off-2k"]["within_target_at_every_probe"] is False
    merged = gs.merge_records(
        {"score_chat": sc}, {"score_chat": {"auto": side(236.0, 73.0, 1.9e5)}}
    )
    again = merged["score_chat"]["auto_by_probe"]["off-tbt"]["by_probe"]["16.0"]
    assert again["within_target"] is True  # recomputed from the merged sides


def test_ladder_is_judged_against_each_slo() -> None:
    def run(qps, ttft_p99, tbt_p99, tpot_p99):
        pct = lambda v: {"p99": v, "mean": v / 2}  # noqa: E731
        return {
            "qps": qps,
            "metrics": {
                "completed": 10,
                "failed": 0,
                "ttft_ms": pct(ttft_p99),
                "itl_ms": pct(tbt_p99),
                "tpot_ms": pct(tpot_p99),
            },
        }

    off = {"runs": [run(2, 300, 90, 20), run(4, 500, 120, 30), run(6, 900, 150, 70)]}
    auto = {"runs": [run(6, 1500, 60, 25), run(2, 400, 40, 15), run(4, 700, 50, 20)]}
    slos = ["ttft:1000,tbt:100", "ttft:1000,tpot:60"]
    vo, va = gs.ladder_view(off, slos), gs.ladder_view(auto, slos)
    assert vo["by_slo"]["ttft:1000,tbt:100"] == {"max_qps": 2.0, "lowest_failing_qps": 4.0}
    assert vo["by_slo"]["ttft:1000,tpot:60"] == {"max_qps": 4.0, "lowest_failing_qps": 6.0}
    assert va["ladder"] == [2.0, 4.0, 6.0]  # sorted by rate
    assert va["max_qps"] == 4.0 and va["lowest_failing_qps"] == 6.0  # TTFT 1500 at 6
    assert va["at_max_qps"]["tbt_ms"]["p99"] == 50
    c = gs.compare_modes(vo, va)
    assert c["throughput_ratio"] == pytest.approx(2.0)
    assert c["throughput_ratio_by_slo"] == {
        "ttft:1000,tbt:100": pytest.approx(2.0),
        "ttft:1000,tpot:60": pytest.approx(1.0),
    }
    assert c["common_qps"] == 6.0 and c["p99_tbt_ratio"] == pytest.approx(60 / 150)
    # Nothing passes: no max QPS, and the ratio says so (None), not 0.
    none = gs.ladder_view({"runs": [run(2, 5000, 90, 20)]}, slos)
    assert none["max_qps"] is None and gs.compare_modes(none, va)["throughput_ratio"] is None


def test_background_chat_is_split_by_scoring_probe() -> None:
    """A chat request counts under the scoring probe whose wall-clock window it was sent in
    (start inclusive, end exclusive); requests sent outside every window count nowhere."""

    def req(start_s: float, ttft_s: float, gaps_s: list[float]) -> dict:
        tpot_s = sum(gaps_s) / len(gaps_s) if gaps_s else None
        return {
            "start_unix_s": start_s,
            "ok": True,
            "ttft_s": ttft_s,
            "tpot_s": tpot_s,
            "itl_s": gaps_s,
        }

    chat_run = {
        "requests": [
            req(99.0, 9.0, [9.0]),  # before the first probe
            req(100.0, 0.1, [0.01, 0.02]),  # probe 2.0, at its start
            req(105.0, 0.3, [0.03]),  # probe 2.0
            {"start_unix_s": 106.0, "ok": False},  # probe 2.0, failed
            req(110.0, 9.0, [9.0]),  # at probe 2.0's end: between probes
            req(112.0, 1.0, [0.1, 0.2, 0.3]),  # probe 4.0
            req(126.0, 9.0, [9.0]),  # after the last probe
        ]
    }

    def probe(qps: float, start_s: float, end_s: float) -> dict:
        return {"qps": qps, "metrics": {"started_unix_s": start_s, "ended_unix_s": end_s}}

    runs = [probe(2.0, 100.0, 110.0), probe(4.0, 111.0, 120.0), probe(8.0, 121.0, 125.0)]
    by_probe = gs.chat_by_probe(chat_run, runs)
    assert list(by_probe) == list(gs.max_qps_view({"runs": runs})["probes"])  # same keys
    p2, p4, p8 = by_probe["2.0"], by_probe["4.0"], by_probe["8.0"]
    assert (p2["completed"], p2["failed"], p4["completed"]) == (2, 1, 1)
    # numpy's linear percentiles, in ms: TTFT [100, 300], gaps [10, 20, 30], TPOT [15, 30].
    assert p2["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert p2["tbt_ms"] == {"p50": pytest.approx(20.0), "p99": pytest.approx(29.8)}
    assert p2["tpot_ms"]["p99"] == pytest.approx(29.85)
    assert p4["ttft_ms"]["p99"] == pytest.approx(1000.0)
    assert p4["tbt_ms"] == {"p50": pytest.approx(200.0), "p99": pytest.approx(298.0)}
    assert p8 == {
        "completed": 0,
        "failed": 0,
        "ttft_ms": {"p99": None},
        "tbt_ms": {"p50": None, "p99": None},
        "tpot_ms": {"p99": None},
        "server_itl": None,  # (the probe's run did not read the server's histogram)
    }
    assert "token_tbt_ms" not in p2  # no token counts recorded
    # The probe's own reading of the server's gaps travels with it.
    server_itl = {"count": 40, "fraction_over_s": {"0.08": 0.025}}
    read = [dict(runs[0], server_itl=server_itl), *runs[1:]]
    assert gs.chat_by_probe(chat_run, read)["2.0"]["server_itl"] == server_itl
    # With the tokens each chunk carried: a 200-ms gap that carried two tokens is two of 100.
    counted = dict(req(112.0, 1.0, [0.1, 0.2, 0.3]), itl_tokens=[1, 2, 1])
    p4 = gs.chat_by_probe({"requests": [counted]}, runs)["4.0"]
    assert p4["tbt_ms"]["p50"] == pytest.approx(200.0)
    assert p4["token_tbt_ms"] == {"p50": pytest.approx(100.0), "p99": pytest.approx(294.0)}

    # Chat figures compared at the highest scoring QPS that every side probed (16, not 32
    # which one side alone reached, nor "4.0", the highest as text).
    def figures(tbt_p99_ms: float) -> dict:
        return {"completed": 3, "tbt_ms": {"p50": 1.0, "p99": tbt_p99_ms}}

    sc = {
        "chat_qps": 2.0,
        "off": {"chat_background_by_probe": {"4.0": figures(50.0), "16.0": figures(181.0)}},
        "auto": {
            "chat_background_by_probe": {
                "4.0": figures(40.0),
                "16.0": figures(106.0),
                "32.0": figures(300.0),
            }
        },
        "static": {"chat_background_by_probe": None},  # chat record unreadable: left out
        "off-2k": {"error": "x"},
    }
    gs.add_chat_at_common_qps(sc)
    assert sc["chat_p99_itl_at_common_score_qps"] == {"qps": 16.0, "off": 181.0, "auto": 106.0}
    assert sc["auto"]["chat_at_common_qps"] == {"qps": 16.0, **figures(106.0)}
    assert "chat_at_common_qps" not in sc["static"]
    # Recomputed (e.g. after a merge) with one side only: no comparison is left behind.
    del sc["auto"]
    gs.add_chat_at_common_qps(sc)
    assert "chat_p99_itl_at_common_score_qps" not in sc
    assert sc["off"]["chat_at_common_qps"]["qps"] == 16.0


def test_engine_counters_over_one_run_are_differences() -> None:
    before = {
        "tbt_cut": {"num_mixed_steps": 10, "num_mixed_steps_over_tbt": 2, "cost_scale": 1.5},
        "choice_counts": {"chunked": 5, "112": 1},
    }
    after = {
        "tbt_cut": {
            "num_mixed_steps": 40,
            "num_mixed_steps_over_tbt": 5,
            "cost_scale": 1.7,
            "mixed_step_ratio_p99": 1.3,
        },
        "choice_counts": {"chunked": 9, "112": 1, "96": 2},
        "cost_model_errors": {"mape_chunked_step": 0.1},
    }
    d = gs.engine_during(before, after)
    assert d["tbt_cut"] == {
        "num_mixed_steps": 30,
        "num_mixed_steps_over_tbt": 3,
        "cost_scale": 1.7,  # not a counter: as after the run
        "mixed_step_ratio_p99": 1.3,
    }
    assert d["choice_counts"] == {"chunked": 4, "96": 2}  # unchanged ones left out
    assert d["cost_model_errors_at_end"] == {"mape_chunked_step": 0.1}
    assert d["kernels_compiled"] is None  # the server did not count them (before / after)
    d = gs.engine_during({**before, "kernels_compiled": 1}, {**after, "kernels_compiled": 4})
    assert d["kernels_compiled"] == 3  # compiled during the run
    assert d["num_preemptions"] is None  # an older server: not reported
    d = gs.engine_during(
        {
            **before,
            "num_preemptions": 7,
            "num_chunked_scoring": 0,
            "num_sub_layer_sliced_prefills": 1,
        },
        {
            **after,
            "num_preemptions": 9,
            "num_chunked_scoring": 5,
            "num_sub_layer_sliced_prefills": 4,
        },
    )
    assert (d["num_preemptions"], d["num_chunked_scoring"]) == (2, 5)
    assert d["num_sub_layer_sliced_prefills"] == 3 and d["num_layer_sliced_prefills"] is None
    assert gs.engine_during(before, {}) == {"unreadable": True}


def test_step_gaps_say_which_steps_made_the_long_waits() -> None:
    def step(age_s, decodes, prefill, device_ms, idle_ms=1.0, split=False):
        return {
            "age_s": age_s,
            "on_split": split,
            "num_decodes": decodes,
            "decode_context_tokens": 100 * decodes,
            "num_prefill_seqs": 1 if prefill else 0,
            "num_prefill_tokens": prefill,
            "prefill_context_tokens": 0,
            "prefill_attention_pairs": prefill * prefill / 2,
            "device_ms": device_ms,
            "idle_before_ms": idle_ms,
            "predicted_ms": None,
        }

    steps = [step(10.0 - 0.01 * i, 8, 0, 10.0) for i in range(100)]  # decode-only, 11 ms
    steps += [step(8.0, 8, 4096, 90.0, idle_ms=5.0), step(7.9, 0, 8192, 150.0)]
    steps += [step(7.8, 8, 2048, 40.0), step(7.7, 8, 2048, 40.0, idle_ms=None, split=True)]
    d = gs.summarize_steps(steps)
    assert d["num_steps"] == 104 and d["span_s"] == pytest.approx(2.3)
    kinds = d["by_kind"]
    assert kinds["decode"]["num_steps"] == 100 and kinds["decode"]["waited_ms_p99"] == 11.0
    assert kinds["decode"]["num_over_50_ms"] == 0
    assert kinds["mixed"]["num_steps"] == 2 and kinds["mixed"]["waited_ms_max"] == 95.0
    assert kinds["mixed"]["device_ms_mean"] == 65.0  # (90 + 40) / 2: the GPU's part alone
    assert kinds["mixed"]["prefill_tokens_mean"] == 3072.0
    assert kinds["decode"]["device_ms_mean"] == 10.0 and kinds["decode"]["waited_ms_mean"] == 11.0
    assert kinds["mixed"]["num_over_80_ms"] == 1 and kinds["mixed"]["num_over_100_ms"] == 0
    assert kinds["prefill"]["num_over_100_ms"] == 1  # no decode waited for it
    assert kinds["split mixed"]["waited_ms_max"] == 40.0  # no idle known on a split
    longest = d["longest_with_decodes"]
    assert [x["waited_ms"] for x in longest[:2]] == [95.0, 41.0]
    assert all(x["num_decodes"] for x in longest)
    over = d["num_steps_over_tokens"]  # prefill + decodes: 4104, 8192, 2056, 2056
    assert over == {"512": 4, "1024": 4, "2048": 4, "4096": 2, "8192": 0}
    assert gs.summarize_steps([])["by_kind"] == {}
    assert d["decode_gap_ms"] is None  # a trace without the field (older, or serial) has none
    # The split executor's decode gaps: what continuing decodes waited between their steps.
    split_steps = [{**st, "decode_gap_ms": None} for st in steps]
    for st, gap in zip(split_steps[:5], (0.1, 0.2, 85.0, 0.1, 120.0), strict=True):
        st["decode_gap_ms"] = gap
    g = gs.summarize_steps(split_steps)["decode_gap_ms"]
    assert g["num"] == 5 and g["p50"] == 0.2 and g["max"] == 120.0
    assert g["num_over_80_ms"] == 2 and g["num_over_100_ms"] == 1
    assert d["layer_sliced"] is None  # no layer-sliced prefill in the trace
    # Layer-sliced prefills: their span against the controller's prediction.
    sliced = [
        {
            **step(5.0, 0, 12000, None),
            "layer_sliced_span_ms": span,
            "layer_sliced_predicted_ms": 200.0,
        }
        for span in (220.0, 240.0, 180.0)
    ]
    ls = gs.summarize_steps(split_steps + sliced)["layer_sliced"]
    assert ls["num"] == 3 and ls["span_ms_mean"] == pytest.approx(213.33)
    assert ls["ratio_p50"] == 1.1
    assert (ls["ratio_p10"], ls["ratio_p90"]) == (0.9, 1.1)


def test_mode_drift_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pin on a split that fails falls back to `off` mid-run: that run is not static:N."""
    states = {
        "held": {"partition": {"mode": "static", "disabled_splits": {}}},
        "fell_back": {"partition": {"mode": "off", "disabled_splits": {"120": "cuBLAS"}}},
        "disabled_other": {"partition": {"mode": "auto", "disabled_splits": {"120": "cuBLAS"}}},
    }
    # Already disabled when the run began (e.g. at start-up): not a drift of this run.
    monkeypatch.setattr(gs, "http_json", lambda url, *a, **kw: states["disabled_other"])
    assert gs.mode_drift("http://x", {"partition": {"mode": "auto"}}, {"120"}) is None
    assert gs.disabled_splits("http://x") == {"120"}
    applied_static = {"partition": {"mode": "static", "prefill_sms": 120}}
    for key, want in (
        ("held", None),
        ("fell_back", "partition mode changed during the run: static -> off"),
        ("disabled_other", "splits disabled during the run: ['120']"),
    ):
        monkeypatch.setattr(gs, "http_json", lambda url, *a, _k=key, **kw: states[_k])
        applied = applied_static if key != "disabled_other" else {"partition": {"mode": "auto"}}
        assert gs.mode_drift("http://x", applied) == want


def test_merge_keeps_every_call_and_recomputes_the_summary(tmp_path: Path) -> None:
    """Two device calls measured different workloads of one model (and another model): the
    merged file holds both workloads, both commands and a summary over all of them."""

    def call(name, cmd, model, wl, thr, mape):
        rec = {
            "slug": model,
            "workloads": {wl: {"auto_vs_off": {"throughput_ratio": thr, "p99_tbt_ratio": 0.5}}},
            "cost_model_mape": mape,
        }
        p = tmp_path / name
        p.write_text(
            json.dumps(
                {
                    "command": cmd,
                    "git_revision": "r1",
                    "device": "H200",
                    "date": "2026-11-30T01:00:00",
                    "models": {model: rec},
                    "errors": {"x": "boom"} if name == "b.json" else {},
                }
            )
        )
        return str(p)

    a = call("a.json", "call a", "m", "long-data", 2.0, 0.1)
    b = call("b.json", "call b", "m", "mixed", 0.5, None)
    c = call("c.json", "call c", "m8", "long-data", 4.0, 0.3)
    out = tmp_path / "merged.json"
    merged = gs.merge_files([a, b, c], out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(merged))
    assert merged["command"] == ["call a", "call b", "call c"]
    assert set(merged["models"]["m"]["workloads"]) == {"long-data", "mixed"}
    assert merged["models"]["m"]["cost_model_mape"] == 0.1  # b's None does not erase a's
    assert merged["errors"] == {"x": "boom"}
    # A later call that ran only the static side of a workload adds it; off/auto stay.
    side = {"max_qps": 2.0, "probes": {}}
    first = {"workloads": {"long-data": {"off": side, "auto": {**side, "max_qps": 4.0}}}}
    later = {"workloads": {"long-data": {"static": {**side, "max_qps": 3.0}}}}
    w = gs.merge_records(first, later)["workloads"]["long-data"]
    assert set(w) >= {"off", "auto", "static", "auto_vs_off", "static_vs_off"}
    assert w["static_vs_off"]["throughput_ratio"] == pytest.approx(1.5)
    # score+chat sides merge the same way (a later auto-only run keeps the earlier off side).
    sc = gs.merge_records(
        {"score_chat": {"off": {"max_qps": 6.0}, "auto": {"error": "x"}}},
        {"score_chat": {"auto": {"max_qps": 2.0}}},
    )["score_chat"]
    assert sc["off"]["max_qps"] == 6.0 and sc["score_qps_ratio_auto_vs_off"] == pytest.approx(1 / 3)
    # Sides measured by different calls: their chat is compared at the scoring QPS both probed.
    probes = {"4.0": {"tbt_ms": {"p99": 50.0}}, "8.0": {"tbt_ms": {"p99": 90.0}}}
    sc = gs.merge_records(
        {"score_chat": {"off": {"chat_background_by_probe": probes}}},
        {"score_chat": {"auto": {"chat_background_by_probe": {"4.0": probes["4.0"]}}}},
    )["score_chat"]
    assert sc["chat_p99_itl_at_common_score_qps"] == {"qps": 4.0, "off": 50.0, "auto": 50.0}
    s = merged["summary"]
    assert s["throughput_ratio_auto_vs_off"] == pytest.approx((2.0 * 0.5 * 4.0) ** (1 / 3))
    assert s["cost_model_mape"] == pytest.approx(0.2)


def test_cpu_dry_run_against_real_server(tmp_path: Path) -> None:
    port = _free_port()
    rc = gs.main(
        [
            "--smoke",
            "--models",
            "random:tiny",
            "--port",
            str(port),
            "--server-args",
            "--partition off --device cpu",
            "--parts",
            "long-data,score-chat,ablation,arxiv",
            "--out-dir",
            str(tmp_path),
            "--deadline-s",
            "240",
            "--rev",
            "test-rev",
            "--start-s",
            "90",
            "--scale",
            "0.02",
            "--num-requests",
            "3",
            "--max-probes",
            "2",
            "--drain-s",
            "1",
            "--duration-s",
            "2",
        ]
    )
    files = list(tmp_path.glob("partition-*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert rc == 0, res["errors"]
    for key in ("command", "git_revision", "device", "date", "plan", "summary", "models"):
        assert key in res
    assert res["git_revision"] == "test-rev"
    assert [p["part"] for p in res["plan"]][0] == "random:tiny/start"
    m = res["models"]["random:tiny"]
    assert m["startup_s"] > 0
    wl = m["workloads"]["long-data"]
    for side, policy in (("off", "fcfs"), ("auto", "srjf"), ("static", "spf")):
        # The server reported the policy the side asked for: the admin switch reached it.
        assert wl[side]["server_settings"]["policy"] == policy
        assert wl[side]["probes"], side
        assert (tmp_path / wl[side]["file"]).exists()
    # The summary is the arithmetic of the recorded per-side numbers.
    c = wl["auto_vs_off"]
    assert c["throughput_ratio"] == pytest.approx(
        gs.ratio(wl["off"]["max_qps"], wl["auto"]["max_qps"])
    )
    q = str(c["common_qps"])
    assert c["p99_tbt_ratio"] == pytest.approx(
        wl["auto"]["probes"][q]["tbt_ms"]["p99"] / wl["off"]["probes"][q]["tbt_ms"]["p99"]
    )
    s = res["summary"]
    ratios = [
        res["models"]["random:tiny"]["workloads"][w]["auto_vs_off"]["p99_ttft_ratio"]
        for w in ("long-data", "arxiv")
    ]
    assert s["p99_ttft_ratio_auto_vs_off"] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    sc = m["score_chat"]
    assert sc["score_workload"] == "post-recommendation"  # the default scoring load
    assert sc["off"]["chat_still_running_at_end"] is True  # probes ran under chat load
    # The background chat, stopped after the search, recorded its own latencies per side.
    for side in ("off", "auto"):
        chat = sc[side]["chat_background"]
        assert chat["stopped_by_signal"] is True and chat["completed"] >= 1, chat
        assert chat["tbt_ms"]["p99"] is not None
    assert sc["chat_p99_tbt_ratio_auto_vs_off"] is not None
    # ... and per scoring probe, over the chat requests sent inside each probe's window.
    for side in ("off", "auto"):
        by_probe = sc[side]["chat_background_by_probe"]
        assert set(by_probe) == set(sc[side]["probes"]), side
        chat = sc[side]["chat_background"]
        assert sum(p["completed"] for p in by_probe.values()) <= chat["completed"]
    common = sc["chat_p99_itl_at_common_score_qps"]
    assert set(common) == {"qps", "off", "auto"}
    assert sc["off"]["chat_at_common_qps"]["qps"] == common["qps"]
    # Each probe's steps, saved right after it, apart from the side's file at the end.
    run = json.loads((tmp_path / wl["auto"]["file"]).read_text())["runs"][0]
    saved = run["steps"]
    assert saved["saved"] and saved["num_steps"] > 0, saved
    probe_file = tmp_path / "probe-steps" / saved["file"]
    steps = json.loads(probe_file.read_text())["steps"]
    assert len(steps) == saved["num_steps"] and "chunked_predicted_ms" in steps[0]
    assert probe_file.name.startswith(Path(wl["auto"]["file"]).stem + "-qps")
    assert not list(tmp_path.glob("*-qps*.steps.json"))  # not beside the side files
    # ... and summarized per probe in the side's record, keyed like its probes.
    by_probe = wl["auto"]["step_gaps_by_probe"]
    assert set(by_probe) == set(wl["auto"]["probes"]), by_probe.keys()
    one = by_probe[str(float(run["qps"]))]
    assert one["num_steps"] == saved["num_steps"] and one["file"] == saved["file"]
    assert one["covers_probe"] == saved["covers_run"] and one["by_kind"]
    # What the engine said of each side's run (read from the admin state before and after).
    during = wl["off"]["engine_during_run"]
    assert isinstance(during["tbt_cut"]["num_mixed_steps"], int), during
    # Each side asks the server to empty its cost-model error logs first; a CPU server has no
    # cost model and says so (409), and the side records that the reading was not reset.
    assert wl["off"]["cost_model_errors_reset_before"] is False
    assert during["tbt_cut"]["num_mixed_steps"] >= 0
    abl = m["ablation"]
    assert set(abl) >= {"policy_alone", "partition_alone", "both"}
    assert [x["policy"] for x in abl["both"]["server_settings"]] == ["fcfs", "srjf-oneshot"]
    assert abl["policy_alone"]["comparison"]


def test_the_scoring_load_beside_chat_is_chosen_by_name() -> None:
    p = gs.build_parser()
    assert p.parse_args([]).score_workload == "post-recommendation"
    args = p.parse_args(["--score-workload", "credit-verification"])
    assert args.score_workload == "credit-verification"
    with pytest.raises(SystemExit):
        p.parse_args(["--score-workload", "sharegpt"])  # a chat load is not a scoring load
    # A stream of users runs primed (its first users cached after each reset); the fixed-user
    # loads run from an empty cache as before.
    assert gs.prime_args("post-recommendation-stream") == ["--prime-prefixes"]
    assert gs.prime_args("post-recommendation") == [] and gs.prime_args("mixed") == []


def test_parts_past_the_deadline_are_skipped_and_recorded(tmp_path: Path) -> None:
    # A deadline shorter than the start-up estimate: nothing starts, everything is recorded.
    rc = gs.main(
        [
            "--smoke",
            "--models",
            "random:tiny",
            "--port",
            str(_free_port()),
            "--out-dir",
            str(tmp_path),
            "--deadline-s",
            "5",
            "--start-s",
            "60",
        ]
    )
    res = json.loads(next(tmp_path.glob("partition-*.json")).read_text())
    assert rc == 0
    assert res["skipped"] and res["skipped"][0].startswith("random:tiny/start")
    assert res["summary"]["throughput_ratio_auto_vs_off"] is None
