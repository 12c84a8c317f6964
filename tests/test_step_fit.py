"""bench.step_fit: which terms a mixed step's time needs, on synthetic traces."""

from __future__ import annotations

import json
import random

import numpy as np
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


def test_host_pace_reads_the_steps_the_device_waited_on_the_host_for() -> None:
    steps = _steps(40)
    assert step_fit.host_pace(steps) == {"num_steps": 0}  # a trace from before host times
    for i, s in enumerate(steps[:40]):  # (the four after them are not mixed whole steps)
        s["plan_ms"] = 0.1
        # every fourth step took as long to launch as to run; the others a tenth of it
        s["launch_ms"] = s["device_ms"] * (0.95 if i % 4 == 0 else 0.1)
    h = step_fit.host_pace(steps)
    assert h["num_steps"] == 40 and h["host_paced_fraction"] == pytest.approx(0.25)
    assert h["launch_over_device_p50"] == pytest.approx(0.1) and h["plan_ms_p50"] == 0.1
    assert step_fit.fit(steps)["host_pace"] == h


def test_online_fit_learns_a_linear_step_and_uses_only_the_past() -> None:
    rng = random.Random(1)
    x = np.array([[1.0, rng.randint(1, 48), rng.randint(16, 2048)] for _ in range(300)])
    y = 3.0 + 0.2 * x[:, 1] + 0.01 * x[:, 2]
    pred = step_fit.online_predictions(x, y, warmup=20)
    assert (pred[:20] == 0).all()  # nothing predicted before the warm-up
    assert np.abs(pred[100:] - y[100:]).max() / y[100:].min() < 1e-3
    # Only the past: a step's own time does not move its prediction.
    y2 = y.copy()
    y2[150] *= 3.0
    pred2 = step_fit.online_predictions(x, y2, warmup=20)
    assert pred2[150] == pytest.approx(pred[150], rel=1e-9)
    assert pred2[151] != pytest.approx(pred[151], rel=1e-6)


def test_same_shape_floor_reads_the_noise_that_no_shape_explains() -> None:
    rng = random.Random(2)
    steps = []
    for shape in range(6):
        for _ in range(20):
            # Identical shapes; the time varies by ±20 % uniformly (mean |error| ~10 %).
            steps.append(
                {
                    "num_decodes": 2,
                    "num_prefill_seqs": 1,
                    "num_prefill_tokens": 150 * (shape + 1),
                    "prefill_context_tokens": 14000,
                    "decode_context_tokens": 1200,
                    "device_ms": 10.0 * (shape + 1) * rng.uniform(0.8, 1.2),
                    "chunked_predicted_ms": 10.0 * (shape + 1),
                }
            )
    steps.append({**steps[0], "num_prefill_tokens": 5000})  # a shape of one step: left out
    floor = step_fit.same_shape_floor(steps)
    assert floor["num_shapes"] == 6
    assert floor["peers_median"]["num_steps"] == 120
    assert 0.06 < floor["peers_median"]["mape"] < 0.14
    # The engine's prediction (here each shape's true mean) is read from the chunked field.
    assert floor["engine_same_steps"]["num_steps"] == 120
    assert abs(floor["engine_same_steps"]["mape"] - floor["peers_median"]["mape"]) < 0.03


def test_cli_pools_the_floor_over_files_and_names_its_source(tmp_path) -> None:  # noqa: ANN001
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"side{i}.steps.json")
        paths[-1].write_text(json.dumps({"steps": _steps(100)}))
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"git_revision": "abc1234", "device": "NVIDIA H200", "date": "d"}))
    out = tmp_path / "fit.json"
    assert step_fit.main([*map(str, paths), "--json", str(out), "--source", str(src)]) == 0
    res = json.loads(out.read_text())
    assert res["source"] == {"git_revision": "abc1234", "device": "NVIDIA H200", "date": "d"}
    assert res["all files"]["num_mixed_steps"] == 200
    assert "online" in res["side0.steps.json"]["models"]
    assert "bench.step_fit" in res["command"]


