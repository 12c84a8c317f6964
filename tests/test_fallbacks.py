"""`runtime.diagnostics.fallbacks.take`: one place that says a fallback in the log and keeps it for
the admin state."""

from __future__ import annotations

import logging

from runtime.diagnostics import fallbacks


def test_take_logs_once_and_keeps_the_first_reason_with_what_happens_instead(caplog) -> None:
    fallbacks.clear()
    log = logging.getLogger("greenlane.test")
    with caplog.at_level(logging.WARNING, logger="greenlane.test"):
        kept = fallbacks.take(
            "prefill graphs", RuntimeError("out of memory"), "prefill parts run eagerly", log
        )
        fallbacks.take("prefill graphs", ValueError("later"), "prefill parts run eagerly", log)
    assert kept == "RuntimeError: out of memory"
    assert caplog.records[0].getMessage() == (
        "FALLBACK: prefill graphs failed (RuntimeError: out of memory); prefill parts run eagerly"
    )
    assert fallbacks.taken() == {
        "prefill graphs": "RuntimeError: out of memory; prefill parts run eagerly"
    }
    # A string reason as given, and the failure in the caller's words.
    with caplog.at_level(logging.WARNING, logger="greenlane.test"):
        fallbacks.take(
            "merged steps", "3 failures", "separate forwards", log, failed="merging failed"
        )
    assert "FALLBACK: merging failed (3 failures); separate forwards" in caplog.text
    assert fallbacks.taken()["merged steps"] == "3 failures; separate forwards"
    fallbacks.clear()


def test_flashinfer_asked_without_cuda_is_a_recorded_fallback() -> None:
    """`--attention-backend flashinfer` on a CPU pool runs torch SDPA and says so: in the log
    and in the admin state's fallbacks."""
    import torch

    from runtime.config import EngineConfig
    from runtime.engine import make_attention_backend
    from runtime.kv.kv_pool import KVPool

    fallbacks.clear()
    pool = KVPool(1, 4, 4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    be = make_attention_backend(EngineConfig(attention_backend="flashinfer"), pool, 2)
    assert be.name == "torch"
    assert fallbacks.taken() == {"attention backend": "no CUDA device (cpu); torch SDPA"}
    fallbacks.clear()
