"""`--prefill-warm-up-tokens`: one discarded prefill at start-up (runtime/startup.py
`warm_up_prefill`).

On the real engine (random:tiny, CPU): it runs through the serving runner, leaves no block
held and nothing cached, changes no answer, is capped at the longest scoring prompt, and a
warm-up that fails is said (fallbacks) without stopping the server."""

from __future__ import annotations

import pytest
from test_engine import gen, make_engine

from app.cli import build_parser
from runtime.config import EngineConfig
from runtime.diagnostics import fallbacks
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


def test_the_first_chunked_steps_forms_run_within_budget_and_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the long prefill, one forward of each form a chat's first chunked steps take
    (runtime/startup.py `warm_up_forms`): decode-like one-token rows beside a short part,
    discarding and keeping KV, a later chunk over a context, a first chunk past the graphs'
    buckets. Each within the step budget and the model's length (a small engine skips what
    does not fit)."""
    seen: list[tuple[list[tuple[int, int]], bool | None]] = []
    real = Engine.measure_prefill_batch

    def spy(self: Engine, items: list[tuple[int, int]], *, keep_kv: bool | None = None) -> float:
        seen.append((list(items), keep_kv))
        return real(self, items, keep_kv=keep_kv)

    monkeypatch.setattr(Engine, "measure_prefill_batch", spy)
    engine, sink = make_engine(
        prefill_warm_up_tokens=32,
        prefill_token_budget=512,
        prefill_graph_max_tokens=256,
        num_kv_blocks=1024,
    )
    try:
        forms = seen[1:]  # seen[0]: the long prefill (through measure_prefill)
        assert seen[0] == ([(32, 0)], None)  # as a served scoring prompt: kept if it fits
        assert ([(1, 64)] * 8 + [(19, 0)], False) in forms
        assert ([(1, 64)] * 8 + [(19, 0)], True) in forms
        assert ([(333, 1499)], True) in forms
        assert ([(256 + 77, 0)], True) in forms  # past the largest bucket
        limit = engine._max_model_len
        for items, _ in forms:
            assert sum(n for n, _ in items) <= 512
            assert all(n + c <= limit for n, c in items)
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert len(_greedy(engine, sink, "after")) == 6
    finally:
        engine.shutdown(0)

    seen.clear()
    fallbacks.clear()  # (process-wide: another test's failed warm-up must not count here)
    small, _ = make_engine(prefill_warm_up_tokens=32, prefill_token_budget=64)
    try:
        forms = seen[1:]
        assert forms and all(sum(n for n, _ in items) <= 64 for items, _ in forms)
        assert ([(333, 1499)], True) not in forms
        assert "step forms warm-up" not in fallbacks.taken()
    finally:
        small.shutdown(0)


def test_keep_kv_writes_the_new_tokens_kv_and_false_discards_it() -> None:
    """`measure_prefill_batch(keep_kv=True)` takes the path of a prefill that keeps its KV
    (the warm-up's paged forms): the new tokens' K lands in the pool; with False (a scoring
    prompt's suffix the pool had no room for) nothing is written."""
    import torch

    from runtime.config import EngineConfig

    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), None)
    try:
        pool = engine.runner.kv_pool
        k = pool.flat_k(0)
        k.zero_()
        engine.measure_prefill_batch([(7, 0)], keep_kv=False)
        assert torch.count_nonzero(k) == 0
        engine.measure_prefill_batch([(7, 0)], keep_kv=True)
        assert torch.count_nonzero(k) > 0
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        engine.shutdown(0)


def test_the_default_measures_what_a_served_scoring_request_would_do() -> None:
    """By default (`keep_kv=None`) a measured prefill keeps its new tokens' KV exactly when
    the pool holds the whole prompt, as the scheduler keeps a scoring prompt's: a context with
    room after it is read in place (paged), not copied in every layer (gathered). The profiles
    measured the gathered path for every cached point until 2026-12-05."""
    import torch

    from runtime.config import EngineConfig

    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), None)
    try:
        k = engine.runner.kv_pool.flat_k(0)
        # 40 + 100 tokens: 35 blocks of the 64, so kept; the new rows are written.
        assert engine.served_keeps_kv([(40, 100)])
        k.zero_()
        engine.measure_prefill(40, 100)
        assert torch.count_nonzero(k) > 0
        # 200 + 60: 65 blocks, more than the pool: the suffix is discarded, nothing written.
        assert not engine.served_keeps_kv([(200, 60)])
        k.zero_()
        engine.measure_prefill(200, 60)
        assert torch.count_nonzero(k) == 0
        # A batch is judged whole: two prompts of 35 blocks do not both fit.
        assert not engine.served_keeps_kv([(40, 100)] * 2)
        # ...unless they share the context (25 blocks once, 10 each after it).
        assert engine.served_keeps_kv([(40, 100)] * 2, share_context=True)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown(0)


def test_measured_batches_may_share_one_context_and_report_their_device_span() -> None:
    """`share_context`: the members read one context's blocks, as one user's requests share a
    profile: a batch whose separate contexts overflow the pool fits. Kept, each member writes
    its own new tokens after the shared blocks (which must then be whole). The device span
    of each reading is returned beside the wall time."""

    from runtime.kv.block_manager import NoFreeBlocksError

    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), None)
    try:
        bm = engine.block_manager
        items = [(3, 80)] * 4  # 4 contexts of 20 blocks: 80 of the pool's 64
        with pytest.raises(NoFreeBlocksError):
            engine.measure_prefill_batch(items, keep_kv=False)
        spans: list[float] = []
        wall_s = engine.measure_prefill_batch(
            items, keep_kv=False, share_context=True, device_s_out=spans
        )
        assert len(spans) == 1 and 0 < spans[0] <= wall_s
        assert bm.num_free_blocks == bm.num_blocks
        # Kept and shared: 20 context blocks + 4 x 1 block of new tokens = 24 of 64.
        k = engine.runner.kv_pool.flat_k(0)
        k.zero_()
        engine.measure_prefill_batch(items, share_context=True)
        per_block = k.view(-1, bm.block_size * k[0].numel())  # [blocks (+ spare), ...]
        written = per_block.count_nonzero(dim=1).nonzero().numel()
        assert written == 4  # one fresh block a member, the shared context untouched
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_integrity()
        with pytest.raises(ValueError, match="equal cached lengths"):
            engine.measure_prefill_batch([(3, 80), (3, 40)], share_context=True)
        with pytest.raises(ValueError, match="whole blocks"):
            engine.measure_prefill_batch([(3, 42)] * 2, keep_kv=True, share_context=True)
    finally:
        engine.shutdown(0)


def test_a_failed_forms_warm_up_is_said_and_the_engine_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: Engine, items: list[tuple[int, int]], *, keep_kv: bool | None = None) -> float:
        raise RuntimeError("a kernel failed in the forms warm-up")

    monkeypatch.setattr(Engine, "measure_prefill_batch", broken)
    monkeypatch.setattr(Engine, "measure_prefill", lambda self, u, c: 0.01)
    engine, sink = make_engine(prefill_warm_up_tokens=32)
    try:
        assert engine.prefill_warm_up_s == 0.01  # the long prefill's own reading stands
        assert "forms warm-up" in fallbacks.taken()["step forms warm-up"]
        assert len(_greedy(engine, sink, "after")) == 6
    finally:
        engine.shutdown(0)
