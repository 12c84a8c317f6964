"""Metric arithmetic against hand-computed timings (vllm bench serve definitions)."""

from __future__ import annotations

import pytest

from bench.metrics import SLO, RequestResult, compute_metrics, meets_p99_slo, summarize_ms


def _ok(rid: str, ttft_s: float, e2el_s: float, out: int, itl: list[float], prompt: int):
    return RequestResult(
        rid,
        "chat",
        success=True,
        ttft_s=ttft_s,
        e2el_s=e2el_s,
        itl_s=itl,
        num_prompt_tokens=prompt,
        num_output_tokens=out,
        expected_output_tokens=out,
        output_tokens_from_usage=True,
    )


@pytest.fixture
def results() -> list[RequestResult]:
    return [
        _ok("a", 0.1, 0.5, 5, [0.1] * 4, 10),  # TPOT (0.5 - 0.1) / 4 = 0.1 s
        _ok("b", 0.2, 2.2, 11, [0.2] * 10, 20),  # TPOT (2.2 - 0.2) / 10 = 0.2 s
        _ok("c", 0.3, 0.3, 1, [], 30),  # one output token: no TPOT
        RequestResult(
            "d", "chat", success=False, error="HTTP 503: overloaded", num_prompt_tokens=40
        ),
    ]


def test_latency_percentiles_by_hand(results):
    m = compute_metrics(results, duration_s=2.0)
    # TTFT 100, 200, 300 ms; linear interpolation: p90 at rank 1.8, p99 at rank 1.98.
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(280.0)
    assert m["ttft_ms"]["p99"] == pytest.approx(298.0)
    # TPOT only over requests with > 1 output token: 100, 200 ms.
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert m["tpot_ms"]["median"] == pytest.approx(150.0)
    assert m["tpot_ms"]["p90"] == pytest.approx(190.0)
    assert m["tpot_ms"]["p99"] == pytest.approx(199.0)
    # ITL pooled over requests: 4 x 100 ms and 10 x 200 ms.
    assert m["itl_ms"]["mean"] == pytest.approx(2400.0 / 14)
    assert m["itl_ms"]["median"] == pytest.approx(200.0)
    assert m["itl_ms"]["p99"] == pytest.approx(200.0)
    # E2EL 300, 500, 2200 ms.
    assert m["e2el_ms"]["mean"] == pytest.approx(1000.0)
    assert m["e2el_ms"]["median"] == pytest.approx(500.0)
    assert m["e2el_ms"]["p90"] == pytest.approx(1860.0)
    assert m["e2el_ms"]["p99"] == pytest.approx(2166.0)


def test_counts_and_throughput_by_hand(results):
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["failure_reasons"] == {"HTTP 503: overloaded": 1}
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["total_input_tokens"] == 60  # failed requests do not count
    assert m["total_output_tokens"] == 17
    assert m["output_throughput"] == pytest.approx(8.5)
    assert m["total_token_throughput"] == pytest.approx(38.5)
    assert m["output_len_exact_fraction"] == 1.0
    assert "goodput" not in m  # only with an SLO


