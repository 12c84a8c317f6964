"""bench.kernel_rule: the merged-step kernel rule scored on recorded mixed_step files."""

from __future__ import annotations

import json
from pathlib import Path

from bench.kernel_rule import main, report


def _point(u: int, k: int, fa2_ms: float, fa3_ms: float, merged: bool = True) -> dict:
    def entry(ms: float, mode: str) -> dict:
        return {"merged": merged, "device_ms_median": ms, "attention": {"mode": mode}}

    return {
        "u": u,
        "k": k,
        "variants": {"served": entry(fa2_ms, "paged_fa2"), "fa3": entry(fa3_ms, "paged")},
    }


def test_the_rule_is_scored_against_the_faster_kernel_on_merged_points_only(
    tmp_path: Path,
) -> None:
    rec = {
        "engine": {"model": "random:llama-3.1-8b", "block_size": 16},
        "setup": {"context_tokens": 41_000, "decode_context_tokens": 2000},
        "points": [
            _point(350, 10, 44.0, 35.0),  # the rule picks FA3: the faster
            _point(360, 10, 74.0, 36.0),  # FA3 again
            _point(400, 10, 80.0, 20.0, merged=False),  # not a merged step: left out
        ],
    }
    path = tmp_path / "mixed-step-41000.json"
    path.write_text(json.dumps(rec))
    rep = report([path], 132)
    assert rep["num_points"] == 2
    assert [r["pick"] for r in rep["rows"]] == ["fa3", "fa3"]
    assert rep["rule_total_over_best"] == 1.0 and rep["rule_worst"] == 1.0
    assert rep["fa2_total_over_best"] == (44 + 74) / (35 + 36)
    assert rep["fa2_worst"] == 74 / 36
    # At 8k of context, 350 tokens beside 10 decodes stays on FA2 (its plan splits the KV):
    # where FA3 measured faster there, the report says by how much.
    rec["setup"]["context_tokens"] = 8000
    rec["points"] = [_point(350, 10, 20.0, 19.0)]
    path.write_text(json.dumps(rec))
    (row,) = report([path], 132)["rows"]
    assert row["pick"] == "fa2" and row["over_best"] == 20 / 19
    assert main([str(path)]) == 0
