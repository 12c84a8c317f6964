"""The stream and event operations executors use: CUDA, or a host stand-in (CPU and tests)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import torch


class EventLike(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...


class StreamDevice(Protocol):
    """Streams and events."""

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def event(self) -> EventLike: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...
    def current_stream(self) -> Any: ...
    def allocator_counts(self) -> dict[str, int] | None:
        """Cumulative calls the memory allocator made to the driver (`ALLOCATOR_COUNTS`), or
        None where there is no such allocator. A diagnostic: a read walks the allocator's
        stats (its cost not measured), so it is read at a prefill's start only."""
        ...


# What `allocator_counts` reports, from torch's CUDA caching allocator's own counters: device
# allocations and frees (cudaMalloc / cudaFree, each a driver call; a free waits for the device),
# retries after a failed allocation (it frees the cache and tries again) and the
# synchronisations of every stream that such a free takes. Any of these on the engine thread
# holds it while the device may run dry.
ALLOCATOR_COUNTS = {
    "mallocs": "num_device_alloc",
    "frees": "num_device_free",
    "retries": "num_alloc_retries",
    "syncs": "num_sync_all_streams",
}


class CudaStreamDevice:
    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self) -> EventLike:
        return torch.cuda.Event(enable_timing=True)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def allocator_counts(self) -> dict[str, int] | None:
        stats = torch.cuda.memory_stats()
        return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTS.items()}


class HostEvent:
    """Completes when recorded (host work is synchronous); times with perf_counter."""

    def __init__(self) -> None:
        self.t_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t_s = time.perf_counter()

    def query(self) -> bool:
        return self.t_s is not None

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.t_s is not None and end.t_s is not None
        return (end.t_s - self.t_s) * 1e3


class HostStreamDevice:
    """CPU stand-in: streams are labels, work runs inline, events complete at once."""

    def context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> EventLike:
        return HostEvent()

    def wait_stream(self, stream: Any, other: Any) -> None:
        return None

    def current_stream(self) -> Any:
        return "host"

    def allocator_counts(self) -> dict[str, int] | None:
        return None


def stream_device_for(device: torch.device) -> StreamDevice:
    return CudaStreamDevice() if device.type == "cuda" else HostStreamDevice()
