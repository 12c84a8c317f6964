from __future__ import annotations

import pytest
import torch


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
    from runtime.convert import ensure_default_model

    return ensure_default_model()
