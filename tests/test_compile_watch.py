"""`CompileWatch` (runtime/diagnostics/compile_watch.py): Triton variants compiled after start-up,
counted from the kernels' own per-device caches, said once per growth; unknown (None) before serving
starts and where nothing can be counted. Stand-in kernels here (a CPU runs Triton's
interpreter, which keeps no caches); the real ones: tests/gpu/test_first_use_gpu.py."""

from __future__ import annotations

import logging
import types

import pytest

from runtime.diagnostics.compile_watch import CompileWatch, triton_kernels


class FakeKernel:
    """Triton >= 3.2's shape: device -> (variant cache, target, backend, binder)."""

    def __init__(self, *keys: str) -> None:
        self.device_caches = {0: ({k: object() for k in keys}, None, None, None)}

    def compile(self, key: str, device: int = 0) -> None:
        self.device_caches.setdefault(device, ({}, None, None, None))[0][key] = object()


def test_counts_from_the_mark_and_says_each_growth_once(caplog: pytest.LogCaptureFixture) -> None:
    rope, gemv = FakeKernel("T%16"), FakeKernel("M1", "M2")
    watch = CompileWatch({"rope": rope, "gemv": gemv})
    rope.compile("start-up variant")
    assert watch.compiled_since_mark() is None  # start-up: not serving yet, nothing said
    watch.mark()
    with caplog.at_level(logging.WARNING, logger="greenlane.compile"):
        assert watch.compiled_since_mark() == 0
        rope.compile("T odd")
        gemv.compile("M3", device=1)  # another device's cache counts too
        assert watch.compiled_since_mark() == 2
        assert watch.compiled_since_mark() == 2  # the same count again: said once
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "rope +1" in said[0] and "gemv +1" in said[0]
    rope.compile("another")
    with caplog.at_level(logging.WARNING, logger="greenlane.compile"):
        assert watch.compiled_since_mark() == 3
    assert "rope +1" in caplog.records[-1].getMessage()


def test_nothing_to_count_is_unknown_not_zero() -> None:
    watch = CompileWatch({})
    watch.mark()
    assert watch.compiled_since_mark() is None


def test_triton_kernels_takes_only_what_keeps_a_cache() -> None:
    mod = types.ModuleType("kernels_here")
    mod.k1 = FakeKernel("a")  # type: ignore[attr-defined]
    mod.helper = lambda: None  # type: ignore[attr-defined]
    mod.interpreted = types.SimpleNamespace(fn=None)  # type: ignore[attr-defined]
    assert set(triton_kernels([mod])) == {"kernels_here.k1"}


def test_a_cpu_engine_says_unknown() -> None:
    """The engine's stat on a CPU (Triton's interpreter compiles nothing): None, not 0."""
    from test_engine import make_engine

    engine, _ = make_engine()
    try:
        assert engine.fresh_stats()["kernels_compiled_while_serving"] is None
    finally:
        engine.shutdown(0)