def test_goodput_by_hand(results):
    m = compute_metrics(results, 2.0, SLO(ttft_ms=250, tpot_ms=150))
    # a: ttft 100, tpot 100 -> good; b: tpot 200 -> bad; c: ttft 300 -> bad; d failed.
    assert m["goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(0.25)
    m = compute_metrics(results, 2.0, SLO(e2el_ms=600))
    assert m["goodput"] == pytest.approx(1.0)  # a (500 ms) and c (300 ms)
    m = compute_metrics(results, 2.0, SLO(tpot_ms=150))
    # c has one output token: no TPOT, so it meets a TPOT-only SLO.
    assert m["goodput"] == pytest.approx(1.0)


def test_scoring_results_have_no_tpot_or_itl():
    r = RequestResult("s", "score", success=True, ttft_s=0.05, e2el_s=0.05, num_output_tokens=1)
    m = compute_metrics([r], 1.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(50.0) == m["e2el_ms"]["mean"]
    assert m["tpot_ms"]["mean"] is None and m["itl_ms"]["p99"] is None


def test_empty_and_all_failed():
    assert summarize_ms([])["p99"] is None
    m = compute_metrics([RequestResult("x", "chat", error="timeout after 1s")], 1.0, SLO(ttft_ms=1))
    assert m["completed"] == 0 and m["goodput"] == 0.0
    assert not meets_p99_slo(m, SLO(ttft_ms=1))


def test_slo_parse_and_p99_check(results):
    assert SLO.parse("ttft:500,tpot:50") == SLO(ttft_ms=500, tpot_ms=50)
    assert SLO.parse("e2el:2000").as_dict() == {"e2el_ms": 2000}
    assert SLO.parse(None) is None
    with pytest.raises(ValueError):
        SLO.parse("latency:5")
    ok = [r for r in results if r.success]
    m = compute_metrics(ok, 2.0)
    assert meets_p99_slo(m, SLO(ttft_ms=300, tpot_ms=200))  # P99s 298 and 199
    assert not meets_p99_slo(m, SLO(ttft_ms=297))
    assert not meets_p99_slo(compute_metrics(results, 2.0), SLO(ttft_ms=300))  # one failure
    assert meets_p99_slo(compute_metrics(results, 2.0), SLO(ttft_ms=300), max_failed_fraction=0.25)


def test_tbt_slo_bounds_inter_token_gaps(results):
    """TBT (issue 6's SLO) bounds the P99 of pooled gaps; per request, its own P99 gap."""
    slo = SLO.parse("ttft:1000,tbt:150")
    assert slo == SLO(ttft_ms=1000, tbt_ms=150)
    assert slo.as_dict() == {"ttft_ms": 1000, "tbt_ms": 150}
    ok = [r for r in results if r.success]
    m = compute_metrics(ok, 2.0, slo)
    # Pooled gaps: 4 x 100 ms and 10 x 200 ms -> P99 200 ms.
    assert not meets_p99_slo(m, slo)
    assert meets_p99_slo(m, SLO(tbt_ms=200))
    # Per request: a (gaps 100) and c (no gaps) meet it, b (gaps 200) does not.
    assert m["goodput"] == pytest.approx(1.0) and m["slo_attainment"] == pytest.approx(2 / 3)
    # A long request with one slow gap among many fast ones meets a per-request P99 bound only
    # if the slow gap is outside its 99th percentile.
    spiky = _ok("e", 0.1, 3.0, 201, [0.01] * 199 + [0.5], 10)
    assert SLO(tbt_ms=100).met_by(spiky)
    spikier = _ok("f", 0.1, 3.0, 201, [0.01] * 190 + [0.5] * 10, 10)
    assert not SLO(tbt_ms=100).met_by(spikier)


def test_steady_state_counts_tokens_while_the_closed_loop_was_full() -> None:
    """Two slots. a: sent at 0, tokens at 1, 2, 3, 4; b: sent at 0, tokens at 1, 2 (ends at 2);
    c: sent at 2 into b's slot, tokens at 3 to 8. The loop is full from 0 and its last send is
    c's at 2: the window [0, 2) holds a's and b's tokens at 1, 2 tokens in 2 s. The drain after
    it (c alone from 4 to 8) is left out."""
    from bench.metrics import steady_state

    def sent(rid: str, send_s: float, token_times: list[float], tokens: int) -> RequestResult:
        r = _ok(rid, token_times[0] - send_s, token_times[-1] - send_s, tokens, [], 10)
        r.send_s = send_s
        r.itl_s = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        return r

    res = [
        sent("a", 0.0, [1, 2, 3, 4], 4),
        sent("b", 0.0, [1, 2], 2),
        sent("c", 2.0, [3, 4, 5, 6, 7, 8], 6),
    ]
    steady = steady_state(res, 2, duration_s=8.0)
    assert steady is not None
    assert steady["window_s"] == [0.0, 2.0]
    assert steady["output_throughput"] == pytest.approx(2 / 2.0)  # a@1, b@1
    assert steady["fraction_of_run"] == pytest.approx(0.25)
    # Chunks of two tokens each count two: the same times, twice the tokens.
    res[0].num_output_tokens, res[1].num_output_tokens = 8, 4
    assert steady_state(res, 2, 8.0)["output_throughput"] == pytest.approx(4 / 2.0)
    # A loop that never filled (three slots), or filled only at its last send: nothing.
    assert steady_state(res, 3, 8.0) is None
    assert steady_state(res[:2], 2, 8.0) is None
    # compute_metrics reports it for a closed loop only.
    assert compute_metrics(res, 8.0, max_concurrency=2)["steady_state"] == steady_state(res, 2, 8.0)
    assert "steady_state" not in compute_metrics(res, 8.0)


def test_a_mixed_run_reports_each_source_alone() -> None:
    chat = [_ok(f"c{i}", 0.1, 0.5, 5, [0.1] * 4, 100) for i in range(3)]
    long = [_ok(f"l{i}", 2.0 + i, 3.0 + i, 2, [1.0], 8000) for i in range(2)]
    for r in chat:
        r.source = "sharegpt"
    for r in long:
        r.source = "long-data"
    lost = RequestResult("x", "chat", source="long-data", success=False, error="timeout")
    m = compute_metrics([*chat, *long, lost], duration_s=5.0)
    parts = m["by_source"]
    assert set(parts) == {"sharegpt", "long-data"}
    assert parts["sharegpt"]["completed"] == 3 and parts["sharegpt"]["failed"] == 0
    assert parts["sharegpt"]["ttft_ms"]["p99"] == pytest.approx(100.0)
    assert parts["sharegpt"]["itl_ms"]["p99"] == pytest.approx(100.0)
    assert parts["long-data"]["completed"] == 2 and parts["long-data"]["failed"] == 1
    assert parts["long-data"]["ttft_ms"]["mean"] == pytest.approx(2500.0)
    assert parts["long-data"]["prompt_tokens_mean"] == pytest.approx(8000.0)
    # One source: no breakdown (the pooled figures are that source's).
    assert "by_source" not in compute_metrics(chat, duration_s=1.0)


def test_gap_tail_counts_long_gaps_and_the_excess_by_hand() -> None:
    from bench.metrics import gap_tail

    gaps = [0.005] * 96 + [0.030, 0.060, 0.150, 0.250]  # 100 gaps, median 5 ms
    tail = gap_tail(gaps)
    assert tail["num_gaps"] == 100
    assert tail["over_ms"] == {"25": 0.04, "50": 0.03, "100": 0.02, "200": 0.01}
    assert tail["max_ms"] == pytest.approx(250.0)
    # (30 - 5) + (60 - 5) + (150 - 5) + (250 - 5) ms
    assert tail["excess_over_median_s"] == pytest.approx(0.470)
    assert gap_tail([])["num_gaps"] == 0
    m = compute_metrics([_ok("a", 0.1, 0.5, 5, [0.1] * 4, 10)], duration_s=1.0)
    assert m["itl_tail"]["over_ms"]["50"] == 1.0


def test_stalls_count_a_step_once_however_many_streams_it_held() -> None:
    from bench.metrics import RequestResult, stalls

    def stream(send_s: float, gaps: list[float]) -> RequestResult:
        return RequestResult("r", "chat", success=True, send_s=send_s, ttft_s=0.0, itl_s=gaps)

    # Three streams decode at 5 ms a token; one 80 ms step holds all three (their gaps end
    # 1 and 2 ms apart: the client reads each stream in turn), then 60 ms later a 30 ms step
    # holds two of them.
    a = stream(0.000, [0.005] * 10 + [0.080] + [0.005] * 12 + [0.030] + [0.005] * 5)
    b = stream(0.001, [0.005] * 10 + [0.080] + [0.005] * 12 + [0.030] + [0.005] * 5)
    c = stream(0.002, [0.005] * 10 + [0.080] + [0.005] * 5)
    got = stalls([a, b, c])
    assert got["over_ms"] == {"25": 2, "50": 1, "100": 0, "200": 0}
    assert got["held_s"]["25"] == pytest.approx(0.110)
    assert got["held_s"]["50"] == pytest.approx(0.080)
    assert got["held_s"]["100"] == 0.0
    # Two different 60 ms steps 100 ms apart on one stream are two stalls.
    two = stalls([stream(0.0, [0.005, 0.060, 0.005] + [0.005] * 7 + [0.060])])
    assert two["over_ms"]["50"] == 2 and two["held_s"]["50"] == pytest.approx(0.120)
    assert stalls([])["over_ms"]["25"] == 0
    # In the run's metrics, beside the gap fractions.
    assert compute_metrics([a, b, c], duration_s=1.0)["stalls"]["over_ms"]["50"] == 1
