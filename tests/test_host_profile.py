"""bench.host_profile's reading of py-spy's raw samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.host_profile import summarize_raw


def test_summarize_raw_counts_own_samples_at_the_leaf_and_each_frame_once_a_stack(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "pyspy.txt"
    raw.write_text(
        "loop (engine.py:1);launch (runner.py:2);run (fi.py:3) 6\n"
        "loop (engine.py:1);launch (runner.py:2) 2\n"
        # a recursive frame appears twice in one stack: counted once below it
        "loop (engine.py:1);plan (sched.py:4);plan (sched.py:4) 2\n"
        "not a sample line\n"
    )
    s = summarize_raw(raw)
    assert s["samples"] == 10
    own = {r["frame"]: r["samples"] for r in s["own"]}
    assert own == {"run (fi.py:3)": 6, "launch (runner.py:2)": 2, "plan (sched.py:4)": 2}
    below = {r["frame"]: r["samples"] for r in s["at_or_below"]}
    assert below["loop (engine.py:1)"] == 10
    assert below["launch (runner.py:2)"] == 8
    assert below["plan (sched.py:4)"] == 2
    assert s["own"][0] == {"frame": "run (fi.py:3)", "samples": 6, "share": pytest.approx(0.6)}


def test_step_summary_reads_short_and_decode_steps() -> None:
    from bench.host_profile import step_summary

    decode = {"num_decodes": 8, "num_prefill_tokens": 0, "device_ms": 3.0, "launch_ms": 1.0}
    decode |= {"plan_ms": 0.5, "idle_before_ms": 0.1, "launch_wait_ms": 0.25}
    short = {"num_decodes": 8, "num_prefill_tokens": 150, "prefill_context_tokens": 14_000}
    short |= {"device_ms": 8.0, "launch_ms": 7.0, "plan_ms": 2.0, "idle_before_ms": 1.0}
    long = dict(short, num_prefill_tokens=2048, device_ms=40.0)
    alone = {"num_decodes": 0, "num_prefill_tokens": 300, "num_prefill_seqs": 2}
    alone |= {"device_ms": 20.0, "launch_ms": 6.0, "plan_ms": 1.5, "idle_before_ms": 0.4}
    split = dict(alone, on_split=True, device_ms=99.0)  # a partition's step: not the GPU's
    got = step_summary([decode, decode, short, long, {"num_decodes": 0}, alone, split])
    assert got["num_steps"] == 7
    assert got["prefill_steps"] == {
        "num_steps": 1,
        "device_ms_p50": 20.0,
        "launch_ms_p50": 6.0,
        "launch_wait_ms_p50": None,  # a trace from before the field
        "plan_ms_p50": 1.5,
        "idle_before_ms_p50": 0.4,
        "num_prefill_tokens_p50": 300.0,
        "num_prefill_seqs_p50": 2.0,
    }
    assert got["decode_steps"] == {
        "num_steps": 2,
        "device_ms_p50": 3.0,
        "launch_ms_p50": 1.0,
        "launch_wait_ms_p50": 0.25,
        "plan_ms_p50": 0.5,
        "idle_before_ms_p50": 0.1,
    }
    assert got["short_steps"]["num_steps"] == 1 and got["short_steps"]["plan_ms_p50"] == 2.0


def test_device_load_separates_host_gaps_from_idle_and_prices_batches_per_request() -> None:
    from bench.host_profile import device_load

    def prefill(seqs: int, device_ms: float, idle_ms: float) -> dict:
        return {
            "num_decodes": 0,
            "num_prefill_seqs": seqs,
            "num_prefill_tokens": 16 * seqs,
            "prefill_context_tokens": 14_000 * seqs,
            "device_ms": device_ms,
            "idle_before_ms": idle_ms,
        }

    steps = [
        prefill(1, 10.0, 2.0),
        prefill(40, 300.0, 1.0),
        prefill(40, 340.0, 3000.0),  # a drained queue before it: not the host's gap
        prefill(4, 30.0, 1.0),
        dict(prefill(40, 999.0, 0.0), on_split=True),  # a partition's step
        {"num_decodes": 8, "num_prefill_tokens": 0, "device_ms": 6.0, "idle_before_ms": 0.5},
        {"num_decodes": 8, "num_prefill_tokens": 0, "device_ms": None},
    ]
    got = device_load(steps)
    assert got["num_steps"] == 5
    assert got["device_ms"] == 686.0
    assert got["host_gap_ms"] == 4.5
    assert got["no_work_gaps"] == 1 and got["no_work_gap_ms"] == 3000.0
    assert got["busy_share"] == pytest.approx(686.0 / 690.5)
    bands = {tuple(b["num_seqs"]): b for b in got["prefill_by_batch"]}
    assert set(bands) == {(1, 1), (2, 8), (33, 128)}
    assert bands[(33, 128)]["num_steps"] == 2 and bands[(33, 128)]["num_requests"] == 80
    assert bands[(33, 128)]["device_ms_per_seq"] == pytest.approx(640.0 / 80)
    assert bands[(2, 8)]["device_ms_per_seq"] == pytest.approx(7.5)
    assert bands[(1, 1)]["context_tokens_per_seq"] == 14_000
    assert bands[(33, 128)]["new_tokens_per_seq"] == 16
    assert device_load([])["busy_share"] is None
    assert got["gathered_steps"] is None  # a trace from before the field: not known


def test_device_load_counts_the_steps_that_copied_their_contexts() -> None:
    """A step that discarded prompt KV beside prefill context took the backend's gathered path;
    one that discarded without any context (ragged) or kept everything did not."""
    from bench.host_profile import device_load

    base = {"num_decodes": 0, "num_prefill_seqs": 2, "num_prefill_tokens": 300}
    steps = [
        base | {"prefill_context_tokens": 14_000, "prefill_discarded_tokens": 5, "device_ms": 9.0},
        base | {"prefill_context_tokens": 14_000, "prefill_discarded_tokens": 0, "device_ms": 4.0},
        base | {"prefill_context_tokens": 0, "prefill_discarded_tokens": 7, "device_ms": 3.0},
    ]
    got = device_load(steps)
    assert got["gathered_steps"] == 1 and got["gathered_device_ms"] == 9.0


def test_cold_prefill_reads_the_launch_against_the_device_on_cold_single_prompts() -> None:
    from bench.host_profile import device_load

    def step(tokens: int, context: int, seqs: int, device_ms: float, launch_ms: float) -> dict:
        return {
            "num_decodes": 0,
            "num_prefill_seqs": seqs,
            "num_prefill_tokens": tokens,
            "prefill_context_tokens": context,
            "device_ms": device_ms,
            "launch_ms": launch_ms,
        }

    steps = [
        step(10_000, 0, 1, 300.0, 270.0),  # cold, the launch held to the device
        step(14_000, 0, 1, 420.0, 12.0),  # cold, the launch returned at once
        step(12_000, 0, 1, 360.0, 330.0),
        step(150, 14_000, 1, 12.0, 2.0),  # a prefix hit: not cold
        step(300, 0, 2, 20.0, 3.0),  # two prompts: not one alone
        dict(step(9_000, 0, 1, 250.0, 5.0), num_decodes=4),  # beside decodes
    ]
    cold = device_load(steps)["cold_prefill"]
    assert cold["num_steps"] == 3
    assert cold["new_tokens_p50"] == 12_000
    assert cold["device_ms_p50"] == 360.0
    assert cold["device_us_per_token"] == pytest.approx(1000 * 1080.0 / 36_000)
    assert cold["launch_ms_p50"] == 270.0
    assert cold["launch_over_device_p50"] == pytest.approx(270.0 / 300.0)  # of 0.9, 0.03, 0.92
    assert device_load([])["cold_prefill"]["device_ms_p50"] is None


def test_steps_option_summarizes_a_saved_trace(tmp_path, capsys) -> None:
    import gzip
    import json

    from bench.host_profile import main

    trace = {
        "answered_unix_s": 0.0,
        "steps": [
            {
                "num_prefill_seqs": 1,
                "num_prefill_tokens": 8_000,
                "prefill_context_tokens": 0,
                "device_ms": 240.0,
                "launch_ms": 10.0,
                "idle_before_ms": 0.0,
            },
        ],
    }
    path = tmp_path / "s.steps.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    assert main(["--steps", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["num_steps"] == 1 and got["cold_prefill"]["launch_ms_p50"] == 10.0
