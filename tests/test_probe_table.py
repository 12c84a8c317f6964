"""bench.probe_table: per-probe figures from the harness records, chat beside scoring from the
results JSON, and a clear stop when a side is not in that JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.probe_table import main


def _record(qps: float) -> dict:
    ttft = {"median": 20.0, "p99": 900.0}
    metrics = {
        "ttft_ms": ttft,
        "itl_ms": None,
        "output_throughput": qps,
        "total_token_throughput": 1000 * qps,
        "request_throughput": qps,
        "slo_attainment": 1.0,
        "completed": 10,
        "failed": 0,
    }
    return {"runs": [{"qps": qps, "metrics": metrics}]}


def _source(sides: list[str]) -> dict:
    bg = {"16.0": {"tbt_ms": {"p50": 2.5, "p99": 37.5}}}
    part = {side: {"chat_background_by_probe": bg} for side in sides}
    return {"models": {"random:m": {"score_chat": part}}, "git_revision": "abc", "device": "d"}


def test_rows_and_the_chat_beside_them(tmp_path: Path) -> None:
    (tmp_path / "m-score-chat-a.json").write_text(json.dumps(_record(16.0)))
    src = tmp_path / "src.json"
    src.write_text(json.dumps(_source(["a"])))
    out = tmp_path / "out.json"
    args = [str(tmp_path), "--slug", "m", "--workloads", "score-chat", "--sides", "a"]
    assert main([*args, "--source", str(src), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["workloads"]["score-chat"]["a"]["16.0"]
    assert row["ttft_ms_p99"] == 900.0 and row["chat_itl_ms_p99"] == 37.5


def test_a_side_missing_from_the_results_json_stops_with_its_name(tmp_path: Path) -> None:
    for side in ("a", "b"):
        (tmp_path / f"m-score-chat-{side}.json").write_text(json.dumps(_record(16.0)))
    src = tmp_path / "src.json"
    src.write_text(json.dumps(_source(["a"])))
    args = [str(tmp_path), "--slug", "m", "--workloads", "score-chat", "--sides", "a,b"]
    with pytest.raises(SystemExit, match="b is not in"):
        main([*args, "--source", str(src)])
