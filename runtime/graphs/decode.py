"""Decode CUDA graphs: one graph per (stream/partition, padded batch size).

A graph keeps the SM partition of the stream it was captured on (H200.md: a graph captured on
a green stream replays on that partition; one captured on an ordinary stream runs on every SM),
so a runner that switches splits captures one `DecodeGraphs` per decode stream and
`DecodeGraphRegistry` picks the set for the stream a decode step runs on. Each captured batch
size owns a
CUDA-graph-safe FlashInfer backend instance (fixed index buffers + its own workspace) and
static input/output tensors; `run()` pads the batch to the next captured size, plans the
backend outside the graph (plan only fills the fixed buffers), copies inputs, and replays.

Padding rows attend to, and write into, `pad_block_id`: a block the caller reserves (the block
manager must never hand it out), so padded rows never touch a live sequence's KV.

Batch sizes up to `fused_max_batch` run the fused Triton decode (runtime/model/fused_decode.py:
8 launches per layer, no FlashInfer plan) instead of the model's forward on FlashInfer.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.attention.base import ForwardBatch, SeqSlice
from runtime.attention.flashinfer_backend import (
    FlashInferBackend,
    one_chunk_decode_supported,
    one_chunk_min_rows,
    prefer_one_chunk,
)
from runtime.diagnostics import fallbacks
from runtime.model.llama import LlamaForCausalLM

log = logging.getLogger("greenlane.cuda_graphs")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Per split (green decode stream) fewer sizes: every size costs a capture (~3 forwards) and a
# graph-mode FlashInfer instance (fixed index buffers plus the wrappers' own int workspaces),
# times up to one set per pre-created split. Padding a decode batch to the next size costs
# little: decode is weight-bandwidth bound, and a pad row attends to one token.
SPLIT_BATCH_SIZES = (1, 8, 16, 32, 64, 128, 256)


def graph_batch_sizes(
    max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
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


class DecodeStep(Protocol):
    """The forward one captured graph replays: `plan` (outside the graph) fills the fixed
    buffers the forward reads; `forward` is what gets captured."""

    def plan(self, batch: ForwardBatch) -> None: ...
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class ModelDecodeStep:
    """The model's own forward on a CUDA-graph-safe FlashInfer backend instance."""

    def __init__(self, model: LlamaForCausalLM, backend: FlashInferBackend) -> None:
        self.model = model
        self.backend = backend

    def plan(self, batch: ForwardBatch) -> None:
        self.backend.plan(batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.backend)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    step: DecodeStep
    input_ids: torch.Tensor  # [bs] int64
    positions: torch.Tensor  # [bs] int64
    hidden: torch.Tensor  # [bs, hidden] output


