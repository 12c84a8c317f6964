"""bench.step_fit: which terms a mixed step's time needs, on synthetic traces."""

from __future__ import annotations

import json
import random

import pytest

from bench import step_fit


def _steps(n: int = 400) -> list[dict]:
    """Mixed steps whose time has a decode-batch term the engine's prediction lacks (as
    suspected on the H200): 8 ms + 0.01 ms a prefill token + 0.4 ms a decode, 2 % noise."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        tokens, decodes = rng.randint(128, 4096), rng.randint(1, 48)
        ctx = rng.randint(0, 12000)
        true_ms = 8.0 + 0.01 * tokens + 0.4 * decodes
        out.append(
            {
                "age_s": (n - i) * 0.05,
                "on_split": False,
                "num_decodes": decodes,
                "decode_context_tokens": decodes * rng.randint(200, 2000),
                "num_prefill_seqs": 1,
                "num_prefill_tokens": tokens,
                "prefill_context_tokens": ctx,
                "prefill_attention_pairs": tokens * (ctx + tokens / 2),
                "device_ms": true_ms * rng.uniform(0.98, 1.02),
                "idle_before_ms": 0.1,
                "predicted_ms": 8.0 + 0.01 * tokens + 0.4 * 24,  # a mean decode batch
            }
        )
    # Steps the fit must leave out: decode-only, prefill-only, on a split, unmeasured.
    out += [
        {**out[0], "num_prefill_tokens": 0},
        {**out[0], "num_decodes": 0},
        {**out[0], "on_split": True},
        {**out[0], "device_ms": None},
    ]
    return out


def test_the_missing_decode_term_shows_in_the_tail() -> None:
    res = step_fit.fit(_steps())
    assert res["num_mixed_steps"] == 400
    models = res["models"]
    assert models["+decodes"]["mape"] < 0.02 and models["+decodes"]["ratio_p99"] < 1.05
    assert models["+decodes"]["coefficients"]["num_decodes"] == pytest.approx(0.4, rel=0.1)
    # The engine's mean-batch prediction and a prefill-only fit miss single steps by far more.
    assert models["engine"]["ratio_p99"] > 1.15 and models["prefill"]["ratio_p99"] > 1.1
    assert models["engine"]["mape"] > 3 * models["+decodes"]["mape"]


def test_too_few_steps_say_so_and_the_cli_writes_json(tmp_path, capsys) -> None:  # noqa: ANN001
    assert "error" in step_fit.fit(_steps(6))
    trace = tmp_path / "side.steps.json"
    trace.write_text(json.dumps({"steps": _steps(100)}))
    out = tmp_path / "fit.json"
    assert step_fit.main([str(trace), "--json", str(out)]) == 0
    assert "+decodes" in capsys.readouterr().out
    assert json.loads(out.read_text())["side.steps.json"]["num_mixed_steps"] == 100


def test_host_gaps_and_the_collector() -> None:
    steps = _steps(40)
    steps[5]["idle_before_ms"] = 101.0
    steps[5]["gc_ms"] = 97.0  # the collector's pause made it
    steps[9]["idle_before_ms"] = 35.0
    steps[9]["gc_ms"] = 0.0  # something else did
    g = step_fit.host_gaps(steps)
    assert g["num_gaps"] == 2 and g["max_gap_ms"] == 101.0
    assert g["num_with_gc_pause"] == 1 and g["gc_traced"]
    old = step_fit.host_gaps(_steps(40))  # a trace from before gc_ms
    assert old == {
        "over_ms": step_fit.HOST_GAP_MS,
        "num_gaps": 0,
        "max_gap_ms": None,
        "num_with_gc_pause": 0,
        "gc_traced": False,
    }
