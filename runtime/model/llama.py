"""Llama-family decoder (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3) as plain `nn.Module`s.

Parameter names follow Hugging Face's, minus the `model.` prefix, except for the two fused
projections: `layers.N.self_attn.qkv_proj` (= q_proj | k_proj | v_proj stacked on the output
dim) and `layers.N.mlp.gate_up_proj` (= gate_proj | up_proj). `runtime/model/loader.py` does the
mapping.

The residual stream is carried separately (`h`, `residual`) so every norm after the first is a
fused add + RMSNorm; a layer returns (mlp_out, residual) and the final norm adds them.

Hybrid prefill (`chunk_tokens=C`, used when T > C): per layer, the token-wise work (norms,
q/k/v projection, q/k norm, RoPE, o_proj, MLP) runs over C-token chunks writing into
preallocated [T, ...] buffers. The largest temporary is then [C, 2 * intermediate] instead of
[T, 2 * intermediate]. Two forms: where the backend attends a chunk of query rows to the keys
before it (one sequence: a long scoring prompt, with its cached context or without) and the
prompt is longer than one step's budget (`stream_rows_above`), the layer streams rows
(`forward_rows`: one [T, H] residual stream and k/v live across the layer, 12 KiB a token on
the 8B shape); otherwise (several sequences, or one within the budget) attention runs over all
T rows at once (`forward_chunked`: h, residual, q, k, v, 27 KiB). The activation reserve, and
so the longest scoring prompt, is measured on the first form past the budget and on the second
for a budget-sized step.

Interruptible forwards: `interrupt` (optional) is called with the layer's index before each
layer; when it returns True the forward raises `ForwardInterrupted`. The engine passes it for
eager prefill, so a prompt whose request is aborted (a client gone, shutdown past its grace)
stops within a layer instead of running to its end (a 262k-token prompt runs ~35 s on the
H200). The K/V written so far stays in the request's blocks, which the caller frees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention.base import AttentionBackend, Rope, fuse_rope_for
from runtime.model import ops
from runtime.model.config import ModelConfig


class ForwardInterrupted(Exception):
    """A forward stopped before layer `layer` because its `interrupt` said so."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"forward interrupted before layer {layer}")
        self.layer = layer


