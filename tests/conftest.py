from __future__ import annotations

import os

# Without CUDA, Triton kernels (runtime/model/decode_kernels.py) run under Triton's interpreter. It
# is chosen when a kernel is defined, so it must be set before anything imports triton.
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct folder (converted once into the ignored cache)."""
    from runtime.model.convert import ensure_default_model

    return ensure_default_model()
