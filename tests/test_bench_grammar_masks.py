"""`bench.grammar_masks` runs end to end (a smoke test: its numbers are the bench's, not a
test's)."""

from __future__ import annotations

import json

from bench import grammar_masks


def test_it_times_both_kinds_at_each_row_count(tmp_path, default_model_dir) -> None:  # noqa: ANN001
    out = tmp_path / "m.json"
    argv = ["--tokenizer-dir", str(default_model_dir), "--rows", "1,3", "--repeats", "2"]
    assert grammar_masks.main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"json_schema x1", "json_schema x3", "choice x1", "choice x3"}
    assert all(r["fill_ms_median"] > 0.0 for r in res.values())