class DecodeGraphs:
    """The decode graphs of ONE stream: one captured graph per batch size, all replayed on
    `stream` (so on its SM partition when it is a green-context stream)."""

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
        workspace: torch.Tensor | None = None,
        pool: Any = None,
        label: str = "whole GPU",
        fused_max_batch: int = 0,
        fuse_rope_kv_write: bool = False,
        kv_split: str = "always",
    ) -> None:
        """workspace: a FlashInfer float workspace to share with other sets (safe only while
        sets never replay concurrently: the runner runs one decode step at a time). pool: a
        `torch.cuda.graph_pool_handle()` shared with other sets (None: one of its own).
        fused_max_batch: batch sizes up to this run the fused Triton decode (0: none).
        kv_split: decode attention's KV split in the graphs (`EngineConfig.decode_kv_split`):
        always (FlashInfer's split plan and its merge kernel), never (one chunk a request, no
        merge; where the model's decode runs on tensor cores), auto (one chunk from the batch
        size where FlashInfer's split would give one chunk anyway: `prefer_one_chunk`)."""
        if kv_split not in ("always", "never", "auto"):
            raise ValueError(f"kv_split must be always, never or auto, got {kv_split!r}")
        self.model = model
        self.k_caches, self.v_caches = k_caches, v_caches
        self.stream = stream
        self.pad_block_id = pad_block_id
        self.max_blocks_per_seq = max_blocks_per_seq
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.workspace_bytes = workspace_bytes
        self.label = label
        self.fused_max_batch = fused_max_batch
        self.fuse_rope_kv_write = fuse_rope_kv_write  # passed to each size's backend
        self.kv_split = kv_split
        self.one_chunk_sizes: list[int] = []  # captured with one chunk a request (no merge)
        self.fused_errors: dict[int, str] = {}  # batch size -> why its fused step was dropped
        self.graphs: dict[int, _Graph] = {}
        self.capture_s: dict[int, float] = {}  # seconds spent capturing each size
        # Device bytes capture() added: allocated (live buffers, graph outputs) and reserved
        # (also the graph pool's intermediates, cached for replays).
        self.memory_bytes = 0
        self.reserved_bytes = 0
        self._pool = pool  # graphs share one memory pool (captured largest first)
        # One workspace for every batch size: graphs of one stream replay one at a time.
        # (Tensor-core decode at batch 256 x 2k needed ~84 MB of FlashInfer scratch on the H200.)
        self.workspace = (
            workspace
            if workspace is not None
            else torch.empty(workspace_bytes, dtype=torch.uint8, device=k_caches[0].device)
        )

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _pad(self, batch: ForwardBatch, bs: int) -> list[SeqSlice]:
        return pad_seqs(batch.seqs, bs, self.pad_block_id)

    def capture(self) -> None:
        """Capture every batch size on `self.stream` (largest first so the pool is reused).
        Warm-ups and capture write only the reserved pad block (every row is a pad row)."""
        dev = self.k_caches[0].device
        base = torch.cuda.memory_allocated(dev)
        base_reserved = torch.cuda.memory_reserved(dev)
        # Work already queued on the stream (a decode step) must finish before capture starts.
        self.stream.synchronize()
        for bs in sorted(self.batch_sizes, reverse=True):
            t0 = time.perf_counter()
            step = self._make_step(bs)
            ids = torch.zeros(bs, dtype=torch.int64, device=dev)
            pos = torch.zeros(bs, dtype=torch.int64, device=dev)
            dummy = ForwardBatch(ids, pos, [], torch.arange(bs, device=dev), True)
            dummy.seqs = self._pad(dummy, bs)
            with torch.cuda.stream(self.stream):
                step = self._warm_up(step, bs, dummy)
                self.stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool, stream=self.stream):
                    hidden = step.forward(ids, pos)
                if self._pool is None:
                    self._pool = g.pool()
            self.graphs[bs] = _Graph(g, step, ids, pos, hidden)
            self.capture_s[bs] = time.perf_counter() - t0
        self.memory_bytes = max(0, torch.cuda.memory_allocated(dev) - base)
        # torch.cuda.graph() empties the cache on entry, so this may undercount (never over).
        self.reserved_bytes = max(0, torch.cuda.memory_reserved(dev) - base_reserved)

    def _warm_up(self, step: DecodeStep, bs: int, dummy: ForwardBatch) -> DecodeStep:
        """Two forwards outside capture (allocations, lazy init, Triton compiles). A fused
        step that fails here (a kernel that does not compile on this GPU) is replaced by the
        unfused one, said once: the engine still starts."""
        try:
            step.plan(dummy)
            for _ in range(2):
                step.forward(dummy.input_ids, dummy.positions)
            return step
        except Exception as e:
            if not isinstance(step, ModelDecodeStep):
                self.fused_errors[bs] = fallbacks.take(
                    f"fused decode, batch {bs} on {self.label}",
                    e,
                    "that batch size decodes with FlashInfer + cuBLAS",
                    log,
                )
                return self._warm_up(self._make_step(bs, fused=False), bs, dummy)
            raise

    def _one_chunk(self, bs: int) -> bool:
        """Whether batch size `bs` is captured with one KV chunk a request."""
        cfg = self.model.cfg
        if self.kv_split == "always" or not one_chunk_decode_supported(
            cfg.num_q_heads, cfg.num_kv_heads
        ):
            return False
        if self.kv_split == "never":
            return True
        num_sms = torch.cuda.get_device_properties(self.k_caches[0].device).multi_processor_count
        return prefer_one_chunk(bs, one_chunk_min_rows(cfg.num_kv_heads, num_sms))

    def _make_step(self, bs: int, fused: bool = True) -> DecodeStep:
        if fused and bs <= self.fused_max_batch:
            from runtime.model.fused_decode import FusedDecodeStep

            return FusedDecodeStep(
                self.model, self.k_caches, self.v_caches, bs, self.max_blocks_per_seq
            )
        cfg = self.model.cfg
        one_chunk = self._one_chunk(bs)
        if one_chunk and bs not in self.one_chunk_sizes:
            self.one_chunk_sizes.append(bs)
        backend = FlashInferBackend(
            self.k_caches,
            self.v_caches,
            cfg.num_q_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            workspace=self.workspace,
            graph_batch_size=bs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            fuse_rope_kv_write=self.fuse_rope_kv_write,
            decode_one_chunk=one_chunk,
        )
        return ModelDecodeStep(self.model, backend)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode batch (len(seqs) <= max_batch_size); returns hidden [n, H].
        Plans, copies the inputs and replays on the CURRENT stream: a graph's kernels keep
        the SM partition of the stream they were captured on wherever they are launched
        (H200.md), so there is no need to hop onto `self.stream` (at batch 1 the two event
        waits of a hop were ~5 % of the host work of a step)."""
        n = len(batch.seqs)
        bs = bucket_for(n, self.batch_sizes)
        g = self.graphs[bs]
        padded = ForwardBatch(
            batch.input_ids, batch.positions, self._pad(batch, bs), batch.logits_indices, True
        )
        g.step.plan(padded)
        g.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        g.positions[:n].copy_(batch.positions, non_blocking=True)
        g.graph.replay()
        return g.hidden[:n]


class GraphSet(Protocol):
    """What the registry needs of a set of decode graphs (`DecodeGraphs`, or a test fake)."""

    stream: Any
    batch_sizes: tuple[int, ...]
    capture_s: dict[int, float]

    @property
    def max_batch_size(self) -> int: ...
    def capture(self) -> None: ...
    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


def cuda_stream_key(stream: Any) -> int:
    """A CUDA stream's identity: its raw handle. `torch.cuda.current_stream()` returns a new
    wrapper object on every call (also for an ExternalStream made current), so identity and
    `is` comparisons do not work; the handle does."""
    return int(stream.cuda_stream)


Progress = Callable[[int, int, str, float], None]  # (done, total, label, capture_s)


class DecodeGraphRegistry:
    """Decode graph sets keyed by the stream they were captured on.

    - the whole-GPU set (`whole`, captured at start-up on the runner's ordinary decode
      stream) serves every stream that is not a registered split stream: from an ordinary
      stream a graph runs on all SMs anyway, so one set is enough;
    - a split's green decode stream is `register`ed (the PD loop does it before its first
      decode step there) and its set captured lazily on first use, or eagerly with
      `capture_for_streams` (engine start-up, with progress);
    - a set that fails to capture (e.g. out of memory) is remembered as None: that stream
      decodes eagerly (a logged FALLBACK), and capture is not retried every step.
    `for_stream(torch.cuda.current_stream())` is the runner's per-step lookup: dict hits only,
    except for the one step that captures a registered stream's set.
    """

    def __init__(
        self,
        make_set: Callable[[Any, str], GraphSet],
        whole: GraphSet | None,
        *,
        key: Callable[[Any], Any] = cuda_stream_key,
        current_stream: Callable[[], Any] = torch.cuda.current_stream,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """make_set(stream, label) builds an uncaptured set for a split's decode stream.
        key / current_stream / clock: CUDA defaults; tests pass host stand-ins."""
        self.make_set = make_set
        self.current_stream = current_stream
        self.whole = whole
        self.key = key
        self.clock = clock
        self.sets: dict[Any, GraphSet | None] = {}  # captured (None = failed: eager there)
        self.labels: dict[Any, str] = {}
        self.capture_s: dict[str, float] = {}  # label -> seconds to capture its set
        self.capture_errors: dict[str, str] = {}  # label -> why its set could not be captured
        self._pending: dict[Any, tuple[Any, str]] = {}  # registered, not yet captured
        if whole is not None:
            k = key(whole.stream)
            self.sets[k] = whole
            self.labels[k] = "whole GPU"

    def register(self, stream: Any, label: str) -> None:
        """`stream` is a split's decode stream: capture its own set when first used."""
        k = self.key(stream)
        if k not in self.sets and k not in self._pending:
            self._pending[k] = (stream, label)
            self.labels[k] = label

    def is_split_stream(self, stream: Any) -> bool:
        k = self.key(stream)
        return k in self._pending or (k in self.sets and self.sets[k] is not self.whole)

    def capture_for_streams(
        self,
        streams: dict[str, Any] | Iterable[tuple[str, Any]],
        progress: Progress | None = None,
    ) -> None:
        """Capture the sets of these (label, split decode stream) pairs now, e.g. at start-up
        for every pre-created split; `progress(done, total, label, capture_s)` after each."""
        items = list(streams.items() if isinstance(streams, dict) else streams)
        for i, (label, stream) in enumerate(items):
            self.register(stream, label)
            k = self.key(stream)
            if k in self._pending:
                self._capture(k)
            if progress is not None:
                progress(i + 1, len(items), label, self.capture_s.get(label, 0.0))

    def for_stream(self, stream: Any) -> GraphSet | None:
        """The set to replay for a decode step on `stream` (None: decode eagerly)."""
        k = self.key(stream)
        if k in self.sets:
            return self.sets[k]
        if k in self._pending:
            return self._capture(k)
        return self.whole

    def _capture(self, k: Any) -> GraphSet | None:
        stream, label = self._pending.pop(k)
        t0 = self.clock()
        gs: GraphSet | None
        try:
            gs = self.make_set(stream, label)
            gs.capture()
        except Exception as e:  # noqa: BLE001 - any failure: this split decodes eagerly
            gs = None
            self.capture_errors[label] = fallbacks.take(
                f"decode graphs on {label}",
                e,
                "decode steps there run eagerly",
                log,
                failed=f"decode graphs for split {label} could not be captured",
            )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        dt = self.clock() - t0
        self.sets[k] = gs
        if gs is not None:
            self.capture_s[label] = dt
            log.info(
                "decode graphs for split %s captured in %.2f s (batch sizes %s)",
                label,
                dt,
                ",".join(map(str, gs.batch_sizes)),
            )
        return gs

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per label: captured or not, batch sizes, capture seconds (stats / benchmarks)."""
        out: dict[str, dict[str, Any]] = {}
        for k, label in self.labels.items():
            gs = self.sets.get(k)
            out[label] = {
                "captured": gs is not None,
                "pending": k in self._pending,
                "batch_sizes": list(gs.batch_sizes) if gs is not None else [],
                "capture_s": self.capture_s.get(label),
                "memory_bytes": getattr(gs, "memory_bytes", None),
                "reserved_bytes": getattr(gs, "reserved_bytes", None),
            }
        return out
