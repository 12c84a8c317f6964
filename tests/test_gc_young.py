"""What serving leaves for the young collections to walk (runtime/diagnostics/gc_watch.py): a
scoring load with long shared prefixes next to chat must not put its token-id lists, or cyclic
garbage, in the collector's young generations. On the H200 such a load paused young
collections 10-45 ms: they walked every waiting prompt's tokens, element by element."""

from __future__ import annotations

import gc

from test_engine import gen, make_engine, score

from runtime.diagnostics.gc_watch import GcWatch, untrack_int_list

PROFILE_TOKENS = 1500  # per user; a prompt is the profile + a short post
NUM_USERS = 3


def _young_container_elements() -> int:
    """Elements of the lists, tuples, dicts and sets in generations 0 and 1."""
    return sum(
        len(o)
        for g in (0, 1)
        for o in gc.get_objects(generation=g)
        if type(o) in (list, tuple, dict, set)
    )


def test_untrack_int_list() -> None:
    values = list(range(1000, 2000))
    assert gc.is_tracked(values)
    assert untrack_int_list(values) is values and not gc.is_tracked(values)
    values.append(5)  # appends never re-track a list
    assert not gc.is_tracked(values)
    assert untrack_int_list((1, 2)) == (1, 2)  # only exact lists


def test_serving_scoring_with_shared_prefixes_leaves_nothing_long_for_young_collections() -> None:
    engine, sink = make_engine(block_size=16, num_kv_blocks=2048)
    users = [list(range(100 + u, 100 + u + PROFILE_TOKENS)) for u in range(NUM_USERS)]
    debug = gc.get_debug()
    try:
        # The users' prefixes first, then prefix hits next to chat streams.
        engine.add_many([score(f"warm{u}", users[u] + [7, 8]) for u in range(NUM_USERS)])
        sink.wait(*(f"warm{u}" for u in range(NUM_USERS)))
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        rids = []
        for i in range(12):
            reqs = [score(f"s{i}", users[i % NUM_USERS] + [9, 10 + i])]
            if i % 3 == 0:
                reqs.append(gen(f"c{i}", [11, 12, 13 + i], max_tokens=6))
            engine.add_many(reqs)
            rids += [r.request_id for r in reqs]
        sink.wait(*rids)
        # Requests the engine holds keep their prompts out of the collector's sight.
        waiting = [score(f"w{u}", users[u] + [3]) for u in range(NUM_USERS)]
        engine.add_many(waiting)
        assert not any(gc.is_tracked(r.prompt_token_ids) for r in waiting)
        sink.wait(*(r.request_id for r in waiting))
        # Nothing the engine built per request or step became cyclic garbage.
        assert gc.collect() == 0, sorted({type(o).__name__ for o in gc.garbage})
        assert gc.garbage == []
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()
        engine.shutdown(0)


def test_waiting_prompts_add_nothing_for_young_collections_to_walk() -> None:
    """A burst of long scoring prompts queued in the engine (as 49 were on the H200) adds no
    elements to the young generations; tracked, each added its whole length (32,000 here)."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny", block_size=16, num_kv_blocks=2048), print)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # no collection may move the prompts to the old generation meanwhile
    try:
        before = _young_container_elements()
        prompts = [list(range(100, 100 + 4000)) for _ in range(8)]  # within the tiny model
        engine.add_many([score(f"y{i}", p) for i, p in enumerate(prompts)])  # queued: not started
        after = _young_container_elements()
        assert after - before < 4000, f"{after - before} young elements"
    finally:
        if enabled:
            gc.enable()
        engine.shutdown(0)


def test_watch_tells_young_from_full_pauses() -> None:
    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    wall, cpu = Clock(), Clock()
    w = GcWatch(wall, cpu)
    w._on_gc("start", {"generation": 0})
    wall.t += 0.020  # another thread held the GIL for 16 ms of it
    cpu.t += 0.004
    w._on_gc("stop", {"generation": 0})
    w._on_gc("start", {"generation": 2})
    wall.t += 0.010
    cpu.t += 0.010
    w._on_gc("stop", {"generation": 2})
    win = w.take_window()
    assert abs(win["gc_young_pause_ms_max"] - 20.0) < 1e-6
    assert abs(win["gc_pause_ms_max"] - 20.0) < 1e-6
    assert abs(win["gc_pause_cpu_ms_max"] - 10.0) < 1e-6
    assert win["gc_full_collections"] == 1
    again = w.take_window()
    assert again["gc_young_pause_ms_max"] == 0.0 and again["gc_pause_cpu_ms_max"] == 0.0
    # Since start: what a benchmark reads once at the end of a run (the admin state's `gc`).
    assert abs(again["gc_young_pause_ms_max_ever"] - 20.0) < 1e-6
    assert abs(again["gc_pause_cpu_ms_max_ever"] - 10.0) < 1e-6
