"""The attention-backend interface: metadata planned once per step, used by every layer.

The runner builds a `ForwardBatch`, calls `backend.plan(batch)` once, then runs the model,
whose attention layers call `backend.forward(layer_idx, q, k, v)`. One backend instance per
CUDA stream that runs model work (prefill and decode run concurrently on different streams
when the GPU is partitioned), so planned metadata and workspaces are never shared.

KV layout (see `runtime/kv/kv_pool.py`): per layer, `k` and `v` tensors shaped
[num_blocks, block_size, num_kv_heads, head_dim]. Token position p of a sequence lives in
block `block_ids[p // block_size]` at offset `p % block_size`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.model.ops import host_tensor


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a flattened forward batch.

    Query rows [query_start, query_start + num_query_tokens) are this sequence's new tokens,
    at positions [num_context_tokens, num_context_tokens + num_query_tokens).

      positions:  0 .......... num_context_tokens ........ + num_query_tokens
                  |  KV already in the pool  |  new tokens (this step)   |
                  |<-------------- num_kept_tokens -------------->|  discarded suffix
    After this step the pool must hold KV for positions [0, num_kept_tokens); new tokens at
    positions >= num_kept_tokens are attended to (from this step's k/v) but never written:
    that is suffix-KV discard for scoring requests. For generation num_kept_tokens equals
    num_context_tokens + num_query_tokens.
    """

    query_start: int
    num_query_tokens: int
    num_context_tokens: int
    num_kept_tokens: int
    block_ids: list[int]  # covers positions [0, num_kept_tokens)


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all sequences' new tokens, flattened
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    logits_indices: torch.Tensor  # [N] int64: rows whose hidden state goes to the LM head
    is_decode: bool  # every sequence has num_query_tokens == 1 and context > 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class IndexSpans:
    """int64 indices (pool slots, batch rows) built span by span, in order, on the host, for
    one copy to the device. A long span is one tensor op, not one Python append per token: the
    context of a scoring request (14k tokens) cost ~4 ms of host per request as a loop (this
    VM), inside the step it plans. A short span (a decode's one slot) stays a list append, which
    is cheaper than a tensor op."""

    _parts: list[torch.Tensor] = field(default_factory=list)
    _ints: list[int] = field(default_factory=list)

    LONG = 64  # spans at least this long become tensors

    def add_range(self, start: int, end: int) -> None:
        """The integers [start, end)."""
        if end - start >= self.LONG:
            self._flush()
            self._parts.append(torch.arange(start, end, dtype=torch.int64))
        elif end > start:
            self._ints.extend(range(start, end))

    def add_slots(self, block_ids: Sequence[int], start: int, end: int, block_size: int) -> None:
        """Flat pool slots of positions [start, end) of a sequence whose KV is in `block_ids`
        (position p: block `block_ids[p // block_size]`, offset `p % block_size`)."""
        if end - start >= self.LONG:
            self._flush()
            first = start // block_size
            table = host_tensor(block_ids[first : (end - 1) // block_size + 1], torch.int64)
            pos = torch.arange(start, end, dtype=torch.int64)
            self._parts.append(table[pos // block_size - first] * block_size + pos % block_size)
        else:
            self._ints.extend(
                block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
            )

    def tensor(self, pin_memory: bool = False) -> torch.Tensor:
        """Everything added, in order, as one int64 host tensor (pinned if asked: its copy to
        the device is then asynchronous)."""
        if not self._parts:
            t = host_tensor(self._ints, torch.int64)
            return t.pin_memory() if pin_memory else t
        self._flush()
        out = torch.empty(
            sum(int(p.numel()) for p in self._parts), dtype=torch.int64, pin_memory=pin_memory
        )
        torch.cat(self._parts, out=out)
        return out

    def _flush(self) -> None:
        if self._ints:
            self._parts.append(host_tensor(self._ints, torch.int64))
            self._ints = []


# (positions [T] int64, cos/sin cache [P, D] float32): RoPE for the backend to apply.
Rope = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(Protocol):
    """Computes causal attention for a planned batch and keeps the paged KV pool up to date."""

    name: str
    # True: the model passes q and k un-rotated with `rope=` and the backend rotates them in
    # the same launch as the pool write (runtime/attention/rope_kv_write.py). A backend must
    # honour `rope=` either way; the model passes it only to one that fuses.
    fuses_rope: bool
    # True: `forward` takes `out=` (a [T, num_q_heads, head_dim] tensor of q's dtype that
    # aliases none of q, k, v) and writes the attention output there instead of allocating it.
    # A hybrid prefill hands it the layer's consumed hidden-state buffer: one [T, H] tensor less
    # at the activation peak, which bounds the longest scoring prompt. The model passes `out=`
    # only to a backend that sets this.
    writes_out: bool

    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata (slot mapping, index tensors, kernel plans). Called once
        per step, before the model's forward, on the stream that will run the forward."""
        ...

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope | None = None,
        out: torch.Tensor | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], RoPE applied
        (or, with `rope`, to be applied here). Writes k/v of kept positions into the pool for
        `layer_idx`, then returns the attention output [T, num_q_heads, head_dim] (each query
        attends to its sequence's positions <= its own: cached context from the pool plus this
        step's new tokens), in `out` when given (`writes_out`). `kv_written`: the caller has
        already rotated q and k and written the kept k/v to the pool at `row_slots()` (the
        prefill graphs do it inside their replay): attention only."""
        ...

    def row_slots(self) -> torch.Tensor:
        """The planned batch's pool slot of each row, [T] int64 on the device, -1 where the
        row's k/v is not kept (a scoring request's discarded suffix)."""
        ...

    # Row streaming, for the hybrid prefill of one long prompt (`DecoderLayer.forward_rows`):
    # the layer reads the cached context's K/V, projects this step's k/v chunk by chunk and
    # hands the kept rows to the pool, then attends each chunk of query rows to the keys
    # before it — no [T, Hq, D] q buffer at any time. The model uses these only where
    # `attends_rows()` says the planned batch allows it.

    def attends_rows(self) -> bool:
        """True when the planned batch is one prefill sequence (query rows = its positions
        ctx .. ctx + T - 1 after `num_context_rows()` cached ones): the methods below serve it."""
        ...

    def num_context_rows(self) -> int:
        """How many of the sequence's positions are cached in the pool (its context)."""
        ...

    def read_context(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the context's K/V for `layer_idx` from the pool into k, v ([ctx, Hkv, D])."""
        ...

    def write_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write the kept ones of query rows [start, start + len(k)) (k, v: [n, Hkv, D],
        RoPE'd) into the pool for `layer_idx`; rows at or past the kept tokens are not."""
        ...

    def attend_rows(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of the rows at positions len(k) - len(q) .. len(k) - 1 (q:
        [n, Hq, D], RoPE'd) to keys/values 0 .. len(k) - 1 ([L, Hkv, D]: context, then this
        step's rows); [n, Hq, D]. Reads and writes no pool."""
        ...


# The fused RoPE + K/V write runs on forwards of at most this many tokens (decode batches,
# prefill parts up to the largest prefill-graph bucket); longer prefill parts take RoPE and the
# two pool writes. Not for speed: plan l (H200, 2026-12-03) timed the tiled kernel faster than
# the unfused pair at every count up to 16k (8B: 175 vs 433 us a layer at 16k, ~8 ms of a
# 0.5 s prefill), but the kernel writes rotated q and k as new tensors, and a hybrid prefill of
# a long scoring prompt would hold that second [T, Hq + Hkv, D] copy (10 KiB a token on the 8B
# shape) where the layer rotates chunk by chunk into its own buffers: memory the longest prompt
# needs more than the 1.6 %.
FUSED_ROPE_MAX_TOKENS = 2048


def fuse_rope_for(num_tokens: int) -> bool:
    """Whether a forward of `num_tokens` rows takes the fused RoPE + K/V write (when the
    backend fuses at all)."""
    return num_tokens <= FUSED_ROPE_MAX_TOKENS


def load_rope_kv_write(wanted: bool, device: torch.device, head_dim: int) -> Callable | None:
    """The fused RoPE + K/V pool write (runtime/attention/rope_kv_write.py) for a backend
    asked to fuse, or None: not asked, an odd head_dim (no neox rotation), or no Triton to run
    it (CUDA, or its interpreter: the CPU tests set TRITON_INTERPRET=1), which it says. Triton
    is imported only here, only when it will be used."""
    if not wanted or head_dim % 2:
        return None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        logging.getLogger("greenlane.attention").warning(
            "fused RoPE + KV write needs CUDA (Triton); running unfused"
        )
        return None
    from runtime.attention.rope_kv_write import rope_kv_write

    return rope_kv_write