def _check(interrupt: Callable[[int], bool] | None, layer: int) -> None:
    if interrupt is not None and interrupt(layer):
        raise ForwardInterrupted(layer)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Holds the float32 cos/sin cache [max_positions, head_dim] as a non-persistent buffer.
    Hazard: `module.to(dtype)` would cast it too; the loader calls `rebuild` after casts."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin_cache", self._compute(None), persistent=False)

    def _compute(self, device: torch.device | str | None) -> torch.Tensor:
        c = self.cfg
        return ops.rope_cos_sin_cache(
            self.max_positions, c.head_dim, c.rope_theta, c.rope_scaling, device
        )

    def rebuild(self, device: torch.device | str, max_positions: int | None = None) -> None:
        """Recompute the cache on `device` (float32), optionally for a longer position limit."""
        if max_positions is not None:
            self.max_positions = max_positions
        self.cos_sin_cache = self._compute(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.apply_rope(q, k, positions, self.cos_sin_cache)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads = cfg.num_q_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        apply_rope: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [t, H] (normed) -> q [t, Hq, D], k [t, Hkv, D] (normed, RoPE'd unless
        apply_rope is False: the attention backend then rotates them), v [t, Hkv, D]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_q_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        # v stays a strided view of qkv: the KV write (index_copy_) and the FlashInfer kernels
        # read through strides, so a contiguous copy would be one more launch per layer.
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if apply_rope:
            q, k = rotary(q, k, positions)
        return q, k, v

    def project_q(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        """x: [t, H] (normed) -> q [t, Hq, D], normed and RoPE'd: `project_qkv`'s q alone,
        through the q rows of the fused weight (a view: no copy of the weight)."""
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        q = F.linear(x, w[: self.q_size], None if b is None else b[: self.q_size])
        q = q.view(x.shape[0], self.num_q_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return ops.apply_rope_one(q, positions, rotary.cos_sin_cache)

    def project_kv(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [t, H] (normed) -> k [t, Hkv, D] (normed, RoPE'd), v [t, Hkv, D]: `project_qkv`'s
        k and v alone, through the fused weight's k/v rows."""
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        kv = F.linear(x, w[self.q_size :], None if b is None else b[self.q_size :])
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = ops.apply_rope_one(k, positions, rotary.cos_sin_cache)
        return k, v.view(t, self.num_kv_heads, self.head_dim)


def rope_for(
    attn: AttentionBackend, positions: torch.Tensor, rotary: RotaryEmbedding
) -> Rope | None:
    """What to pass as `rope=` to `attn.forward`: the positions and RoPE cache when the
    backend rotates q and k itself, fused with its pool write, for a forward of this many rows
    (`fuse_rope_for`); else None, and the layer rotates them. A longer forward would otherwise
    hand q and k over un-rotated and the backend rotate them out of place over all rows: in a
    hybrid prefill that is a second [T, Hq + Hkv, D] copy beside the layer's q/k/v buffers
    (10 KiB a token on the 8B shape), where the layer rotates chunk by chunk into them."""
    if not getattr(attn, "fuses_rope", False) or not fuse_rope_for(positions.shape[0]):
        return None
    return positions, rotary.cos_sin_cache


def attend(
    attn: AttentionBackend,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: Rope | None,
    out: torch.Tensor | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """`attn.forward`, with `rope=`, `out=` and `kv_written=` only when there is one (backends
    written before them take none)."""
    kwargs: dict[str, torch.Tensor | Rope | bool] = {}
    if rope is not None:
        kwargs["rope"] = rope
    if out is not None:
        kwargs["out"] = out
    if kv_written:
        kwargs["kv_written"] = True
    return attn.forward(layer_idx, q, k, v, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RowsKV:
    """One layer's keys and values while its rows stream (`DecoderLayer.project_rows_kv`):
    the sequence's cached context's first, then its rows'. Held between the pieces of a
    layer run apart (the split executor's sub-layer slices)."""

    k: torch.Tensor  # [ctx + T, Hkv, D]
    v: torch.Tensor
    num_context_rows: int


def _one_stream(h: torch.Tensor, residual: torch.Tensor | None, chunk_tokens: int) -> torch.Tensor:
    """The residual stream the row form carries: `h` itself before layer 0 (residual None),
    else the pair folded in place into `residual`, chunk by chunk (no [T, H] temporary)."""
    if residual is None:
        return h
    for s in range(0, h.shape[0], chunk_tokens):
        residual[s : s + chunk_tokens] += h[s : s + chunk_tokens]
    return residual


def rows_stream_at(num_tokens: int, chunk_tokens: int | None, stream_rows_above: int) -> bool:
    """The size half of whether one prefill sequence streams its rows (`forward_layers`):
    hybrid prefill on, and more rows than its chunk and than `stream_rows_above` (the
    prefill budget the runner passes). The other half is the planned backend's
    (`attends_rows`: one prefill sequence)."""
    return chunk_tokens is not None and num_tokens > chunk_tokens and num_tokens > stream_rows_above


def attends_rows(attn: AttentionBackend) -> bool:
    """Whether the planned batch can take the row-streamed hybrid prefill
    (`DecoderLayer.forward_rows`): the backend attends a chunk of query rows to the keys
    before it and says the batch is one prefill sequence (cached context or not). Backends
    written before it have no `attends_rows`."""
    fn = getattr(attn, "attends_rows", None)
    return fn is not None and bool(fn())


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def _input_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # first layer: the embedding output is the residual stream
            return self.input_layernorm(h), h
        return self.input_layernorm.add_forward(h, residual)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-batch layer: h, residual [T, H] -> (mlp_out [T, H], residual [T, H])."""
        x, residual = self._input_norm(h, residual)
        rope = rope_for(attn, positions, rotary)
        q, k, v = self.self_attn.project_qkv(x, positions, rotary, apply_rope=rope is None)
        o = attend(attn, self.layer_idx, q, k, v, rope)  # [T, Hq, D]
        a = self.self_attn.o_proj(o.reshape(o.shape[0], -1))
        x, residual = self.post_attention_layernorm.add_forward(a, residual)
        return self.mlp(x), residual

    def forward_chunked(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hybrid-prefill layer. Same result as `forward`, but token-wise ops run over
        `chunk_tokens`-row chunks. Consumes its inputs: `h` and `residual` are overwritten in
        place and returned as (mlp_out, residual)."""
        T = h.shape[0]
        sa = self.self_attn
        fresh = residual is None  # first layer: the residual stream is the embedding output
        if residual is None:
            residual = h.clone()  # h's buffer is reused below for this layer's output
        # Phase 1: residual += h; x = norm(residual); q/k/v (normed, RoPE'd) into [T, ...] buffers.
        q_buf = h.new_empty(T, sa.num_q_heads, sa.head_dim)
        k_buf = h.new_empty(T, sa.num_kv_heads, sa.head_dim)
        v_buf = h.new_empty(T, sa.num_kv_heads, sa.head_dim)
        rope = rope_for(attn, positions, rotary)
        for s in range(0, T, chunk_tokens):
            e = min(s + chunk_tokens, T)
            if fresh:
                x = self.input_layernorm(h[s:e])
            else:
                x, r = self.input_layernorm.add_forward(h[s:e], residual[s:e])
                residual[s:e] = r
            q, k, v = sa.project_qkv(x, positions[s:e], rotary, apply_rope=rope is None)
            q_buf[s:e] = q
            k_buf[s:e] = k
            v_buf[s:e] = v
        # Attention over every token at once (it needs the whole prompt anyway). h is consumed
        # by now (phase 1 read it; phase 2 rewrites it row chunk by row chunk only after o_proj
        # has read those rows of o), so a backend that can write into a given buffer puts the
        # output there: the peak is then h/o, residual and q/k/v, with no second [T, H] tensor.
        out = None
        if (
            getattr(attn, "writes_out", False)
            and sa.num_q_heads * sa.head_dim == h.shape[1]
            and h.is_contiguous()
        ):
            out = h.view(T, sa.num_q_heads, sa.head_dim)
        o = attend(attn, self.layer_idx, q_buf, k_buf, v_buf, rope, out).reshape(T, -1)
        del q_buf, k_buf, v_buf
        # Phase 2: residual += o_proj(o); h = mlp(norm(residual)), chunk by chunk into h's buffer.
        for s in range(0, T, chunk_tokens):
            e = min(s + chunk_tokens, T)
            a = sa.o_proj(o[s:e])
            x, r = self.post_attention_layernorm.add_forward(a, residual[s:e])
            residual[s:e] = r
            h[s:e] = self.mlp(x)
        return h, residual

    def forward_rows(
        self,
        hs: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding,
        chunk_tokens: int,
    ) -> None:
        """Row-streamed hybrid-prefill layer, in place: `hs` [T, H] is the whole residual
        stream (the sum `forward` carries as h + residual) and leaves as the next layer's.
        Phase 1 reads the cached context's K/V from the pool and projects every chunk's k/v
        (normed, RoPE'd) after it into [ctx + T, Hkv, D] buffers, handing the kept rows to
        the pool. Phase 2 runs the rest chunk by chunk: q of the chunk,
        attention to the keys up to its last row, o_proj, the residual add, the MLP — each
        chunk's rows of `hs` are rewritten only after everything that reads them. The peak is
        `hs` and k/v (12 KiB a token on the 8B shape) plus one chunk's temporaries, where
        `forward_chunked` holds h, residual, q, k and v (27 KiB). The input norm runs twice a
        chunk (once a phase): cheap, against the [T, Hq, D] q buffer it saves."""
        kv = self.project_rows_kv(hs, positions, attn, rotary, chunk_tokens)
        self.attend_rows_range(hs, positions, attn, rotary, chunk_tokens, kv, 0, hs.shape[0])

    def project_rows_kv(
        self,
        hs: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding,
        chunk_tokens: int,
    ) -> RowsKV:
        """`forward_rows`'s phase 1: the keys and values of the whole sequence, its cached
        context (read from the pool), then every row's (normed, RoPE'd), the kept rows
        handed to the pool. [ctx + T, Hkv, D] each."""
        T = hs.shape[0]
        sa = self.self_attn
        ctx = attn.num_context_rows()
        k_buf = hs.new_empty(ctx + T, sa.num_kv_heads, sa.head_dim)
        v_buf = hs.new_empty(ctx + T, sa.num_kv_heads, sa.head_dim)
        if ctx:
            attn.read_context(self.layer_idx, k_buf[:ctx], v_buf[:ctx])
        for s in range(0, T, chunk_tokens):
            e = min(s + chunk_tokens, T)
            k, v = sa.project_kv(self.input_layernorm(hs[s:e]), positions[s:e], rotary)
            k_buf[ctx + s : ctx + e] = k
            v_buf[ctx + s : ctx + e] = v
            attn.write_rows(self.layer_idx, k_buf[ctx + s : ctx + e], v_buf[ctx + s : ctx + e], s)
        return RowsKV(k_buf, v_buf, ctx)

    def attend_rows_range(
        self,
        hs: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rotary: RotaryEmbedding,
        chunk_tokens: int,
        kv: RowsKV,
        row_start: int,
        row_end: int,
    ) -> None:
        """`forward_rows`'s phase 2 over rows [row_start, row_end), chunk by chunk from
        row_start (a multiple of `chunk_tokens`, so that pieces run the very chunks the whole
        layer runs): q of the chunk, attention to the keys up to its last row, o_proj, the
        residual add, the MLP. Rows outside the range are neither read nor written, so a
        layer may stop at a chunk boundary and go on later (the split executor's sub-layer
        slices), given the same `kv`."""
        if row_start % chunk_tokens:
            raise ValueError(f"row_start {row_start} is not a multiple of {chunk_tokens}")
        sa = self.self_attn
        ctx = kv.num_context_rows
        for s in range(row_start, row_end, chunk_tokens):
            e = min(s + chunk_tokens, row_end)
            q = sa.project_q(self.input_layernorm(hs[s:e]), positions[s:e], rotary)
            # [e - s, Hq, D]: rows s..e-1 are the last of the ctx + e keys
            o = attn.attend_rows(self.layer_idx, q, kv.k[: ctx + e], kv.v[: ctx + e])
            a = sa.o_proj(o.reshape(e - s, -1))
            x, r = self.post_attention_layernorm.add_forward(a, hs[s:e])
            torch.add(r, self.mlp(x), out=hs[s:e])  # r may be hs[s:e] itself (in-place norm)


class LlamaForCausalLM(nn.Module):
    """The decoder. See docs/internals.md "Model" for the contract."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        # Tied embeddings: no separate parameter; compute_logits uses embed_tokens.weight.
        self.lm_head: nn.Linear | None = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, H]."""
        return self.embed_tokens(input_ids)

    def forward_layers(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
        start: int,
        end: int,
        chunk_tokens: int | None = None,
        stream_rows_above: int = 0,
        interrupt: Callable[[int], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run layers [start, end). `residual` is None before layer 0. With hybrid prefill on
        (chunk_tokens < T) the inputs are consumed (overwritten in place), and where the
        backend attends rows (`attends_rows`) and T > `stream_rows_above` the layers stream
        rows: they return the whole residual stream as h with residual None (as before layer
        0; `final_norm` takes it). Streaming rows saves memory, not time: on the H200, steps
        whose prefill was one 2-4k-token chunk took 1.3-1.5x their predicted time streamed,
        where steps of several sequences on the whole-T form took 1.0-1.1x (plan s at
        a92df2d). So the runner passes the prefill budget, whose whole-T peak the start-up dry
        run reserves: only a prompt past it streams. `interrupt`: asked before each layer
        (module docstring)."""
        T = h.shape[0]
        chunked = chunk_tokens is not None and T > chunk_tokens
        if chunked and start < end and T > stream_rows_above and attends_rows(attn):
            assert chunk_tokens is not None
            h = _one_stream(h, residual, chunk_tokens)
            for i in range(start, end):
                _check(interrupt, i)
                self.layers[i].forward_rows(h, positions, attn, self.rotary, chunk_tokens)
            return h, None
        for i in range(start, end):
            _check(interrupt, i)
            layer = self.layers[i]
            if chunked:
                assert chunk_tokens is not None
                h, residual = layer.forward_chunked(
                    h, residual, positions, attn, self.rotary, chunk_tokens
                )
            else:
                h, residual = layer(h, residual, positions, attn, self.rotary)
        assert residual is not None or start == end
        return h, residual

    def streams_rows(
        self,
        num_tokens: int,
        attn: AttentionBackend,
        chunk_tokens: int | None,
        stream_rows_above: int = 0,
    ) -> bool:
        """Whether `forward_layers` streams a planned batch of `num_tokens` rows (hybrid
        prefill's row form, `DecoderLayer.forward_rows`): then a layer can also run in row
        pieces (`forward_layer_rows`)."""
        return rows_stream_at(num_tokens, chunk_tokens, stream_rows_above) and attends_rows(attn)

    def forward_layer_rows(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
        layer: int,
        row_start: int,
        row_end: int,
        chunk_tokens: int,
        kv: RowsKV | None,
    ) -> tuple[torch.Tensor, RowsKV | None]:
        """Rows [row_start, row_end) of one row-streamed layer (only where `streams_rows`):
        a piece of `forward_layers(layer, layer + 1)` that a decode step may follow. The
        first piece (row_start 0) folds (h, residual) into the one stream, as
        `forward_layers` does, and projects the layer's keys and values; the later pieces
        take them back as `kv`. Returns the stream (residual None after it, as
        `forward_layers` returns) and the `kv` to pass on, None once the layer is done.
        `row_start` is a multiple of `chunk_tokens`: the pieces run the very chunks the whole
        layer runs, so the result is the same bit for bit."""
        T = h.shape[0]
        lyr = self.layers[layer]
        if row_start == 0:
            h = _one_stream(h, residual, chunk_tokens)
            kv = lyr.project_rows_kv(h, positions, attn, self.rotary, chunk_tokens)
        elif kv is None or residual is not None:
            raise ValueError("a later piece of a layer needs the stream and its first piece's kv")
        assert kv is not None
        lyr.attend_rows_range(h, positions, attn, self.rotary, chunk_tokens, kv, row_start, row_end)
        return h, (None if row_end >= T else kv)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.norm(h)
        return self.norm.add_forward(h, residual)[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        chunk_tokens: int | None = None,
        stream_rows_above: int = 0,
        interrupt: Callable[[int], bool] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, H]. `chunk_tokens`,
        `stream_rows_above`: hybrid prefill's form (`forward_layers`); `interrupt`: asked
        before each layer (module docstring)."""
        h = self.embed(input_ids)
        h, residual = self.forward_layers(
            h,
            None,
            positions,
            attn,
            0,
            self.num_layers,
            chunk_tokens,
            stream_rows_above,
            interrupt,
        )
        if residual is None and chunk_tokens is not None and h.shape[0] > chunk_tokens:
            # Streamed rows: the final norm in place, chunk by chunk (no second [T, H]).
            for s in range(0, h.shape[0], chunk_tokens):
                h[s : s + chunk_tokens] = self.norm(h[s : s + chunk_tokens])
            return h
        return self.final_norm(h, residual)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] float32."""
        return F.linear(hidden, self.lm_head_weight()).float()
