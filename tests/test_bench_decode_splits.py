"""bench.decode_splits' reading of served step traces (the decode-only steps by batch size)."""

from __future__ import annotations

from bench.decode_splits import contexts, decode_steps_by_rows


def _step(rows: int, ms: float, prefill: int = 0, on_split: bool = False) -> dict:
    return {
        "num_decodes": rows,
        "num_prefill_tokens": prefill,
        "on_split": on_split,
        "device_ms": ms,
        "decode_context_tokens": rows * 100,
    }


def test_decode_steps_by_rows_keeps_decode_only_whole_gpu_steps() -> None:
    steps = [_step(40, 11.0), _step(40, 12.0), _step(40, 10.0), _step(40, 50.0, prefill=512)]
    steps += [_step(70, 7.0), _step(70, 30.0, on_split=True), _step(0, 9.0, prefill=100)]
    table = {r["rows"]: r for r in decode_steps_by_rows(steps)}
    assert set(table) == {"32-47", "65-95"}
    assert table["32-47"]["steps"] == 3 and table["32-47"]["median_ms"] == 11.0
    assert table["65-95"]["steps"] == 1 and table["65-95"]["median_ms"] == 7.0


def test_contexts_mixes() -> None:
    import numpy as np

    rng = np.random.default_rng(1)
    assert (contexts("even", 8, rng) == 2048).all()
    one = contexts("one-long", 48, rng)
    assert (one == 14_000).sum() == 1 and one[one != 14_000].max() <= 1500
    mix = contexts("plan-v", 48, rng)
    assert (mix >= 6000).sum() == 8
