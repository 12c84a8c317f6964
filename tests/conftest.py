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


@pytest.fixture(scope="module")
def server():
    """A module's HTTP server over the fake engine (tests/server_thread.py), default settings. A
    module that needs other settings defines its own `server`; `http` then uses that one."""
    from server_thread import fake_server

    with fake_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client on the module's `server`."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c
