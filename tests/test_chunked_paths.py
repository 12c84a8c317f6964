"""bench.chunked_paths: the path a mixed step ran, and the per-path factor scored causally."""

from __future__ import annotations

import pytest

from bench import chunked_paths as cp


def step(n: int, decodes: int, seqs: int, measured: float, predicted: float | None) -> dict:
    return {
        "num_prefill_tokens": n,
        "num_decodes": decodes,
        "num_prefill_seqs": seqs,
        "device_ms": measured,
        "predicted_ms": predicted,
        "on_split": False,
    }


def test_paths_follow_the_runner() -> None:
    assert cp.path_of(step(900, 100, 2, 1, 1), 2048, 1024) == "merged"
    assert cp.path_of(step(1000, 100, 1, 1, 1), 2048, 1024) == "plain"
    assert cp.path_of(step(2049, 0, 1, 1, 1), 2048, 1024) == "rows"
    assert cp.path_of(step(2049, 0, 2, 1, 1), 2048, 1024) == "whole_t"


def test_the_factor_is_scored_before_it_learns() -> None:
    # A path measured 1.5x its prediction every time: the first step scores the engine's
    # error (a third), the factor then moves a fifth of the way each step.
    steps = [step(3000, 10, 1, 30.0, 20.0) for _ in range(3)] + [step(10, 0, 1, 5.0, None)]
    r = cp.summarize(steps, 2048, 1024)
    assert r["num_steps"] == 4 and r["num_predicted"] == 3
    assert r["mape_engine"] == pytest.approx(1 / 3, abs=1e-4)
    f = [1.0, 1.1, 1.18]  # 0.8 * f + 0.2 * 1.5
    want = sum(abs(20 * x - 30) / 30 for x in f) / 3
    assert r["mape_per_path_factor"] == pytest.approx(want, abs=1e-4)
    assert r["paths"]["rows"]["measured_over_predicted_p10_50_90"][1] == 1.5
    assert r["paths"]["merged"]["measured_over_predicted_p10_50_90"] is None


def test_long_steps_are_chunks_beside_decodes() -> None:
    # Only steps over the graphs' range, beside decodes, with a prediction.
    steps = [
        step(3000, 10, 1, 50.0, 60.0),
        step(2000, 5, 1, 40.0, 50.0),
        step(4000, 20, 1, 70.0, 70.0),
        step(3000, 0, 1, 90.0, 90.0),  # no decodes: nothing was cut to a target
        step(500, 10, 1, 9.0, 10.0),  # a merged step
        step(3000, 10, 1, 99.0, None),  # not predicted
    ]
    ls = cp.summarize(steps, 2048, 1024)["long_steps"]
    assert ls == {"num_steps": 3, "planned_ms_p50": 60.0, "measured_ms_p50": 50.0}
