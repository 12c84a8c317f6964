"""bench.mixed_step on the CPU (random:tiny): one point per (chunk, decodes), each a step the
scheduler planned with the chunk's u new tokens right after the cached context beside k
decodes, timed, merged when it has decodes; and the FA2 split arithmetic it records on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

from bench.mixed_step import fa2_split, main, parse_grid


def test_one_timed_point_per_chunk_and_decode_count(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    # A context and a chunk that end mid-block: partial blocks on both sides of the chunk.
    context, dctx, chunks, decodes, repeats = 70, 21, [16, 37], [0, 2], 2
    rc = main(
        [
            "--model", "random:tiny", "--device", "cpu",
            "--context", str(context), "--chunks", "16,37", "--decodes", "0:2:2",
            "--decode-context", str(dctx), "--repeats", str(repeats),
            "--rev", "abc123", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rec = json.loads(out.read_text())
    assert "not a served figure" in rec["note"]
    assert rec["command"].startswith("python -m bench.mixed_step --model random:tiny")
    assert rec["git_revision"]["given"] == "abc123"
    assert rec["device"].startswith("cpu") and rec["date"]
    points = rec["points"]
    assert sorted((p["u"], p["k"]) for p in points) == sorted(
        (u, k) for u in chunks for k in decodes
    )
    for p in points:
        u, k = p["u"], p["k"]
        assert "error" not in p, p
        planned = p["planned"]
        # The step's prefill: u new tokens right after the context, their KV kept.
        assert planned["prefill_new_tokens"] == u
        assert planned["prefill_context_tokens"] == context
        assert planned["prefill_kept_tokens"] == context + u
        assert planned["prefill_needs_output"] is False  # the prompt goes on after the chunk
        assert planned["num_decodes"] == k
        assert planned["decode_context_tokens"] == ([dctx] if k else [])
        assert isinstance(p["merged"], bool) and isinstance(p["mergeable"], bool)
        assert p["merged"] == (k > 0)  # CPU: a kept chunk beside decodes always merges
        assert p["forward_tokens"] == (u + k if p["merged"] else u)
        assert p["prefill_graph_bucket"] is None  # no graphs on the CPU
        assert len(p["device_ms"]) == repeats and all(v > 0 for v in p["device_ms"])
        assert 0 < p["device_ms_min"] <= p["device_ms_median"] <= p["device_ms_max"]
        assert p["wall_ms_median"] > 0
        assert p["attention"] is None and p["fa2_predicted"] is None  # torch backend


def test_grids_take_lists_and_inclusive_ranges() -> None:
    assert parse_grid("330:345:5") == [330, 335, 340, 345]
    assert parse_grid("1,6,10") == [1, 6, 10]
    assert parse_grid("0:2:2,2,5") == [0, 2, 5]


def test_fa2_split_drops_to_one_kv_chunk_when_its_tiles_no_longer_fit_twice() -> None:
    # H100 (132 SMs), Llama-3.1-8B heads (32 query, 8 KV), 16-token pages: at most
    # 2 * 132 // 8 = 33 work tiles when split. A chunk of u tokens after 41,000 is ceil(u / 32)
    # query tiles of 128 packed rows; each of 10 decodes one tile. Two KV chunks each fit
    # while 2 * ceil(u / 32) + 10 <= 33, i.e. up to u = 352.
    def plan(u: int, k: int) -> dict:
        return fa2_split([u] + [1] * k, [41000 + u] + [2001] * k, 32, 8, 132, 16)

    at, past = plan(352, 10), plan(353, 10)
    assert at["split_kv"] and at["kv_chunks_per_seq"][0] == 2 and at["cta_tile_q"] == 128
    assert at["num_work_tiles"] == 2 * 11 + 10 <= at["max_work_tiles_if_split"] == 33
    assert not past["split_kv"] and past["kv_chunks_per_seq"][0] == 1
    assert past["num_work_tiles"] == 12 + 10
    assert plan(416, 6)["split_kv"] and not plan(417, 6)["split_kv"]
