"""GPU tests share one process: give each the device memory the last one held.

A shut-down `Engine` is freed only when the cyclic collector next runs (its thread, executor
and runner refer to each other), so without a collection between tests the engines of earlier
tests (model weights, KV pool, graphs' pools) pile up. On an H200's 139 GiB that went unseen;
on an H100's 80 GiB the whole `tests/gpu` run in one process ran out of memory in its 20th test
(2026-12-05, 74 GiB held by PyTorch)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _free_device_memory_after_each_test() -> Iterator[None]:
    yield
    torch = sys.modules.get("torch")  # never imported here for a CPU run's skipped tests
    if torch is None or not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
