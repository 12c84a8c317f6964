"""bench.mixed_step on the CPU (random:tiny): one point per (chunk, decodes), each a step the
scheduler planned with the chunk's u new tokens right after the cached context beside k
decodes, timed, merged when it has decodes; and the FA2 split arithmetic it records on CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.mixed_step import main, parse_grid, parse_variants, variant_patch


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
        assert list(p["variants"]) == ["served"]  # the default: served, also at the top
        assert p["variants"]["served"]["device_ms"] == p["device_ms"]


def test_variants_run_the_same_step_merged_and_unmerged_and_skip_fa3_off_flashinfer(
    tmp_path: Path,
) -> None:
    out = tmp_path / "v.json"
    context, dctx, u, k, repeats = 70, 21, 24, 2, 2
    rc = main(
        [
            "--model", "random:tiny", "--device", "cpu",
            "--context", str(context), "--chunks", str(u), "--decodes", str(k),
            "--decode-context", str(dctx), "--repeats", str(repeats),
            "--variants", "served,unmerged,fa3,fa2,unmerged-fa2,side-stream", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    rec = json.loads(out.read_text())
    names = ["served", "unmerged", "fa3", "fa2", "unmerged-fa2", "side-stream"]
    assert rec["setup"]["variants"] == names
    (p,) = rec["points"]
    assert (p["u"], p["k"]) == (u, k) and "error" not in p, p
    variants = p["variants"]
    assert list(variants) == names
    served, unmerged = variants["served"], variants["unmerged"]
    assert "error" not in served and "error" not in unmerged, variants
    # served: one forward of u + k rows (CPU: a kept chunk beside decodes always merges).
    assert served["merged"] is True and served["mergeable"] is True
    assert served["forward_tokens"] == u + k
    # unmerged: the chunk's forward alone, then the decodes'.
    assert unmerged["merged"] is False and unmerged["mergeable"] is False
    assert unmerged["forward_tokens"] == u
    for entry in (served, unmerged):
        assert len(entry["device_ms"]) == repeats and all(v > 0 for v in entry["device_ms"])
        assert 0 < entry["device_ms_min"] <= entry["device_ms_median"] <= entry["device_ms_max"]
        assert entry["attention"] is None  # the torch backend says nothing
    # The layout before --variants: served's fields at the point's top level.
    assert p["merged"] is True and p["device_ms"] == served["device_ms"]
    # No FlashInfer on the CPU: no kernel choice to force; no CUDA streams.
    for name in ("fa3", "fa2", "unmerged-fa2", "side-stream"):
        assert set(variants[name]) == {"skipped"} and "not applicable" in variants[name]["skipped"]
    # The patches are gone after the run: a fresh engine would see the originals.
    from runtime.attention import flashinfer_backend
    from runtime.runner import ModelRunner

    assert flashinfer_backend.prefill_on_fa2.__name__ == "prefill_on_fa2"
    assert "_mergeable" in vars(ModelRunner)


def test_grids_take_lists_and_inclusive_ranges() -> None:
    assert parse_grid("330:345:5") == [330, 335, 340, 345]
    assert parse_grid("1,6,10") == [1, 6, 10]
    assert parse_grid("0:2:2,2,5") == [0, 2, 5]


def test_variant_patches_take_effect_where_looked_up_and_are_undone() -> None:
    from runtime.attention import flashinfer_backend as fib

    class Runner:
        def _mergeable(self, _prefill: list, _num_decodes: int) -> bool:
            return True

    runner = Runner()
    engine = SimpleNamespace(runner=runner)
    original = fib.prefill_on_fa2
    with variant_patch(engine, "fa3"):
        # The backend calls it by its module-global name at plan time.
        assert fib.prefill_on_fa2([1] * 10, 32, 132) is False
    assert fib.prefill_on_fa2 is original and original([1] * 10, [900] * 10, 32, 8, 132, 16)
    with variant_patch(engine, "unmerged-fa2"):
        # Both: the chunk's kernel forced onto FA2, and no merge.
        assert fib.prefill_on_fa2([400], 32, 132) is True and runner._mergeable([], 3) is False
    assert fib.prefill_on_fa2 is original and not original([400], [8400], 32, 8, 132, 16)
    assert runner._mergeable([], 3) is True and "_mergeable" not in vars(runner)
    with pytest.raises(RuntimeError), variant_patch(engine, "unmerged"):
        assert runner._mergeable([], 3) is False
        raise RuntimeError("a failing launch")
    assert runner._mergeable([], 3) is True and "_mergeable" not in vars(runner)
    with variant_patch(engine, "served"):
        assert runner._mergeable([], 3) is True
    # all-buckets: the buckets dropped at start-up served again, then dropped again.
    from bench.mixed_step import variant_unavailable
    from runtime.graphs.prefill import PrefillGraphs

    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.token_sizes, pg.dropped, pg.graphs = (16, 64), {32: 3.0}, {16: [], 32: [], 64: []}
    runner.prefill_graphs, runner.prefill_backend = pg, None
    assert pg.bucket_for(20) == 64
    with variant_patch(engine, "all-buckets"):
        assert pg.bucket_for(20) == 32
    assert pg.bucket_for(20) == 64 and pg.token_sizes == (16, 64)
    assert variant_unavailable(engine, "all-buckets") is None
    runner.prefill_graphs = None
    assert "no captured prefill graphs" in variant_unavailable(engine, "all-buckets")
    # merged: one forward whatever the rule says (here a rule that would not merge), undone.
    runner._mergeable = lambda _p, _k: False  # type: ignore[method-assign]
    with variant_patch(engine, "merged"):
        assert runner._mergeable([], 3) is True
    assert runner._mergeable([], 3) is False
    del runner._mergeable
    # Not on an engine that does not merge mixed steps.
    engine.config = SimpleNamespace(merge_mixed_steps=True)
    runner.merge_off_reason = None
    assert variant_unavailable(engine, "merged") is None
    runner.merge_off_reason = "FlashInfer missing"
    assert "FlashInfer missing" in variant_unavailable(engine, "merged")


def test_variants_are_known_names_in_order_without_repeats() -> None:
    assert parse_variants("served") == ("served",)
    assert parse_variants("unmerged, fa3,unmerged") == ("unmerged", "fa3")
    with pytest.raises(SystemExit):
        parse_variants("served,fa4")
    with pytest.raises(SystemExit):
        parse_variants(",")


def test_kernels_profile_one_more_launch_and_the_cap_is_the_engines(tmp_path: Path) -> None:
    """`--kernels N`: each variant's entry gains the profiler's kernel summary of one extra
    launch (none on the CPU: no device kernels), its timed repeats unchanged;
    `--mixed-step-token-budget` is the engine's cap on a step with decodes, so a chunk over
    it beside decodes cannot be staged (an error, not a smaller step)."""
    out = tmp_path / "k.json"
    args = [
        "--model", "random:tiny", "--device", "cpu", "--context", "32", "--chunks", "16",
        "--decodes", "2", "--decode-context", "16", "--repeats", "2", "--kernels", "5",
        "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    rec = json.loads(out.read_text())
    (p,) = rec["points"]
    assert "error" not in p and len(p["device_ms"]) == 2
    k = p["variants"]["served"]["kernels"]
    assert k["num_steps"] == 1 and k["step_device_ms"] > 0
    assert k["top_kernels"] == [] and k["kernel_ms"] == 0  # the CPU: no device kernels
    assert rec["engine"]["mixed_step_token_budget"] is None  # CPU's default: no cap
    capped = tmp_path / "c.json"
    args[args.index("--out") + 1] = str(capped)
    args[args.index("--chunks") + 1] = "37"
    assert main([*args, "--mixed-step-token-budget", "24"]) == 0
    rec = json.loads(capped.read_text())
    assert rec["engine"]["mixed_step_token_budget"] == 24
    (p,) = rec["points"]
    assert "error" in p and not p["variants"]  # 37 + 2 tokens do not fit a cap of 24
    assert p["planned"]["prefill_new_tokens"] < 37
