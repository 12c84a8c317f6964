"""GPU: FlashInfer backend and ops against float32 / torch references (bench/gpu_suite.py
holds the checks so the device run and pytest share them)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.gpu
def test_flashinfer_backend_all_modes_match_reference() -> None:
    from bench import gpu_suite

    gpu_suite.RESULTS["checks"].clear()
    gpu_suite.section_backend()
    failed = [c for c in gpu_suite.RESULTS["checks"] if not c["ok"]]
    assert gpu_suite.RESULTS["checks"] and not failed, failed


@pytest.mark.gpu
def test_flashinfer_ops_match_torch() -> None:
    from bench import gpu_suite

    gpu_suite.RESULTS["checks"].clear()
    gpu_suite.section_ops()
    failed = [c for c in gpu_suite.RESULTS["checks"] if not c["ok"]]
    assert gpu_suite.RESULTS["checks"] and not failed, failed
