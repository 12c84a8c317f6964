"""bench.late_answers: a search's step trace against its clients' answers (synthetic)."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.late_answers import late_answers, main


def _search(held_back: bool, offset_s: float = -0.010) -> tuple[list[dict], list[float]]:
    """Twenty one-request steps 0.6 s apart, every fifth followed by a gated 20k-token step;
    each answer arrives 2 ms after its step was applied (the trace's clock `offset_s` off),
    or, when `held_back`, the answers of the steps before a gated one 0.45 s later."""
    steps, answers = [], []
    t = 1000.0
    for i in range(20):
        gated_next = i % 5 == 4
        steps.append(
            {
                "num_prefill_seqs": 1,
                "num_prefill_tokens": 20_000 if i % 5 == 0 else 9_000,
                "end_unix_s": t - offset_s,
            }
        )
        answers.append(t + 0.002 + (0.45 if held_back and gated_next else 0.0))
        t += 0.6
    steps.append({"num_prefill_seqs": 1, "num_prefill_tokens": 20_000, "end_unix_s": t})
    answers.append(t + 1.0)
    return steps, answers


def test_held_back_answers_before_a_gated_step_are_counted_late() -> None:
    res = late_answers(*_search(held_back=True))
    assert res["clock_offset_ms"] == pytest.approx(-8.0, abs=0.5)
    assert res["before_gated"]["num_steps"] == 4 and res["before_gated"]["num_within"] == 0
    assert res["before_gated"]["late_ms_p50"] == pytest.approx(450.0, abs=1.0)
    assert res["other"]["num_within"] == res["other"]["num_steps"] == 16


def test_answers_delivered_at_once_are_within_the_window(tmp_path, capsys) -> None:
    steps, answers = _search(held_back=False)
    res = late_answers(steps, answers)
    assert res["before_gated"]["num_within"] == 4 and res["before_gated"]["late_ms_p50"] is None
    # The command line reads a search's two files.
    (tmp_path / "s.steps.json.gz").write_bytes(gzip.compress(json.dumps({"steps": steps}).encode()))
    record = {
        "runs": [
            {"requests": [{"start_unix_s": a - 0.5, "ttft_s": 0.5, "ok": True} for a in answers]}
        ]
    }
    (tmp_path / "s.json.gz").write_bytes(gzip.compress(json.dumps(record).encode()))
    main([str(tmp_path / "s.steps.json.gz")])
    assert '"num_within": 4' in capsys.readouterr().out


def test_its_gate_is_the_runners() -> None:
    # bench.late_answers keeps a copy (it stays free of torch); this test reads both.
    from bench.late_answers import GATED_TOKENS
    from runtime.runner import INTERRUPT_GATE_MIN_TOKENS

    assert GATED_TOKENS == INTERRUPT_GATE_MIN_TOKENS
