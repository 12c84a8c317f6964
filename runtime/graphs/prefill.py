"""Piecewise CUDA graphs for the prefill part of a step on the whole GPU.

Why: a step that prefills a few hundred tokens next to decodes ran the model eagerly, ~11
launches a layer through Python wrappers, and the host could not launch them as fast as the
GPU ran them. On the H200 (3B, plan s, 2026-12-02) such a step took 25-30 ms of device time
for a 70-160-token prefill next to a 3.8 ms decode graph, and its time varied with the host's
jitter, which is what the TBT cut could not predict (issue 13) and part of the host overhead of
issue 12.

What: the dense work of the model (embedding, norms, q/k/v projection, RoPE, o_proj, MLP) is
captured as CUDA graphs per token bucket, cut at attention, which runs eagerly between them
(its plan depends on the batch's sequences, contexts and prefix hits; FlashInfer planned it
before the step, as for eager steps). A bucket of `n` tokens holds `num_layers + 1` graphs:

    graph 0      embed -> layer 0's input norm -> q, k, v of layer 0
    graph i      layer i-1's o_proj, post-attention norm and MLP -> layer i's input norm ->
                 q, k, v of layer i                                   (i = 1 .. L-1)
    graph L      layer L-1's o_proj, norm and MLP -> the final norm -> hidden

and a step of T <= n tokens replays them with attention over its T real rows in between.

With `kv_write` (`prefill_graphs_write_kv`, on by default since 2026-12-05) each segment also
runs the fused RoPE + K/V pool write on layer i's q, k, v, at the slots `run` copies into a
static buffer (-1: padding rows and a discarded scoring suffix, never written), so only
attention runs between replays: a graph-path step's host time per layer was a replay, the
fused write's Triton launch and FlashInfer's `run()` (py-spy, H100, 2026-12-05), and short
steps next to scoring launched for as long as they ran.

Measured on the H200 (3B, one prefill part, `gpu_suite --sections prefill_graphs`): the host
enqueues a part in ~2-3 ms instead of ~8-10; its wall time is 0.41x the eager one at 16
tokens, 0.49x at 160, 0.79x at 512, a tie at 1,024 (GPU-bound) and 1.07x at 2,048, hence the
default `prefill_graph_max_tokens` of 1,024. Through HTTP (plan v, `--tbt-slo-ms 80`, mixed
chat) the fixed cost the TBT cut fits for a mixed step fell from ~13-18 ms to ~3 ms.

Buffers: every graph reads and writes views `[:n]` of one set of static tensors sized for the
largest bucket (token ids, positions, the residual stream, q, k, v, the attention output, the
final hidden states), so the buckets share them; intermediates live in the graphs' own memory
pool (captured largest first). Rows T..n are padding: they hold whatever an earlier step left
(finite values) and only ever mix with themselves, since every captured op is row-wise;
attention and the KV writes see the first T rows only.

Buckets: after capture each bucket's dense replay is timed, and a bucket that a larger one
beats (`dominated_buckets`) serves no part; its parts pad to the next kept bucket. cuBLAS plans
some row counts badly (H100, 8B: 448 rows ~4 ms slower than 480), which no ladder can foresee.

Hazards:
- With `kv_write` the static slot buffer must hold -1 past T before every replay: padding
  rows keep the rows of a larger earlier step, and their stale slots belong to live requests.
- A graph keeps the SM partition of the stream it was captured on (H200.md): these are
  captured on an ordinary stream and run on every SM, so they serve only prefill parts that
  run on the whole GPU (`ModelRunner._prefill_forward`; the split executor's partitioned prefill
  runs the layers itself and never comes here).
- The returned hidden states are a view of a static buffer that the next replay overwrites:
  the caller consumes them (logits rows, prompt logprobs) on the same stream before the next
  step's prefill is enqueued, which stream order makes safe.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from runtime.attention.base import AttentionBackend
from runtime.config import EngineConfig
from runtime.model.llama import LlamaForCausalLM, attend

log = logging.getLogger("greenlane.prefill_graphs")

# Buckets below 256 tokens: a step that small is bound by the weight reads and the launches,
# so padding it to a coarse bucket costs little. From 256 tokens a step turns compute-bound
# (the 8B's GEMMs from ~200 rows on the H200), so every padded row costs its share of the
# step: there the ladder's granule is `padding` x the power of two below, so a part is padded
# by at most that fraction (0.5: 256, 384, 512, 768, 1024, 1536, 2048, the first ladder's).
SMALL_TOKEN_SIZES = (16, 32, 64, 96, 128, 192, 256)


def prefill_graph_max_tokens(config: EngineConfig) -> int:
    """The largest bucket: `prefill_graph_max_tokens`, cut at the step's token budget (a part
    is never longer, a long scoring prompt running alone excepted) and, with hybrid prefill, at
    its chunk (a longer part runs its token-wise ops in chunks, eagerly)."""
    m = min(config.prefill_graph_max_tokens, config.prefill_token_budget)
    if config.hybrid_prefill:
        m = min(m, config.chunk_tokens())
    return max(0, m)


def prefill_graph_sizes(max_tokens: int, padding: float) -> tuple[int, ...]:
    """The token buckets to capture up to `max_tokens` (itself included; 0: none): the small
    ones, then from 256 tokens a granule of `padding` x the power of two at or below the
    bucket (at least 16 tokens), so a part of >= 256 tokens is padded by at most `padding`."""
    if max_tokens <= 0:
        return ()
    sizes = {s for s in SMALL_TOKEN_SIZES if s <= max_tokens}
    s = SMALL_TOKEN_SIZES[-1]
    while s < max_tokens:
        granule = max(16, int((1 << (s.bit_length() - 1)) * padding) // 16 * 16)
        s += granule
        if s <= max_tokens:
            sizes.add(s)
    return tuple(sorted(sizes | {max_tokens}))


# A bucket is dropped when a larger one replays at least this much faster (a fraction of the
# bucket's own time): below it the two are a tie within the timing's noise, and either serves.
DOMINATED_MARGIN = 0.02


def dominated_buckets(bucket_ms: dict[int, float]) -> list[int]:
    """The buckets of `bucket_ms` (tokens -> measured replay ms) that a larger bucket beats
    by more than `DOMINATED_MARGIN`: a part padded to the larger one runs faster. The largest
    bucket is always kept. Ascending."""
    dropped, best_larger = [], float("inf")
    for n in sorted(bucket_ms, reverse=True):
        if best_larger < bucket_ms[n] * (1.0 - DOMINATED_MARGIN):
            dropped.append(n)
        else:
            best_larger = min(best_larger, bucket_ms[n])
    return sorted(dropped)


def prefill_graph_bytes(model: LlamaForCausalLM, max_tokens: int, dtype: torch.dtype) -> int:
    """Device bytes the graphs of buckets up to `max_tokens` hold: the static buffers plus an
    estimate of the pool's peak (the largest bucket's MLP intermediates dominate). The engine
    adds it to the activation reserve when it sizes the KV pool."""
    if max_tokens <= 0:
        return 0
    c = model.cfg
    elem = torch.empty((), dtype=dtype).element_size()
    static = max_tokens * (3 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size) * elem
    static += 2 * max_tokens * 8  # token ids, positions (int64)
    pool = max_tokens * (3 * c.intermediate_size + 3 * c.hidden_size + c.q_size + 2 * c.kv_size)
    return static + pool * elem


class PrefillGraphs:
    """The piecewise graphs of the whole GPU, one set of `num_layers + 1` per token bucket.

    `capture()` records them on `stream`; `run(input_ids, positions, attn)` replays a bucket
    for a prefill part of T <= max_tokens tokens with attention (planned by the caller) between
    its graphs. `graphs[n][s]` needs only `replay()`: CPU tests put stand-ins there that run
    segment `s` (`_segment(s, n)`) directly, exercising the buffers, padding and boundaries.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        token_sizes: tuple[int, ...],
        *,
        stream: Any = None,
        pool: Any = None,
        rotate_in_attention: bool = False,
        kv_write: tuple[Callable[..., Any], list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        """rotate_in_attention: the graphs leave q and k un-rotated and `run` passes `rope=` to
        the backend (which fuses RoPE with its pool write); set it when the backend fuses.
        kv_write: (the fused RoPE + K/V write, each layer's flat K pool, each layer's flat V
        pool): the graphs rotate q and k and write the kept k/v into the pool themselves, at
        the slots `run` copies into a static buffer, and attention runs alone between the
        replays (`kv_written=`): one Python launch a layer fewer where the host paces a short
        step. Overrides rotate_in_attention."""
        if not token_sizes:
            raise ValueError("PrefillGraphs needs at least one token bucket")
        self.model = model
        self.token_sizes = tuple(sorted(token_sizes))
        self.stream = stream
        self._pool = pool
        self.kv_write = kv_write
        self.rotate_in_attention = rotate_in_attention and kv_write is None
        self.graphs: dict[int, list[Any]] = {}  # bucket -> num_layers + 1 CUDA graphs
        self.capture_s = 0.0
        self.memory_bytes = 0
        # Filled by `capture()`: each captured bucket's dense replay time (ms, the best of a
        # few), and the buckets dropped as slower than a larger one (`drop_dominated`).
        self.bucket_ms: dict[int, float] = {}
        self.dropped: dict[int, float] = {}
        c = model.cfg
        m = self.max_tokens
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.residual = torch.zeros(m, c.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(m, c.num_q_heads, c.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(m, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(m, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(m, c.q_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(m, c.hidden_size, dtype=dtype, device=device)
        # With kv_write: each row's pool slot, -1 = not written (padding rows, a discarded
        # suffix); `run` fills it before the first replay.
        self.slots = torch.full((m,), -1, dtype=torch.int64, device=device)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def num_segments(self) -> int:
        return self.model.num_layers + 1

    def bucket_for(self, num_tokens: int) -> int | None:
        """Smallest bucket >= num_tokens, or None when the part is too long for a graph."""
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if num_tokens < 1 or i == len(self.token_sizes):
            return None
        return self.token_sizes[i]

    # ---- segments: what each graph records ----------------------------------------------------
    def _qkv(self, i: int, x: torch.Tensor, n: int) -> None:
        """Layer i's q, k, v (normed, RoPE'd) of the first n rows into the static buffers; with
        kv_write, also its kept k/v into the pool."""
        rotate_here = not self.rotate_in_attention and self.kv_write is None
        q, k, v = self.model.layers[i].self_attn.project_qkv(
            x, self.positions[:n], self.model.rotary, apply_rope=rotate_here
        )
        if self.kv_write is not None:
            write, k_flat, v_flat = self.kv_write
            cos_sin = self.model.rotary.cos_sin_cache
            q, k = write(q, k, v, self.positions[:n], cos_sin, self.slots[:n], k_flat[i], v_flat[i])
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)

    def _add_norm(self, norm: Any, h: torch.Tensor, n: int) -> torch.Tensor:
        """residual += h; returns norm(residual). The FlashInfer op updates the residual in
        place; the torch one returns a new tensor, copied back."""
        res = self.residual[:n]
        x, new_res = norm.add_forward(h, res)
        if new_res is not res:
            res.copy_(new_res)
        return x

    def _after_attention(self, i: int, n: int) -> torch.Tensor:
        """Layer i from its attention output on: o_proj, post-attention norm, MLP."""
        layer = self.model.layers[i]
        a = layer.self_attn.o_proj(self.attn_out[:n])
        return layer.mlp(self._add_norm(layer.post_attention_layernorm, a, n))

    def _segment(self, s: int, n: int) -> None:
        model = self.model
        last = model.num_layers
        if s == 0:
            h = model.embed(self.input_ids[:n])
            self.residual[:n].copy_(h)
            self._qkv(0, model.layers[0].input_layernorm(h), n)
        elif s < last:
            h = self._after_attention(s - 1, n)
            self._qkv(s, self._add_norm(model.layers[s].input_layernorm, h, n), n)
        else:
            h = self._after_attention(last - 1, n)
            self.hidden[:n].copy_(self._add_norm(model.norm, h, n))

    # ---- capture and replay ------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up and capture every bucket on `self.stream`, largest first (one pool)."""
        dev = self.input_ids.device
        # Reserved, not allocated: the graphs' private pool keeps its segments reserved while
        # its blocks sit free between replays, so allocated bytes read ~0 after capture.
        base = torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        self.stream.synchronize()
        for n in sorted(self.token_sizes, reverse=True):
            with torch.cuda.stream(self.stream):
                for s in range(self.num_segments):  # cuBLAS handles, workspaces, lazy init
                    self._segment(s, n)
                self.stream.synchronize()
                graphs = []
                for s in range(self.num_segments):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._pool, stream=self.stream):
                        self._segment(s, n)
                    if self._pool is None:
                        self._pool = g.pool()
                    graphs.append(g)
                # One replay each now: a graph's first launch also uploads it to the device,
                # which would otherwise land on the first step that uses this bucket. Safe: the
                # graphs write only the static buffers and their pool (attention is outside).
                for g in graphs:
                    g.replay()
                self.stream.synchronize()
            self.graphs[n] = graphs
        self.bucket_ms = self.time_buckets()
        self.drop_dominated()
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = max(0, torch.cuda.memory_reserved(dev) - base)

    def time_buckets(self, repeats: int = 3) -> dict[int, float]:
        """Each captured bucket's replay of all its segments, attention left out (ms, the
        best of `repeats`): what padding a part to the bucket costs in dense work. A few ms
        a bucket at start-up (~23 buckets at the default 1,024 tokens)."""
        out: dict[int, float] = {}
        with torch.cuda.stream(self.stream):
            # On the replays' stream: with kv_write, they write no K/V.
            self.slots.fill_(-1)
            for n, graphs in self.graphs.items():
                best = float("inf")
                for _ in range(repeats):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for g in graphs:
                        g.replay()
                    end.record()
                    end.synchronize()
                    best = min(best, start.elapsed_time(end))
                out[n] = best
        return out

    def drop_dominated(self) -> None:
        """Serve no part from a bucket a larger one replays faster (`dominated_buckets`): its
        parts pad to the next kept bucket. On the H100 (8B) steps of 417-448 rows took ~4 ms
        more than steps of 449-480 at every context (30.6 against 26.6 ms at 8k): a GEMM
        shape cuBLAS plans badly, found only by timing it here. Timed at start-up there
        (`31fee8e`), the 448-row bucket's dense replays took 14.9 ms and the 512-row
        bucket's 10.8; 8 of 23 buckets were dropped."""
        dropped = dominated_buckets(self.bucket_ms)
        if not dropped:
            return
        kept = [n for n in self.token_sizes if n not in dropped]
        for n in dropped:
            larger = min(self.bucket_ms[m] for m in kept if m > n)
            self.dropped[n] = self.bucket_ms[n]
            log.info(
                "prefill graph bucket %d dropped: %.2f ms, a larger bucket %.2f ms",
                n,
                self.bucket_ms[n],
                larger,
            )
        # Their graphs stay (unreplayed): freeing graphs of one shared private pool while the
        # others live is not worth a few MiB.
        self.token_sizes = tuple(kept)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """A prefill part of T tokens (input_ids, positions: [T] on the device; `attn` already
        planned for it) -> final hidden states [T, H], a view of the static buffer."""
        T = int(input_ids.shape[0])
        n = self.bucket_for(T)
        if n is None or n not in self.graphs:
            raise ValueError(f"no captured prefill graph for {T} tokens")
        graphs = self.graphs[n]
        self.input_ids[:T].copy_(input_ids, non_blocking=True)
        self.positions[:T].copy_(positions, non_blocking=True)
        if self.kv_write is not None:  # rows past T (padding) keep -1: never written
            self.slots[:T].copy_(attn.row_slots(), non_blocking=True)
            self.slots[T:].fill_(-1)
        q, k, v = self.q[:T], self.k[:T], self.v[:T]
        # A backend that writes `out=` (FlashInfer) puts attention straight into the next
        # graph's input ([T, Hq, D] view of the contiguous [T, q_size] rows): no copy launched
        # per layer between the replays, where the host paces a short step (py-spy, H100,
        # 2026-12-05). Others return a tensor, copied here.
        out = self.attn_out[:T].view(q.shape)
        direct = bool(getattr(attn, "writes_out", False))
        rope = (self.positions[:T], self.model.rotary.cos_sin_cache)
        rope = rope if self.rotate_in_attention else None
        written = self.kv_write is not None
        graphs[0].replay()
        for i in range(self.model.num_layers):
            if direct:
                attend(attn, i, q, k, v, rope, out, kv_written=written)
            else:
                out.copy_(attend(attn, i, q, k, v, rope, kv_written=written))
            graphs[i + 1].replay()
        return self.hidden[:T]

    def summary(self) -> dict[str, Any]:
        return {
            "captured": bool(self.graphs),
            "token_sizes": list(self.token_sizes),
            "capture_s": round(self.capture_s, 3),
            "memory_bytes": self.memory_bytes,
        }