def test_corrected_replay_scores_the_engines_correction_before_it_learns(tmp_path) -> None:  # noqa: ANN001
    """Decode-only steps set the base; mixed steps cost base + 4 ms + 2x the JCT marginal:
    the replayed `CorrectedCost` starts wrong and learns it, scored before each observation."""
    jct = step_fit.JctLine(b_s_per_token=1e-5, k_s_per_pair=0.0)
    steps = []
    for i in range(200):
        if i % 2 == 0:
            steps.append({"num_decodes": 4, "num_prefill_tokens": 0, "device_ms": 3.0})
        else:
            n = (150, 2000, 600)[i % 3]
            steps.append(
                {
                    "num_decodes": 4,
                    "num_prefill_seqs": 1,
                    "num_prefill_tokens": n,
                    "prefill_attention_pairs": 0.0,
                    "prefill_context_tokens": 0,
                    "device_ms": 3.0 + 4.0 + 2.0 * 1e-2 * n,
                }
            )
    pred = step_fit.corrected_replay(steps, jct)
    first, last = min(pred), max(pred)
    assert abs(pred[first] - steps[first]["device_ms"]) > 1.0  # before anything was learned
    assert pred[last] == pytest.approx(steps[last]["device_ms"], rel=0.01)
    assert all(steps[i]["num_prefill_tokens"] for i in pred)  # mixed steps only
    log = tmp_path / "server.log"
    log.write_text("JCTModel(a_s=0.004756, b_s_per_token=6.695e-06, k_s_per_pair=5.844e-10)\n")
    assert step_fit.jct_from_log(log) == step_fit.JctLine(6.695e-06, 5.844e-10)
    trace = tmp_path / "side.steps.json"
    trace.write_text(json.dumps({"steps": steps}))
    out = tmp_path / "fit.json"
    assert step_fit.main([str(trace), "--jct-log", str(log), "--json", str(out)]) == 0
    models = json.loads(out.read_text())["side.steps.json"]["models"]
    assert models["corrected"]["num_steps"] > 90
    # No cached prefixes in these steps: the context term never enters, both replays agree.
    assert models["corrected-no-context"] == models["corrected"]


def test_corrected_replay_takes_the_decode_base_the_engine_recorded() -> None:
    """A trace with `decode_base_ms` replays the engine's own base (the cost model's decode on
    a calibrated GPU), not the decode-only line; here no decode-only step precedes at all,
    and the base the engine used differs from step to step."""
    jct = step_fit.JctLine(b_s_per_token=1e-5, k_s_per_pair=0.0)
    steps = []
    for i in range(120):
        n, base_ms = (150, 2000, 600)[i % 3], (3.0, 9.0)[i % 2]
        steps.append(
            {
                "num_decodes": 4 + 10 * (i % 2),
                "num_prefill_seqs": 1,
                "num_prefill_tokens": n,
                "prefill_attention_pairs": 0.0,
                "prefill_context_tokens": 0,
                "decode_base_ms": base_ms,
                "device_ms": base_ms + 4.0 + 2.0 * 1e-2 * n,
            }
        )
    pred = step_fit.corrected_replay(steps, jct)
    assert min(pred) == 0  # scored from the first step: the base needs no decode-only steps
    last = max(pred)
    assert pred[last] == pytest.approx(steps[last]["device_ms"], rel=0.01)
    without = [{k: v for k, v in s.items() if k != "decode_base_ms"} for s in steps]
    assert step_fit.corrected_replay(without, jct) == {}  # no base to replay on


def test_short_steps_picks_short_suffixes_after_a_long_cached_prefix() -> None:
    steps = _steps(40)
    assert step_fit.short_steps(steps) == {"num_steps": 0}  # a trace from before host times
    for i, s in enumerate(steps[:40]):
        s["plan_ms"], s["launch_ms"] = 0.5, 4.0
        if i % 3:  # two in three waited 3.0 ms of their launch for the device
            s["launch_wait_ms"] = 3.0
        s["idle_before_ms"] = 1.0 if i % 2 else 3.0
        if i < 10:  # ten short suffixes after a long prefix; the rest keep their shapes
            s["num_prefill_tokens"] = step_fit.SHORT_STEP_TOKENS - 1
            s["prefill_context_tokens"] = step_fit.SHORT_STEP_CONTEXT
            s["device_ms"] = 8.0 + i
        else:  # (the random shapes may hold a short one)
            s["num_prefill_tokens"] = max(s["num_prefill_tokens"], step_fit.SHORT_STEP_TOKENS)
    steps[1]["prefill_context_tokens"] = step_fit.SHORT_STEP_CONTEXT - 1  # not long enough
    sh = step_fit.short_steps(steps)
    assert sh["num_steps"] == 9 and sh["share_of_mixed"] == pytest.approx(9 / 40)
    assert sh["device_ms_p50"] == pytest.approx(13.0)  # 8, 10, 11, ..., 17
    assert sh["launch_ms_p50"] == 4.0 and sh["plan_ms_p50"] == 0.5
    # The host's own launch time, over the short steps with a recorded wait (i = 2, 4, 5, 7, 8).
    assert sh["launch_host_ms_p50"] == pytest.approx(1.0)
    assert sh["idle_before_ms_p50"] == pytest.approx(3.0)  # five 3.0 (even i) of nine
    assert step_fit.fit(steps)["short_steps"] == sh
