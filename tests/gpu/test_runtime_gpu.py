"""GPU: the runtime through the engine on CUDA — logits and greedy decode against
`transformers`, FlashInfer vs torch backend against fp32 (checks live in bench/gpu_suite.py
so the device run and pytest share them)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("section", ["correctness", "fi_vs_torch"])
def test_runtime_section_checks_pass(section: str) -> None:
    from bench import gpu_suite

    gpu_suite.RESULTS["checks"].clear()
    gpu_suite.SECTIONS[section]()
    failed = [c for c in gpu_suite.RESULTS["checks"] if not c["ok"]]
    assert gpu_suite.RESULTS["checks"] and not failed, failed
