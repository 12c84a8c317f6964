"""GPU: the allocator's driver calls that a start's launch reports (`launch_detail` in
the step trace) are counted under the names torch's CUDA caching allocator keeps: a fresh
allocation the cache cannot serve adds a device malloc, and emptying the cache a free. A
renamed counter would read 0 for ever and hide the stall it is there to find."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_allocator_counts_see_a_device_malloc_and_free() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from runtime.executor.streams import ALLOCATOR_COUNTS, CudaStreamDevice

    dev = CudaStreamDevice()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = dev.allocator_counts()
    assert before is not None and set(before) == set(ALLOCATOR_COUNTS)
    stats = torch.cuda.memory_stats()
    missing = [key for key in ALLOCATOR_COUNTS.values() if key not in stats]
    assert not missing, f"torch's allocator keeps no {missing}"
    x = torch.empty(3 * 2**28, dtype=torch.uint8, device="cuda")  # 768 MiB: not cached
    grown = dev.allocator_counts()
    assert grown is not None and grown["mallocs"] >= before["mallocs"] + 1
    del x
    torch.cuda.empty_cache()
    freed = dev.allocator_counts()
    assert freed is not None and freed["frees"] >= grown["frees"] + 1
    assert freed["retries"] == before["retries"]  # nothing failed to allocate
