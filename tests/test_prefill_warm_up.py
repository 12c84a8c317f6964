"""`--prefill-warm-up-tokens`: one discarded prefill at start-up (Engine._warm_up_prefill).

On the real engine (random:tiny, CPU): it runs through the serving runner, leaves no block
held and nothing cached, changes no answer, is capped at the longest scoring prompt, and a
warm-up that fails is said (fallbacks) without stopping the server."""

from __future__ import annotations

import pytest
from test_engine import gen, make_engine

from app.cli import build_parser
from runtime import fallbacks
from runtime.config import EngineConfig
from runtime.engine import Engine


def _greedy(engine: Engine, sink, rid: str) -> list[int]:  # type: ignore[no-untyped-def]
    engine.add(gen(rid, [11, 12, 13, 14, 15, 16, 17], max_tokens=6))
    sink.wait(rid)
    return sink.tokens(rid)


def test_warm_up_runs_leaves_nothing_behind_and_changes_no_answer() -> None:
    warm, warm_sink = make_engine(prefill_warm_up_tokens=40)
    cold, cold_sink = make_engine()  # auto: off on the CPU (a long prefill takes minutes)
    try:
        assert warm.prefill_warm_up_s is not None and warm.prefill_warm_up_s > 0
        assert cold.config.prefill_warm_up_tokens is None and cold.prefill_warm_up_s is None
        # Said in the stats (and so in /admin/api/state) for a benchmark's record.
        assert warm.stats()["prefill_warm_up_s"] == warm.prefill_warm_up_s
        assert cold.stats()["prefill_warm_up_s"] is None
        bm = warm.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # its throwaway blocks are back
        bm.check_integrity()
        assert _greedy(warm, warm_sink, "w") == _greedy(cold, cold_sink, "c")
    finally:
        warm.shutdown(0)
        cold.shutdown(0)


def test_warm_up_is_capped_at_the_longest_scoring_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[int, int]] = []
    real = Engine.measure_prefill

    def spy(self: Engine, uncached: int, cached: int) -> float:
        seen.append((uncached, cached))
        return real(self, uncached, cached)

    monkeypatch.setattr(Engine, "measure_prefill", spy)
    engine, _ = make_engine(prefill_warm_up_tokens=100_000, max_score_tokens=48)
    try:
        assert seen == [(48, 0)]
    finally:
        engine.shutdown(0)


def test_a_failed_warm_up_is_said_and_the_engine_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Engine, uncached: int, cached: int) -> float:
        raise RuntimeError("out of memory in the warm-up")

    monkeypatch.setattr(Engine, "measure_prefill", broken)
    engine, sink = make_engine(prefill_warm_up_tokens=32)
    try:
        assert engine.prefill_warm_up_s is None
        assert "out of memory in the warm-up" in fallbacks.taken()["prefill warm-up"]
        assert len(_greedy(engine, sink, "after")) == 6
    finally:
        engine.shutdown(0)


def test_option_is_on_the_command_line_and_checked() -> None:
    args = build_parser().parse_args(["serve", "--prefill-warm-up-tokens", "4096"])
    assert args.prefill_warm_up_tokens == 4096
    with pytest.raises(ValueError, match="prefill_warm_up_tokens"):
        EngineConfig(prefill_warm_up_tokens=-1)


def test_admin_state_says_how_long_the_warm_up_took() -> None:
    """Through the server (engine core process, random:tiny): /admin/api/state carries the
    warm-up's seconds, so a benchmark that records the state shows it ran."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    settings = Settings(model="random:tiny", max_num_seqs=4, prefill_warm_up_tokens=32)
    app = create_app(settings)
    with TestClient(app, client=("127.0.0.1", 50123), base_url="http://127.0.0.1:8000") as c:
        r = c.get("/admin/api/state")
        assert r.status_code == 200, r.text
        assert r.json()["prefill_warm_up_s"] > 0
