"""Disjoint (prefill, decode) CUDA green-context stream pairs, through raw `cuda.bindings`.

Why raw driver calls: `torch.cuda.green_contexts.GreenContext.create(n)` splits the *whole*
device on every call, so two such contexts overlap. A disjoint pair must come from ONE
`cuDevSmResourceSplitByCount`: the group becomes the prefill partition and the remainder the
decode partition.

Hazards (see shared/notes/green-contexts-and-flashinfer.md):
- Kernels on ordinary (primary-context) streams are not fenced and may run on every SM, so
  all prefill work and all decode work must go to their green streams.
- The primary context and cuBLAS must be initialised before the first green context.
- Green contexts and their streams are kept alive for the life of the process (switching a
  split = choosing another pre-created pair; nothing is created on the hot path).
- `torch.cuda.synchronize()` is not relied on to cover green streams; sync streams/events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class GreenContextError(RuntimeError):
    """Green contexts are unavailable or a driver call failed."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]
    except ImportError as exc:  # cuda-bindings is optional: CPU installs do not have it
        raise GreenContextError(f"cuda-bindings is not installed ({exc})") from exc
    return driver


def _check(result: tuple) -> Any:
    """Unwrap a cuda-bindings `(CUresult, *outputs)` tuple, raising on error."""
    cu = _driver()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise GreenContextError(f"CUDA driver call failed: {name!r}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@dataclass(frozen=True, slots=True)
class SmLayout:
    """What the device allows: SM count and the partition granularity."""

    total_sms: int
    min_partition_sms: int  # smallest group a split may produce
    alignment_sms: int  # group sizes must be multiples of this

    def valid_prefill_counts(self, min_decode_sms: int | None = None) -> list[int]:
        """Prefill group sizes that leave a decode remainder of at least `min_decode_sms`."""
        floor = self.min_partition_sms if min_decode_sms is None else min_decode_sms
        out = []
        n = max(self.min_partition_sms, self.alignment_sms)
        while n <= self.total_sms - floor:
            out.append(n)
            n += self.alignment_sms
        return out


@dataclass(slots=True)
class GreenStream:
    """One green context and its stream. Keep the object alive as long as the stream is used."""

    sms: int  # SMs actually granted
    context: Any  # CUgreenCtx
    raw_stream: Any  # CUstream
    stream: torch.cuda.ExternalStream


@dataclass(slots=True)
class GreenPair:
    """A disjoint prefill/decode partition made from one split."""

    prefill: GreenStream
    decode: GreenStream

    @property
    def prefill_sms(self) -> int:
        return self.prefill.sms


def _warm_primary_context(device_index: int) -> None:
    # Primary context and cuBLAS first: green contexts retain the primary context, and a
    # public report saw CUBLAS_STATUS_INTERNAL_ERROR without the cuBLAS warm-up.
    with torch.cuda.device(device_index):
        a = torch.ones(16, 16, device=f"cuda:{device_index}")
        (a @ a).sum().item()


def _device_sm_resource(device_index: int) -> tuple[Any, Any]:
    cu = _driver()
    dev = _check(cu.cuDeviceGet(device_index))
    res = _check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    return dev, res


def read_sm_layout(device_index: int = 0) -> SmLayout:
    """SM count and granularity from the driver (not hard-coded to Hopper's 132 / 8).

    `minSmPartitionSize` and `smCoscheduledAlignment` exist in CUDA 12.8+ resources; older
    bindings lack them, in which case the compute-capability rule is used (8 on 9.0+)."""
    _warm_primary_context(device_index)
    _, res = _device_sm_resource(device_index)
    total = int(res.sm.smCount)
    min_size = int(getattr(res.sm, "minSmPartitionSize", 0) or 0)
    align = int(getattr(res.sm, "smCoscheduledAlignment", 0) or 0)
    if min_size <= 0 or align <= 0:
        major, _ = torch.cuda.get_device_capability(device_index)
        # Driver-documented guideline when the resource does not say: 9.0+ needs 8-SM groups
        # in multiples of 8; 8.x allows 4/2; 7.x 2/2.
        fallback = (8, 8) if major >= 9 else ((4, 2) if major >= 8 else (2, 2))
        min_size = min_size or fallback[0]
        align = align or fallback[1]
    return SmLayout(total_sms=total, min_partition_sms=min_size, alignment_sms=align)


def _make_green_stream(dev: Any, resource: Any, device_index: int) -> GreenStream:
    cu = _driver()
    desc = _check(cu.cuDevResourceGenerateDesc([resource], 1))
    ctx = _check(
        cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
    )
    # NON_BLOCKING is required for green-context streams.
    raw = _check(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    granted = _check(cu.cuGreenCtxGetDevResource(ctx, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    stream = torch.cuda.ExternalStream(int(raw), device=f"cuda:{device_index}")
    return GreenStream(sms=int(granted.sm.smCount), context=ctx, raw_stream=raw, stream=stream)


def create_pair(prefill_sms: int, device_index: int = 0) -> GreenPair:
    """One split: `prefill_sms` in a group (aligned), decode gets the remainder."""
    cu = _driver()
    dev, full = _device_sm_resource(device_index)
    groups, num_groups, remainder = _check(cu.cuDevSmResourceSplitByCount(1, full, 0, prefill_sms))
    if int(num_groups) != 1:
        raise GreenContextError(f"split of {prefill_sms} SMs produced {num_groups} groups")
    prefill = _make_green_stream(dev, groups[0], device_index)
    decode = _make_green_stream(dev, remainder, device_index)
    if prefill.sms != prefill_sms:
        raise GreenContextError(f"asked for {prefill_sms} prefill SMs, got {prefill.sms}")
    return GreenPair(prefill=prefill, decode=decode)


def create_pairs(prefill_counts: list[int], device_index: int = 0) -> dict[int, GreenPair]:
    """Pre-create one pair per split (each ~2 ms), at start-up."""
    _warm_primary_context(device_index)
    return {n: create_pair(n, device_index) for n in prefill_counts}


def green_contexts_unavailable_reason(device_index: int = 0) -> str:
    """ "" when green contexts can be used, else a human-readable reason."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        cu = _driver()
    except GreenContextError as exc:
        return str(exc)
    if not hasattr(cu, "cuGreenCtxCreate"):
        return "the installed cuda-bindings has no green-context API"
    try:
        version = _check(cu.cuDriverGetVersion())
    except GreenContextError as exc:
        return str(exc)
    if int(version) < 12040:
        return f"the CUDA driver ({version}) is older than 12.4, which green contexts need"
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 7:
        return "green contexts need compute capability 7.0 or newer"
    return ""
