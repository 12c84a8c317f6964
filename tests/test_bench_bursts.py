"""The engine-level burst benchmarks on the tiny random model: they run end to end, and the
shared-prefix one shows what the scheduler's waiting saves (computed tokens, which do not
depend on the machine's speed)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import shared_prefix


def test_shared_prefix_burst_computes_each_profile_once(tmp_path: Path) -> None:
    out = tmp_path / "sp.json"
    argv = ["--model", "random:tiny", "--users", "2", "--items", "3", "--profile-tokens", "128"]
    argv += ["--item-tokens", "8", "--wait-tokens", "16", "--repeats", "1", "--out", str(out)]
    assert shared_prefix.main(argv) == 0
    data = json.loads(out.read_text())
    off, on = data["results"]
    assert off["wait_for_shared_prefix_tokens"] == 0 and on["wait_for_shared_prefix_tokens"] == 16
    # Waiting: each profile computed once, then only the items (the minimum possible).
    assert on["computed_tokens"] == 2 * 136 + 4 * 8
    assert off["computed_tokens"] > on["computed_tokens"]
    assert data["computed_tokens_ratio_wait_vs_off"] < 1
    assert data["git_revision"] and data["command"].startswith("python -m bench.shared_prefix")
