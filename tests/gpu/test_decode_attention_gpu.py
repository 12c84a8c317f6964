"""GPU: decode attention through FlashInfer's XQA kernel (`decode_attention="xqa"`,
runtime/attention/flashinfer_backend.py) against its tensor-core decode: an engine with each
(decode graphs and eager decode batches both) gives the same scores and greedy tokens up to
bf16 near ties. The first run compiles the XQA module (FlashInfer JIT)."""

from __future__ import annotations

import pytest
from gpu_engines import assert_engines_alike, small_engine

pytestmark = pytest.mark.gpu


def test_engine_with_xqa_decode_scores_alike() -> None:
    assert_engines_alike(
        [{"decode_attention": "flashinfer"}, {"decode_attention": "xqa"}], max_tokens=16
    )


def test_xqa_decode_graphs_are_captured() -> None:
    """The XQA instances capture into the decode graphs (no fallback to eager decode)."""
    eng, _ = small_engine(decode_attention="xqa")
    try:
        graphs = eng.runner.decode_graphs
        assert graphs is not None and graphs.graphs, "no decode graphs captured"
        assert graphs.xqa_workspace is not None
        step = graphs.graphs[max(graphs.graphs)].step
        assert getattr(step.backend, "_xqa_ws", None) is not None
    finally:
        eng.shutdown(0)
