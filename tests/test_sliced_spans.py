"""bench/sliced_spans.py: a layer-sliced prompt's span, the steps between its slices, and the
whole step of the same tokens in another side's trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sliced_spans import main, sliced_prompts, start_detail_cell, summary, whole_step_ms


def _step(age_s: float, device_ms: float, **kw: object) -> dict[str, object]:
    return {
        "age_s": age_s,
        "device_ms": device_ms,
        "num_prefill_tokens": 0,
        "num_prefill_seqs": 0,
        "num_decodes": 4,
        "layer_sliced_span_ms": None,
        "decode_gap_ms": None,
        **kw,
    }


def _trace() -> list[dict[str, object]]:
    # A 1,000-token prompt in slices from 10.0 s ago to 9.0 s ago (ages count back from the
    # trace): three decode steps ended inside its span, one before it and one after.
    return [
        _step(10.5, 5.0),  # before the span
        _step(9.8, 6.0, decode_gap_ms=70.0, slice_promised_ms=80.0),
        _step(9.5, 6.0, decode_gap_ms=64.0, slice_promised_ms=80.0),
        _step(9.2, 8.0, num_prefill_tokens=100, num_prefill_seqs=1, decode_gap_ms=2.0),
        _step(
            9.0,
            900.0,
            num_prefill_tokens=1000,
            num_prefill_seqs=1,
            layer_sliced_span_ms=1000.0,
            layer_sliced_predicted_ms=950.0,
        ),
        _step(8.5, 5.0),  # after it
    ]


def test_a_sliced_prompt_counts_the_steps_that_ended_inside_its_span() -> None:
    whole = {1000: 800.0}
    (rec,) = sliced_prompts(_trace(), whole)
    assert rec["tokens"] == 1000 and rec["span_ms"] == 1000.0
    assert rec["steps_between"] == 3 and rec["between_ms"] == 20.0
    assert rec["prefill_ms"] == 980.0
    assert rec["waited_ms_p50"] == 70.0 and rec["waited_ms_max"] == 76.0
    # Only the two steps behind a slice carry a promise: waited 76 and 70 against 80.
    assert rec["num_promised"] == 2 and rec["promised_ms"] == [80.0, 80.0]
    assert rec["waited_over_promised_max"] == pytest.approx(0.95)
    assert rec["span_over_whole"] == 1.25 and rec["prefill_over_whole"] == pytest.approx(1.225)
    s = summary([rec])
    assert s["num_prompts"] == 1 and s["between_share_of_span"] == 0.02
    assert s["span_over_whole_p50"] == 1.25


def test_a_sliced_prompt_carries_the_host_time_of_the_launch_that_started_it() -> None:
    """The start's launch (the step with `launch_parts_ms` nearest the span's start, within
    0.1 s): its launch_ms and parts; traces from before that field carry none."""
    assert "start_launch_ms" not in sliced_prompts(_trace())[0]
    parts = {"choose": 0.5, "build": 6.0, "plan_embed": 3.0, "decode": 1.5, "first_slice": 20.0}
    trace = _trace()
    # The decode step launched beside the first slice ended 4 ms after the start (10.0 s ago).
    start = _step(9.996, 5.0, decode_gap_ms=0.3, launch_ms=31.0, launch_parts_ms=parts)
    (rec,) = sliced_prompts([*trace[:1], start, *trace[1:]])
    assert rec["start_launch_ms"] == 31.0 and rec["start_parts_ms"] == parts
    assert "start_detail" not in rec  # a trace from before `launch_detail`
    detail = {"allocs": {"first_slice": {"mallocs": 2, "retries": 1}}, "slowest_piece": {}}
    (rec,) = sliced_prompts([*trace[:1], {**start, "launch_detail": detail}, *trace[1:]])
    assert rec["start_detail"] == detail
    # The table's cell: the slowest piece, then the first slice's allocator calls.
    piece = {"layer": 1, "row_start": 2048, "rows": 184, "host_ms": 80.04, "num_pieces": 33}
    first = {"mallocs": 2, "frees": 0, "retries": 1, "syncs": 1}
    cell = start_detail_cell({"slowest_piece": piece, "allocs": {"first_slice": first}})
    assert cell == "L1:2048+184 80.0ms/33 m2 f0 r1 s1"
    whole_layers = {"layer": 0, "layers": 2, "host_ms": 3.0, "num_pieces": 1}
    assert start_detail_cell({"slowest_piece": whole_layers}) == "L0+2 3.0ms/1"
    assert start_detail_cell(None) == "-"
    # Read 2 ms older than the start (the prompt's row applied after its last slice ended):
    # still its start; a launch 0.5 s before it is another prompt's.
    early = {**start, "age_s": 10.002}
    assert sliced_prompts([*trace[:1], early, *trace[1:]])[0]["start_launch_ms"] == 31.0
    other = {**trace[0], "launch_ms": 9.0, "launch_parts_ms": parts}  # 10.5 s ago
    assert "start_launch_ms" not in sliced_prompts([other, *trace[1:]])[0]


def test_the_whole_steps_are_single_prompt_steps_without_slices() -> None:
    steps = [
        _step(3.0, 800.0, num_prefill_tokens=1000, num_prefill_seqs=1),
        _step(2.0, 50.0, num_prefill_tokens=300, num_prefill_seqs=2),  # a batch: not whole
        *_trace(),  # its sliced prompt is no whole step
    ]
    assert whole_step_ms(steps) == {1000: 800.0, 100: 8.0}


def test_the_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sliced, off = tmp_path / "auto.steps.json", tmp_path / "off.steps.json"
    sliced.write_text(json.dumps({"steps": _trace()}))
    off.write_text(
        json.dumps({"steps": [_step(1.0, 800.0, num_prefill_tokens=1000, num_prefill_seqs=1)]})
    )
    assert main([str(sliced), "--whole", str(off), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["num_matched"] == 1 and out["prompts"][0]["whole_ms"] == 800.0
