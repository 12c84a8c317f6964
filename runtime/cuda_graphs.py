"""Decode CUDA graphs: one graph per (stream/partition, padded batch size).

A graph keeps the SM partition of the stream it was captured on (H200.md), so a runner that
switches splits captures one `DecodeGraphs` per decode stream. Each captured batch size owns a
CUDA-graph-safe FlashInfer backend instance (fixed index buffers + its own workspace) and
static input/output tensors; `run()` pads the batch to the next captured size, plans the
backend outside the graph (plan only fills the fixed buffers), copies inputs, and replays.

Padding rows attend to, and write into, `pad_block_id`: a block the caller reserves (the block
manager must never hand it out), so padded rows never touch a live sequence's KV.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from runtime.attention.base import ForwardBatch, SeqSlice
from runtime.attention.flashinfer_backend import FlashInferBackend
from runtime.model import LlamaForCausalLM

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
                      ) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` up to max_num_seqs, plus max_num_seqs itself so
    every decode batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    kept = sorted({b for b in sizes if b <= max_num_seqs} | {max_num_seqs})
    return tuple(kept)


def bucket_for(num_seqs: int, batch_sizes: tuple[int, ...]) -> int:
    """Smallest captured size >= num_seqs (batch_sizes sorted ascending)."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    if num_seqs < 1 or i == len(batch_sizes):
        raise ValueError(f"no captured graph for a batch of {num_seqs}")
    return batch_sizes[i]


def pad_seqs(seqs: list[SeqSlice], batch_size: int, pad_block_id: int) -> list[SeqSlice]:
    """`seqs` plus pad rows up to batch_size: each pad row has no context and writes its one
    token into the reserved pad block, so it never touches a live sequence's KV."""
    out = list(seqs)
    for i in range(len(out), batch_size):
        out.append(SeqSlice(i, 1, 0, 1, [pad_block_id]))
    return out


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    backend: FlashInferBackend
    input_ids: torch.Tensor  # [bs] int64
    positions: torch.Tensor  # [bs] int64
    hidden: torch.Tensor  # [bs, hidden] output


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        stream: torch.cuda.Stream,
        *,
        pad_block_id: int,
        max_blocks_per_seq: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        workspace_bytes: int = 256 << 20,
    ) -> None:
        self.model = model
        self.k_caches, self.v_caches = k_caches, v_caches
        self.stream = stream
        self.pad_block_id = pad_block_id
        self.max_blocks_per_seq = max_blocks_per_seq
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.workspace_bytes = workspace_bytes
        self.graphs: dict[int, _Graph] = {}
        self.capture_s: dict[int, float] = {}  # seconds spent capturing each size
        self._pool = None  # graphs share one memory pool (captured largest first)
        # One workspace for every batch size: graphs of one stream replay one at a time.
        # (Tensor-core decode at batch 256 x 2k needed ~84 MB of FlashInfer scratch on the H200.)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8,
                                     device=k_caches[0].device)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _pad(self, batch: ForwardBatch, bs: int) -> list[SeqSlice]:
        return pad_seqs(batch.seqs, bs, self.pad_block_id)

    def capture(self) -> None:
        """Capture every batch size on `self.stream` (largest first so the pool is reused)."""
        cfg = self.model.cfg
        dev = self.k_caches[0].device
        for bs in sorted(self.batch_sizes, reverse=True):
            t0 = time.perf_counter()
            be = FlashInferBackend(
                self.k_caches, self.v_caches, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
                workspace=self.workspace, graph_batch_size=bs,
                max_blocks_per_seq=self.max_blocks_per_seq,
            )
            ids = torch.zeros(bs, dtype=torch.int64, device=dev)
            pos = torch.zeros(bs, dtype=torch.int64, device=dev)
            dummy = ForwardBatch(ids, pos, [], torch.arange(bs, device=dev), True)
            dummy.seqs = self._pad(dummy, bs)
            with torch.cuda.stream(self.stream):
                be.plan(dummy)
                for _ in range(2):  # warm-up outside capture (allocations, lazy init)
                    self.model(ids, pos, be)
                self.stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, stream=self.stream):
                    hidden = self.model(ids, pos, be)
                if self._pool is None:
                    self._pool = g.pool()
            self.graphs[bs] = _Graph(g, be, ids, pos, hidden)
            self.capture_s[bs] = time.perf_counter() - t0

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode batch (len(seqs) <= max_batch_size); returns hidden [n, H]."""
        n = len(batch.seqs)
        bs = bucket_for(n, self.batch_sizes)
        g = self.graphs[bs]
        padded = ForwardBatch(batch.input_ids, batch.positions, self._pad(batch, bs),
                              batch.logits_indices, True)
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)  # inputs were produced on the caller's stream
        with torch.cuda.stream(self.stream):
            g.backend.plan(padded)
            g.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
            g.positions[:n].copy_(batch.positions, non_blocking=True)
            g.graph.replay()
        caller.wait_stream(self.stream)  # the caller reads `hidden` on its own stream
        return g.hidden[:n]

