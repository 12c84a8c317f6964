"""bench.batch_cost on the CPU (random:tiny): each point read gathered, kept and kept with a
shared context, by wall clock and device span, and a variant that does not fit the pool
recorded as an error while the others go on."""

from __future__ import annotations

import statistics

import pytest

from bench.batch_cost import measure
from runtime.config import EngineConfig
from runtime.engine import Engine


def test_each_point_is_read_on_both_paths_and_shared_with_wall_and_device_spans() -> None:
    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), None)
    try:
        # (3, 80) x 4: separate contexts need 80 blocks of the pool's 64 (84 kept); one shared
        # context and a block of new tokens each, 24.
        out = measure(engine, [(3, 16, 2), (3, 80, 4)], repeats=2)
    finally:
        engine.shutdown(0)
    for variant in ("gathered", "kept", "kept-shared"):
        r = out["3:16:2"][variant]
        assert len(r["wall_s"]) == 2 and len(r["device_s"]) == 2
        assert r["wall_ms_per_request"] == pytest.approx(statistics.median(r["wall_s"]) * 1e3 / 2)
        assert 0 < r["device_ms_per_request"] <= r["wall_ms_per_request"] * 1.01
    assert "NoFreeBlocksError" in out["3:80:4"]["gathered"]["error"]
    assert "NoFreeBlocksError" in out["3:80:4"]["kept"]["error"]
    assert len(out["3:80:4"]["kept-shared"]["wall_s"]) == 2
