"""`runtime.fallbacks.take`: one place that says a fallback in the log and keeps it for the
admin state."""

from __future__ import annotations

import logging

from runtime import fallbacks


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
