"""GPU: after start-up, a chat's chunked steps compile no Triton kernel and make no FlashInfer
wrapper on the engine thread (startup.warm_up_forms, the tiled RoPE kernel's unspecialized T).

Why: a first use costs 150-300 ms of host time on the H200, with every decode beside it
waiting: at bf68d3a a fresh engine's first odd-sized chunk next to eight chats compiled the
tiled RoPE + K/V write for T % 16 != 0 (164 ms for a 25-ms target), and an 11-token chunk
compiled the per-token kernel (300 ms). FlashInfer's wrappers come from the runner's
attention warm-up; checked too, that serving makes none. Counted here, not
timed: compiled variants per Triton kernel and the backend's wrappers, before the first
request and after a chat's chunks of odd sizes, a short chunk among decodes and a scoring
suffix after a cached prefix."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gpu_engines import add_greedy, small_engine

pytestmark = pytest.mark.gpu


def _compiled_variants() -> dict[str, int]:
    """Compiled variants of each Triton kernel of the serving path (per device summed)."""
    from runtime.attention import rope_kv_write
    from runtime.model import decode_kernels

    out = {}
    for mod in (rope_kv_write, decode_kernels):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)  # triton >= 3.2: device -> (cache, ...)
            if caches is None:
                continue
            out[f"{mod.__name__}.{name}"] = sum(len(c[0]) for c in caches.values())
    if not out:
        pytest.skip("this Triton keeps no per-device kernel caches to count")
    return out


def _wrappers(backend: Any) -> dict[str, Any]:
    return {k: getattr(backend, k, None) for k in ("_paged_fa2", "_ragged_fa2")}


def test_chunked_steps_after_start_up_compile_nothing_on_the_engine_thread() -> None:
    from runtime.request import Request, RequestKind

    eng, sink = small_engine(
        tbt_slo_ms=25.0, max_model_len=16_384, num_kv_blocks=1500, max_num_seqs=32
    )
    rng = random.Random(3)
    try:
        before, wrappers = _compiled_variants(), _wrappers(eng.runner.prefill_backend)
        # Start-up (the runner's attention warm-up) made the FA2 wrappers a merged step and a
        # scoring suffix use.
        assert all(w is not None for w in wrappers.values()), wrappers
        eng.start()

        chats = [f"chat{i}" for i in range(8)]
        for rid in chats:
            add_greedy(eng, rng, rid, 64 + 3 * len(rid), 300)
        with sink.cv:
            assert sink.cv.wait_for(
                lambda: all(len(sink.tokens.get(r, [])) >= 3 for r in chats), 60
            )
        add_greedy(eng, rng, "long", 9_001, 2)  # odd-sized chunks next to the decodes
        add_greedy(eng, rng, "short", 11, 2)  # a few rows among decodes
        profile = [rng.randrange(100, 30_000) for _ in range(3_001)]
        eng.add(Request("s0", RequestKind.SCORE, profile + [7, 8, 9], label_token_ids=[5, 6]))
        eng.add(Request("s1", RequestKind.SCORE, profile + [10, 11], label_token_ids=[5, 6]))
        assert sink.wait(["long", "short", "s0", "s1", *chats], 180), "requests timed out"
        after = _compiled_variants()
        grew = {k: (before.get(k, 0), v) for k, v in after.items() if v != before.get(k, 0)}
        assert not grew, f"Triton compiled while serving: {grew}"
        # The engine's own count (runtime/diagnostics/compile_watch.py, in /admin/api/state) agrees.
        assert eng.fresh_stats()["kernels_compiled_while_serving"] == 0
        assert _wrappers(eng.runner.prefill_backend) == wrappers
    finally:
        eng.shutdown(0)
