"""bench.op_count: the diagnostic counts one step's dispatched operations, and smaller
hybrid-prefill chunks dispatch more of them for the same prompt (what it is for)."""

from __future__ import annotations

from bench.op_count import count


def test_smaller_chunks_dispatch_more_operations() -> None:
    whole = count("random:tiny", 600, 1024)
    chunked = count("random:tiny", 600, 128)  # five chunks of the token-wise work
    assert whole["num_layers"] == chunked["num_layers"] == 2
    assert 0 < whole["num_ops"] < chunked["num_ops"]
    # Each extra chunk repeats a layer's token-wise operations: well above a few per chunk.
    assert chunked["num_ops"] - whole["num_ops"] >= 4 * 2 * 10
