"""Triton kernels for decode batches of 1..64 rows: fewer, fused launches per layer.

Why: at batch 1 a decode step of Llama-3.1-8B on the H200 spent 0.5 ms in ~300 tiny kernels
and 0.56 ms in the gaps between 466 launches, next to 4.0 ms of weight reads (docs/
benchmarks.md, "Where a decode step's time goes"). These kernels cut a layer from ~14 launches to 7:

    add_rmsnorm     residual += sum of the previous projection's split-K partials; x = norm
    qkv_rope_write  x @ W_qkv^T (+ bias), RoPE on q and k, k and v written into the paged pool
    decode_attention  split-KV attention over the paged pool into the [M, Hq, D] output: the
                    last split of a (row, KV head) to finish merges the splits' partials
    gemv_splitk     o_proj: fp32 partials, reduced by the next add_rmsnorm
    add_rmsnorm
    gate_up_silu    x @ W_gate_up^T, then silu(gate) * up
    gemv_splitk     down_proj: partials again

From 2 rows on the three projection kernels run on tensor cores (the `_tc` kernels: the
weight tile is the MMA's M side, the padded batch its N side), where the element-wise ones
lost to cuBLAS; at 16..64 rows the point is the launch count: a Qwen2.5-3B step at 48 rows spent
1.5 ms of 5 in the gaps between ~13 kernels a layer (docs/benchmarks.md, plan w). The
attention has no merge launch of its own (there was one, an 8th, whenever a graph's bound
allowed more than one KV split): a row with one live split writes its output itself.

Every kernel has a plain-torch twin in `runtime/model/fused_decode.py`'s tests' reference; on a
machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in the
CPU tests. Shapes, in the comments below: M rows (decode batch), K input features, N output
features, S split-K or KV-split parts, H hidden size, D head dim.

Rounding follows the unfused path where it is cheap to (projection outputs are rounded to
the model dtype before RoPE / SiLU, the residual before the norm), so fused and unfused
decode agree to bf16 noise.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(
    parts_ptr,  # [S, M, H] fp32 split-K partials of the previous projection (unused if S == 0)
    num_parts,
    res_ptr,  # [M, H] model dtype, residual stream: updated in place (res += sum(parts))
    w_ptr,  # [H] norm weight
    out_ptr,  # [M, H] model dtype: rmsnorm(res) * w
    M,
    eps,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    dt = res_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's partials and residual are final
        tl.extra.cuda.gdc_launch_dependents()  # M programs only: let the next GEMV prefetch
    r = tl.load(res_ptr + m * H + offs, mask=mask, other=0.0).to(tl.float32)
    if num_parts > 0:
        p = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in range(num_parts):
            p += tl.load(parts_ptr + (s * M + m) * H + offs, mask=mask, other=0.0)
        # Like the unfused path: the projection's output is rounded to the model dtype, the
        # sum with the residual is stored rounded, and the norm uses the unrounded sum.
        r += p.to(dt).to(tl.float32)
        tl.store(res_ptr + m * H + offs, r.to(dt), mask=mask)
    var = tl.sum(r * r, axis=0) / H
    tl.store(out_ptr + m * H + offs, (r * tl.rsqrt(var + eps) * w).to(dt), mask=mask)


@triton.jit
def _qkv_rope_write_kernel(
    x_ptr,  # [M, K] normed hidden states
    w_ptr,  # [(Hq + 2 Hkv) * D, K] fused q|k|v weight
    b_ptr,  # [(Hq + 2 Hkv) * D] bias (read only if HAS_BIAS)
    pos_ptr,  # [M] int64 positions
    cs_ptr,  # [P, D] fp32 RoPE cache: cos in [0, D/2), sin in [D/2, D)
    q_ptr,  # [M, Hq, D] out: RoPE'd queries
    kc_ptr,  # [num_slots, Hkv, D] this layer's K pool (flat slots)
    vc_ptr,  # [num_slots, Hkv, D] this layer's V pool
    slot_ptr,  # [M] int64 pool slot of each row's new token
    M,
    K,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAIRS: tl.constexpr,  # rotation pairs per program: rows j and j + D/2 of one head
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program = PAIRS rotation pairs of one head, so RoPE (which mixes output j with
    # j + D/2) needs nothing from another program; the K/V write needs nothing either.
    pid = tl.program_id(0)
    per_head: tl.constexpr = (D // 2) // PAIRS
    head = pid // per_head
    j = (pid % per_head) * PAIRS + tl.arange(0, PAIRS)  # [PAIRS] in [0, D/2)
    row1 = head * D + j
    row2 = row1 + D // 2
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    # Accumulate element-wise and reduce once after the loop: a cross-thread reduction per
    # K tile would cost more than the loads it follows.
    acc1 = tl.zeros((BLOCK_M, PAIRS, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, PAIRS, BLOCK_K), dtype=tl.float32)
    w1_ptr = w_ptr + row1[:, None].to(tl.int64) * K + k_offs[None, :]
    w2_ptr = w_ptr + row2[:, None].to(tl.int64) * K + k_offs[None, :]
    # Weights never depend on the previous kernel: the first tile loads before the wait, and
    # each iteration loads the next tile before using the current one (one tile ahead).
    w1 = tl.load(w1_ptr, mask=(k_offs < K)[None, :], other=0.0)
    w2 = tl.load(w2_ptr, mask=(k_offs < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k_offs
        x = tl.load(
            x_ptr + m_offs[:, None] * K + kk[None, :],
            mask=m_mask[:, None] & (kk < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        nxt = (kk + BLOCK_K < K)[None, :]
        w1_next = tl.load(w1_ptr + k0 + BLOCK_K, mask=nxt, other=0.0)
        w2_next = tl.load(w2_ptr + k0 + BLOCK_K, mask=nxt, other=0.0)
        acc1 += x[:, None, :] * w1.to(tl.float32)[None, :, :]
        acc2 += x[:, None, :] * w2.to(tl.float32)[None, :, :]
        w1 = w1_next
        w2 = w2_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    a1 = tl.sum(acc1, axis=2)  # [BLOCK_M, PAIRS]
    a2 = tl.sum(acc2, axis=2)
    if HAS_BIAS:
        a1 += tl.load(b_ptr + row1).to(tl.float32)[None, :]
        a2 += tl.load(b_ptr + row2).to(tl.float32)[None, :]
    # Round like the unfused path (projection output in the model dtype, RoPE in fp32).
    a1 = a1.to(q_ptr.dtype.element_ty).to(tl.float32)
    a2 = a2.to(q_ptr.dtype.element_ty).to(tl.float32)
    mask2 = m_mask[:, None]
    if head < HQ + HKV:  # q or k: rotate
        pos = tl.load(pos_ptr + m_offs, mask=m_mask, other=0)
        cs_row = pos[:, None] * D + j[None, :]
        cos = tl.load(cs_ptr + cs_row, mask=mask2, other=1.0)
        sin = tl.load(cs_ptr + cs_row + D // 2, mask=mask2, other=0.0)
        o1 = a1 * cos - a2 * sin
        o2 = a2 * cos + a1 * sin
        if head < HQ:
            dst = q_ptr + (m_offs[:, None] * HQ + head) * D + j[None, :]
            tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=mask2)
            tl.store(dst + D // 2, o2.to(q_ptr.dtype.element_ty), mask=mask2)
        else:
            slot = tl.load(slot_ptr + m_offs, mask=m_mask, other=0)
            dst = kc_ptr + (slot[:, None] * HKV + (head - HQ)) * D + j[None, :]
            tl.store(dst, o1.to(kc_ptr.dtype.element_ty), mask=mask2)
            tl.store(dst + D // 2, o2.to(kc_ptr.dtype.element_ty), mask=mask2)
    else:  # v: written as is
        slot = tl.load(slot_ptr + m_offs, mask=m_mask, other=0)
        dst = vc_ptr + (slot[:, None] * HKV + (head - HQ - HKV)) * D + j[None, :]
        tl.store(dst, a1.to(vc_ptr.dtype.element_ty), mask=mask2)
        tl.store(dst + D // 2, a2.to(vc_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def _gemv_splitk_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [S, M, N] fp32 partial sums, S = number of K splits
    M,
    N,
    K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_tile = w_ptr + rows[:, None].to(tl.int64) * K + (k_start + k_offs)[None, :]
    # First weight tile before the wait, then one tile ahead (see _qkv_rope_write_kernel).
    w = tl.load(w_tile, mask=n_mask[:, None] & (k_start + k_offs < k_end)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + k_offs
        x = tl.load(
            x_ptr + m_offs[:, None] * K + kk[None, :],
            mask=m_mask[:, None] & (kk < k_end)[None, :],
            other=0.0,
        ).to(tl.float32)
        w_next = tl.load(
            w_tile + (k0 - k_start + BLOCK_K),
            mask=n_mask[:, None] & (kk + BLOCK_K < k_end)[None, :],
            other=0.0,
        )
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    dst = out_ptr + (split * M + m_offs[:, None]) * N + rows[None, :]
    tl.store(dst, y, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [2 INTER, K]: gate rows [0, INTER), up rows [INTER, 2 INTER)
    out_ptr,  # [M, INTER] model dtype: silu(gate) * up
    M,
    INTER,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < INTER
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    wg_ptr = w_ptr + rows[:, None].to(tl.int64) * K + k_offs[None, :]
    wu_ptr = w_ptr + (rows[:, None] + INTER).to(tl.int64) * K + k_offs[None, :]
    # First weight tile before the wait, then one tile ahead (see _qkv_rope_write_kernel).
    wmask = n_mask[:, None] & (k_offs < K)[None, :]
    wg = tl.load(wg_ptr, mask=wmask, other=0.0)
    wu = tl.load(wu_ptr, mask=wmask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k_offs
        x = tl.load(
            x_ptr + m_offs[:, None] * K + kk[None, :],
            mask=m_mask[:, None] & (kk < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        nxt = n_mask[:, None] & (kk + BLOCK_K < K)[None, :]
        wg_next = tl.load(wg_ptr + k0 + BLOCK_K, mask=nxt, other=0.0)
        wu_next = tl.load(wu_ptr + k0 + BLOCK_K, mask=nxt, other=0.0)
        acc_g += x[:, None, :] * wg.to(tl.float32)[None, :, :]
        acc_u += x[:, None, :] * wu.to(tl.float32)[None, :, :]
        wg = wg_next
        wu = wu_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=2).to(dt).to(tl.float32)  # rounded like the unfused projection
    u = tl.sum(acc_u, axis=2).to(dt).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        out_ptr + m_offs[:, None] * INTER + rows[None, :],
        y.to(dt),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [M, Hq, D]
    kc_ptr,  # [num_slots, Hkv, D] (paged: slot = block * PAGE + offset)
    vc_ptr,
    table_ptr,  # [M, table_stride] int32 block ids per row
    lens_ptr,  # [M] int64 tokens to attend to (context + this step's token)
    chunk_ptr,  # [M] int64 tokens per split, a multiple of BLOCK_N (read if ROW_CHUNKS)
    part_o_ptr,  # [M, Hq, S, D] fp32 per-split outputs (normalised within the split)
    part_lse_ptr,  # [M, Hq, S] fp32 per-split log-sum-exp, base 2 (the kernel's exp2 domain)
    out_ptr,  # [M, Hq, D] model dtype: the merged output
    counter_ptr,  # [M, Hkv] int32, zero between launches: splits of (row, KV head) done
    table_stride,
    sm_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    GROUP: tl.constexpr,  # Hq // Hkv: the query heads that share one KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to >= 16 (tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # tokens per tile
    PAGE: tl.constexpr,  # tokens per KV block
    S: tl.constexpr,  # KV splits per (row, KV head): the most a row may use
    ROW_CHUNKS: tl.constexpr,  # tokens per split from chunk_ptr; else seq_len / S
    DOT_F32: tl.constexpr,  # upcast the dot operands (Triton's interpreter: see the launcher)
    USE_PDL: tl.constexpr,
):
    # One program = one KV split of one (row, KV head), for the GROUP query heads that share
    # it. A row uses its first n_live splits; the others exit at once. With one live split
    # the program writes `out` itself; with more, each writes an fp32 partial (output and
    # log-sum-exp) and takes a ticket from the pair's counter, and the program that takes
    # the last ticket merges the pair's partials into `out` and zeroes the counter again (a
    # "serial fixup": no separate merge launch).
    m = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if USE_PDL:
        # q and this step's K/V come from the previous kernel. Everything below, the
        # counter's use included, follows this wait, so the previous layer's attention
        # (which shares the counters) has completed, transitively, before it.
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(lens_ptr + m)
    # Split the sequence into chunks of whole tiles; splits past the last token are dead.
    if ROW_CHUNKS:
        chunk = tl.load(chunk_ptr + m)
    else:
        chunk = tl.cdiv(tl.cdiv(seq_len, S), BLOCK_N) * BLOCK_N
    if S == 1:
        n_live = 1  # static: the partial and merge code below is not even compiled
    else:
        # >= 1 since seq_len >= 1. The callers keep it <= S; the bound keeps the tickets and
        # the counter consistent even if one did not (tokens past S chunks would be dropped).
        n_live = tl.minimum(tl.cdiv(seq_len, chunk), S)
    if s >= n_live:
        return  # a dead split: stores nothing, takes no ticket (its partials are never read)
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + (m * HQ + h * GROUP + g[:, None]) * D + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain: exp(x) = exp2(x * log2(e))
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
    n_offs = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + n_offs
        valid = tok < end
        blk = tl.load(table_ptr + m * table_stride + tok // PAGE, mask=valid, other=0)
        slot = blk.to(tl.int64) * PAGE + tok % PAGE
        kv_off = (slot[:, None] * HKV + h) * D + d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=valid[:, None], other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=valid[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if USE_PDL:
        # The dependent kernel may launch now; its gdc_wait still waits for this whole grid,
        # the merges below included.
        tl.extra.cuda.gdc_launch_dependents()
    # A live split holds >= 1 token, so l_i > 0 (padded heads too: their scores are 0).
    dst = out_ptr + (m * HQ + h * GROUP + g[:, None]) * D + d[None, :]
    if n_live == 1:  # the output is final: no partials, no counter
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        rows = (m * HQ + h * GROUP + g) * S  # [BLOCK_G]: split 0's index into [M, Hq, S]
        part_o = part_o_ptr + rows[:, None] * D + d[None, :]  # split 0's output, [BLOCK_G, D]
        tl.store(part_o + s * D, acc / l_i[:, None], mask=g_mask[:, None])
        tl.store(part_lse_ptr + rows + s, m_i + tl.log2(l_i), mask=g_mask)
        # Memory ordering: the barrier orders every thread's partial stores before the one
        # thread that performs the scalar atomic; its release (gpu scope) publishes them, and
        # the last ticket's acquire (gpu scope) makes all n_live programs' partials visible
        # to the loads below (Triton broadcasts the ticket through shared memory behind a
        # barrier, which orders the other threads' loads after the acquire).
        tl.debug_barrier()
        cnt = counter_ptr + m * HKV + h
        ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if ticket == n_live - 1:  # every other live split has stored its partials
            # Online merge over the splits: rescale to the running max of the lse. The
            # loads also bypass L1 (.cg; the acquire already orders them): other SMs wrote
            # the partials, and another program's merge may have read these addresses here.
            m_o = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
            l_o = tl.zeros((BLOCK_G,), dtype=tl.float32)
            acc_o = tl.zeros((BLOCK_G, D), dtype=tl.float32)
            for j in range(0, n_live):
                lse = tl.load(part_lse_ptr + rows + j, mask=g_mask, other=0.0, cache_modifier=".cg")
                o = tl.load(part_o + j * D, mask=g_mask[:, None], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_o, lse)  # finite: every split here is live
                alpha = tl.exp2(m_o - m_new)
                w = tl.exp2(lse - m_new)
                l_o = l_o * alpha + w
                acc_o = acc_o * alpha[:, None] + o * w[:, None]
                m_o = m_new
            y = acc_o / l_o[:, None]
            tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
            # Ready for the next launch (which starts after this grid completes: stream
            # order, or its gdc_wait under PDL), so the buffer stays zero across graph replays.
            tl.store(cnt, 0)


# --------------------------------------------------------------------------- tensor-core kernels
# From 2 rows on, the projections run on tensor cores (tl.dot). The operands are swapped: a
# tile of the weight's output rows (BLOCK_N >= 16) is the MMA's M side and the batch, padded
# to BLOCK_M = 16..64 rows, its N side, so a decode batch of 2..64 rows still fills an MMA
# tile while each weight tile is read once. Results come out transposed ([BLOCK_N, BLOCK_M])
# and are stored so. Loads are left to Triton's software pipeline (num_stages); under PDL a
# program waits for the previous kernel before its first load (the pipeline's prologue loads
# x, which that kernel writes).


@triton.jit
def _gemm_splitk_tc_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [S, M, N] fp32 partial sums, S = number of K splits
    M,
    N,
    K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_tile = w_ptr + rows[:, None].to(tl.int64) * K + k_offs[None, :]  # [BLOCK_N, BLOCK_K]
    xt_tile = x_ptr + m_offs[None, :] * K + k_offs[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = k0 + k_offs < k_end
        w = tl.load(w_tile + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(xt_tile + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_F32:
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dst = out_ptr + (split * M + m_offs[None, :]) * N + rows[:, None]
    tl.store(dst, acc, mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _gate_up_silu_tc_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [2 INTER, K]: gate rows [0, INTER), up rows [INTER, 2 INTER)
    out_ptr,  # [M, INTER] model dtype: silu(gate) * up
    M,
    INTER,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < INTER
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    wg_tile = w_ptr + rows[:, None].to(tl.int64) * K + k_offs[None, :]
    wu_tile = w_ptr + (rows[:, None] + INTER).to(tl.int64) * K + k_offs[None, :]
    xt_tile = x_ptr + m_offs[None, :] * K + k_offs[:, None]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k_offs < K
        wmask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(wg_tile + k0, mask=wmask, other=0.0)
        wu = tl.load(wu_tile + k0, mask=wmask, other=0.0)
        xt = tl.load(xt_tile + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_F32:
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            xt = xt.to(tl.float32)
        acc_g = tl.dot(wg, xt, acc_g)
        acc_u = tl.dot(wu, xt, acc_u)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)  # rounded like the unfused projection
    u = acc_u.to(dt).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # [BLOCK_N, BLOCK_M]
    tl.store(
        out_ptr + m_offs[None, :] * INTER + rows[:, None],
        y.to(dt),
        mask=n_mask[:, None] & m_mask[None, :],
    )


@triton.jit
def _qkv_rope_write_tc_kernel(
    x_ptr,  # [M, K] normed hidden states
    w_ptr,  # [(Hq + 2 Hkv) * D, K] fused q|k|v weight
    b_ptr,  # [(Hq + 2 Hkv) * D] bias (read only if HAS_BIAS)
    pos_ptr,  # [M] int64 positions
    cs_ptr,  # [P, D] fp32 RoPE cache: cos in [0, D/2), sin in [D/2, D)
    q_ptr,  # [M, Hq, D] out: RoPE'd queries
    kc_ptr,  # [num_slots, Hkv, D] this layer's K pool (flat slots)
    vc_ptr,  # [num_slots, Hkv, D] this layer's V pool
    slot_ptr,  # [M] int64 pool slot of each row's new token
    M,
    K,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAIRS: tl.constexpr,  # rotation pairs per program (>= 16: the MMA's M side)
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program = PAIRS rotation pairs (rows j and j + D/2) of one head, as in
    # _qkv_rope_write_kernel: RoPE and the K/V write need nothing from another program.
    pid = tl.program_id(0)
    per_head: tl.constexpr = (D // 2) // PAIRS
    head = pid // per_head
    j = (pid % per_head) * PAIRS + tl.arange(0, PAIRS)  # [PAIRS] in [0, D/2)
    row1 = head * D + j
    row2 = row1 + D // 2
    m_offs = tl.arange(0, BLOCK_M)
    m_mask = m_offs < M
    k_offs = tl.arange(0, BLOCK_K)
    w1_tile = w_ptr + row1[:, None].to(tl.int64) * K + k_offs[None, :]
    w2_tile = w_ptr + row2[:, None].to(tl.int64) * K + k_offs[None, :]
    xt_tile = x_ptr + m_offs[None, :] * K + k_offs[:, None]
    acc1 = tl.zeros((PAIRS, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((PAIRS, BLOCK_M), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k_offs < K
        w1 = tl.load(w1_tile + k0, mask=k_mask[None, :], other=0.0)
        w2 = tl.load(w2_tile + k0, mask=k_mask[None, :], other=0.0)
        xt = tl.load(xt_tile + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_F32:
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
            xt = xt.to(tl.float32)
        acc1 = tl.dot(w1, xt, acc1)
        acc2 = tl.dot(w2, xt, acc2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + row1).to(tl.float32)[:, None]
        acc2 += tl.load(b_ptr + row2).to(tl.float32)[:, None]
    # Round like the unfused path (projection output in the model dtype, RoPE in fp32).
    a1 = acc1.to(q_ptr.dtype.element_ty).to(tl.float32)  # [PAIRS, BLOCK_M]
    a2 = acc2.to(q_ptr.dtype.element_ty).to(tl.float32)
    mask2 = m_mask[None, :]
    if head < HQ + HKV:  # q or k: rotate
        pos = tl.load(pos_ptr + m_offs, mask=m_mask, other=0)
        cs_row = pos[None, :] * D + j[:, None]
        cos = tl.load(cs_ptr + cs_row, mask=mask2, other=1.0)
        sin = tl.load(cs_ptr + cs_row + D // 2, mask=mask2, other=0.0)
        o1 = a1 * cos - a2 * sin
        o2 = a2 * cos + a1 * sin
        if head < HQ:
            dst = q_ptr + (m_offs[None, :] * HQ + head) * D + j[:, None]
            tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=mask2)
            tl.store(dst + D // 2, o2.to(q_ptr.dtype.element_ty), mask=mask2)
        else:
            slot = tl.load(slot_ptr + m_offs, mask=m_mask, other=0)
            dst = kc_ptr + (slot[None, :] * HKV + (head - HQ)) * D + j[:, None]
            tl.store(dst, o1.to(kc_ptr.dtype.element_ty), mask=mask2)
            tl.store(dst + D // 2, o2.to(kc_ptr.dtype.element_ty), mask=mask2)
    else:  # v: written as is
        slot = tl.load(slot_ptr + m_offs, mask=m_mask, other=0)
        dst = vc_ptr + (slot[None, :] * HKV + (head - HQ - HKV)) * D + j[:, None]
        tl.store(dst, a1.to(vc_ptr.dtype.element_ty), mask=mask2)
        tl.store(dst + D // 2, a2.to(vc_ptr.dtype.element_ty), mask=mask2)


# --------------------------------------------------------------------------- launchers
# Block shapes per batch bucket. The element-wise accumulators hold BLOCK_M * rows * BLOCK_K
# fp32 values per program (two sets for qkv and gate_up): kept at <= 32 per thread with 4
# warps so nothing spills. Chosen by the sweep in `bench/gpu_suite.py` (section
# `fused_decode`); see docs/benchmarks.md.


# Triton's CPU interpreter (the CPU tests) computes bf16 arithmetic wrongly (seen with triton
# 3.8: a bf16 product or dot came out as garbage while the same kernel on fp32 was exact), so
# under it the attention kernel upcasts its dot operands; every other kernel does its
# arithmetic in fp32 anyway. On a GPU the dots take bf16 operands (tensor cores).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# Programmatic dependent launch (Hopper and newer): each kernel is launched while the one
# before it finishes, loads its first weight tile, and waits (griddepcontrol.wait) for the
# previous kernel's results only then; every kernel waits before it completes, so ordering
# stays transitive. Captured into CUDA graphs as programmatic edges. `PDL["enabled"]` turns it
# off (benchmarks compare both).
PDL = {"enabled": True}


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl(t: torch.Tensor) -> dict[str, bool]:
    """Launch options: PDL where the GPU has it (never under the interpreter)."""
    on = PDL["enabled"] and not _INTERPRETED and t.is_cuda and _pdl_capable(t.device.index or 0)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


MAX_ROWS = 64


def block_m(num_rows: int) -> int:
    """The padded row count the kernels are compiled for: 1 for the element-wise kernels
    (batch 1), 16, 32 or 64 for the tensor-core ones (2..64 rows)."""
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"the fused decode kernels take 1..{MAX_ROWS} rows, got {num_rows}")
    return 1 if num_rows == 1 else max(16, _pow2(num_rows))


def _tensor_cores(bm: int) -> bool:
    return bm >= 16


# Tiles per kernel and padded batch (block_m), one table for both kernel families.
# Element-wise (block_m 1): (output rows per program, BLOCK_K, num_warps), plus for the two
# gemv_splitk uses (o, down) the number of K splits (0: about GEMV_TARGET_PROGRAMS programs).
# qkv's rows are rotation pairs (2 rows each); gate_up's are gate rows (plus as many up rows).
# The best of two sweeps on the H200 (bench/gpu_suite.py, section `fused_decode`, which may
# override entries for a run). At 2..8 rows these kernels lost to cuBLAS (2.45x the floor at
# batch 4 against the tensor-core kernels' 1.22-1.32x: docs/benchmarks.md), so they run
# batch 1 only.
# Tensor cores (block_m 16..64): the same fields plus num_stages last (Triton's load
# pipeline); K splits 0 = about TC_TARGET_PROGRAMS programs; qkv's pairs >= 16. The best of
# the second sweep on the H200 over the Qwen2.5-3B and Llama-3.1-8B shapes at 16 / 32 / 48
# rows, which also tried 4-5 pipeline stages and 8 warps for qkv and gate_up (`python -m
# bench.wide_decode`, bench/results/wide-decode-2026-12-03-a92df2d/): graph steps 1.3-4.6 %
# shorter than with the first sweep's tiles (wide-decode-2026-12-03/wide-decode-6b98c3c.json),
# engine-level, same process.
TILES: dict[str, dict[int, tuple[int, ...]]] = {
    "o": {
        1: (4, 512, 4, 1),
        16: (64, 64, 4, 0, 4),
        32: (64, 64, 4, 8, 4),
        64: (64, 64, 4, 0, 4),
    },
    "down": {
        1: (16, 256, 8, 2),
        16: (32, 128, 4, 0, 4),
        32: (64, 64, 4, 0, 4),
        64: (64, 64, 4, 0, 4),
    },
    "gate_up": {
        1: (2, 1024, 4),
        16: (64, 128, 4, 3),
        32: (64, 64, 4, 4),
        64: (64, 64, 4, 4),
    },
    "qkv": {
        1: (4, 256, 8),
        16: (32, 256, 4, 4),
        32: (64, 128, 4, 4),
        64: (32, 128, 4, 5),
    },
}
ATTENTION_TILE = {"block_n": 64, "num_warps": 4}
# Split-K programs: enough to keep every SM busy with several in flight.
GEMV_TARGET_PROGRAMS = 1024
# The tensor-core GEMM's programs each stream a [BLOCK_N, K / S] weight slab through a
# pipeline: about two a SM.
TC_TARGET_PROGRAMS = 264


def add_rmsnorm(
    parts: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual [M, H] += parts.sum(0) (parts [S, M, H] fp32; None = nothing to add), in
    place; returns rmsnorm(residual) * weight, [M, H] in residual's dtype."""
    M, H = residual.shape
    out = torch.empty_like(residual) if out is None else out
    num_parts = 0 if parts is None else int(parts.shape[0])
    block_h = _pow2(H)
    _add_rmsnorm_kernel[(M,)](
        residual if parts is None else parts,
        num_parts,
        residual,
        weight,
        out,
        M,
        eps,
        H=H,
        BLOCK_H=block_h,
        num_warps=8 if block_h >= 2048 else 4,
        **_pdl(residual),
    )
    return out


def _tile(kind: str, num_rows: int, override: tuple[int, ...] | None) -> tuple[int, ...]:
    return override or TILES[kind][block_m(num_rows)]


def qkv_rope_write(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
    tile: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x [M, K] -> q [M, Hq, D] (RoPE'd); k (RoPE'd) and v written to k_flat / v_flat
    [num_slots, Hkv, D] at `slots` [M]. weight: [(Hq + 2 Hkv) * D, K]. tile: (pairs,
    BLOCK_K, num_warps[, num_stages]), default TILES["qkv"]."""
    M, K = x.shape
    _, num_kv_heads, head_dim = k_flat.shape
    bm = block_m(M)
    pairs, block_k, warps, *stages = _tile("qkv", M, tile)
    pairs = min(pairs, head_dim // 2)
    q = torch.empty(M, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    num_heads = num_q_heads + 2 * num_kv_heads
    kernel, extra = _qkv_rope_write_kernel, {}
    if _tensor_cores(bm):
        kernel = _qkv_rope_write_tc_kernel
        extra = {"DOT_F32": _INTERPRETED, "num_stages": stages[0] if stages else 3}
    kernel[(num_heads * (head_dim // 2) // pairs,)](
        x,
        weight,
        weight if bias is None else bias,
        positions,
        cos_sin,
        q,
        k_flat,
        v_flat,
        slots,
        M,
        K,
        HQ=num_q_heads,
        HKV=num_kv_heads,
        D=head_dim,
        PAIRS=pairs,
        BLOCK_K=block_k,
        BLOCK_M=bm,
        HAS_BIAS=bias is not None,
        num_warps=warps,
        **extra,
        **_pdl(x),
    )
    return q


def gemv_splitk(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_splits: int | None = None,
    tile: tuple[int, ...] | None = None,
    kind: str = "o",
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as fp32 partial sums [S, M, N] over S slices of K (summed
    by the consumer, `add_rmsnorm`). tile: (BLOCK_N, BLOCK_K, num_warps, splits[,
    num_stages]), default TILES[kind] ("o" or "down"); splits 0 (and num_splits None): about
    GEMV_TARGET_PROGRAMS programs (TC_TARGET_PROGRAMS on tensor cores)."""
    M, K = x.shape
    N = weight.shape[0]
    bm = block_m(M)
    block_n, block_k, warps, tile_splits, *stages = _tile(kind, M, tile)
    tc = _tensor_cores(bm)
    n_blocks = triton.cdiv(N, block_n)
    num_splits = num_splits or tile_splits or None
    if num_splits is None:
        target = TC_TARGET_PROGRAMS if tc else GEMV_TARGET_PROGRAMS
        num_splits = max(1, min(triton.cdiv(target, n_blocks), K // (4 * block_k)))
    k_per = triton.cdiv(triton.cdiv(K, num_splits), block_k) * block_k
    num_splits = triton.cdiv(K, k_per)
    out = torch.empty(num_splits, M, N, dtype=torch.float32, device=x.device)
    kernel, extra = _gemv_splitk_kernel, {}
    if tc:
        kernel = _gemm_splitk_tc_kernel
        extra = {"DOT_F32": _INTERPRETED, "num_stages": stages[0] if stages else 4}
    kernel[(n_blocks, num_splits)](
        x,
        weight,
        out,
        M,
        N,
        K,
        k_per,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_M=bm,
        num_warps=warps,
        **extra,
        **_pdl(x),
    )
    return out


def gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, ...] | None = None
) -> torch.Tensor:
    """x [M, K], weight [2 I, K] (gate | up) -> silu(x @ gate^T) * (x @ up^T), [M, I].
    tile: (gate rows per program, BLOCK_K, num_warps[, num_stages]), default
    TILES["gate_up"]."""
    M, K = x.shape
    inter = weight.shape[0] // 2
    bm = block_m(M)
    block_n, block_k, warps, *stages = _tile("gate_up", M, tile)
    out = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    kernel, extra = _gate_up_silu_kernel, {}
    if _tensor_cores(bm):
        kernel = _gate_up_silu_tc_kernel
        extra = {"DOT_F32": _INTERPRETED, "num_stages": stages[0] if stages else 3}
    kernel[(triton.cdiv(inter, block_n),)](
        x,
        weight,
        out,
        M,
        inter,
        K,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_M=bm,
        num_warps=warps,
        **extra,
        **_pdl(x),
    )
    return out


def attention_splits(num_rows: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """The most KV splits a (row, KV head) may use in a graph captured for `num_rows` rows: a
    power of two, at most 64, with room for `split_chunk_tokens` to cut one long row among
    short ones into about PROGRAMS_PER_SM * num_sms / num_kv_heads pieces, but no more than
    SPLIT_GRID_PROGRAMS_PER_SM programs an SM in all (a row's unused splits exit at once)."""
    even = triton.cdiv(PROGRAMS_PER_SM * num_sms, num_kv_heads)  # one row holding all the work
    grid = triton.cdiv(SPLIT_GRID_PROGRAMS_PER_SM * num_sms, num_rows * num_kv_heads)
    want = min(64, even, grid)
    return 1 << (want.bit_length() - 1)  # the power of two at or below


# Why the splits follow each row's context: a batch with one 14k-token context among 47 of
# ~1k, split a fixed two ways a row (one program an SM over all rows), left a program 7k
# tokens while an SM's share was under 1k; the 3B's decode-only steps at 33..63 rows took 11 ms
# against 6.5-8.3 ms at 65..95 rows on FlashInfer (plan v, 2026-12-06). Split by context they
# took 4.7-5.5 ms on the H200, and the chats' time per output token fell from 15.7 to 10.6 ms
# (docs/benchmarks.md, "The fused decode's KV splits follow each row's context"). The price
# then: where even contexts needed one split a row, the bound still ran a separate merge launch
# (8B, 48-64 rows: +8-13 % of the attention). The merge now runs inside the attention kernel,
# by the last split of a (row, KV head) to finish, and a row with one live split writes its
# output directly: on an H100 the per-row rule then cost 3 % / 0 % there, and through HTTP the
# 8B's decode at 16 and 64 streams matched the fixed split's within 0.7 % (docs/benchmarks.md,
# "The splits merged inside the attention kernel"). The grid's bound was 16 programs an SM
# until two GPUs read twice it alike (`bench.decode_splits`, engine-level, 3B and 8B shapes):
# the attention of one long row among short ones at 48-64 rows took 0.73-0.89x the time on
# an H100 and 0.67-0.88x on the H200 (0.88-0.98x at 32), even and mixed contexts 1.00-1.01x
# (docs/benchmarks.md, "The grid's bound doubled").
PROGRAMS_PER_SM = 2  # a split holds at most 1/2 of an SM's share of the step's KV
SPLIT_GRID_PROGRAMS_PER_SM = 32  # the grid's bound (M * Hkv * max splits), empty ones included


def split_chunk_tokens(
    seq_lens: np.ndarray,
    num_kv_heads: int,
    max_splits: int,
    num_sms: int = 132,
    block_n: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Tokens per KV split for each row of a decode batch (seq_lens int64 [M], each >= 1), in
    `out` if given, int64 [M], multiples of block_n: no split longer than 1 / PROGRAMS_PER_SM
    of an SM's share of the step's work (num_kv_heads * sum(seq_lens) / num_sms tokens) unless
    the row would need more than max_splits, and a row's splits as even as whole tiles allow.
    Even contexts get about PROGRAMS_PER_SM * num_sms / (M * num_kv_heads) splits a row; a
    long row among short ones gets more, so that it does not straggle. On the decode step's
    host path: a few in-place numpy operations (~5 us at 1-64 rows), no Python loop."""
    block_n = block_n or ATTENTION_TILE["block_n"]
    work = num_kv_heads * int(seq_lens.sum())
    share = max(block_n, -(-work // (PROGRAMS_PER_SM * num_sms)))
    # ceil(a / b) as -(-a // b), in place: splits, then tokens a split, then whole tiles.
    chunk = np.negative(seq_lens, out=out)
    np.floor_divide(chunk, share, out=chunk)
    np.negative(chunk, out=chunk)  # splits a row, >= 1 since seq_lens >= 1
    np.minimum(chunk, max_splits, out=chunk)
    np.floor_divide(np.negative(seq_lens), chunk, out=chunk)
    np.floor_divide(chunk, block_n, out=chunk)  # still negated: -ceil(len / splits / tile)
    np.multiply(chunk, -block_n, out=chunk)
    return chunk


def decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sm_scale: float,
    num_splits: int,
    block_n: int | None = None,
    num_warps: int | None = None,
    chunk_tokens: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [M, Hq, D]; pools [num_slots, Hkv, D] (slot = block * block_size + offset);
    block_table [M, >= max blocks] int32; seq_lens [M] int64 (tokens to attend, >= 1);
    num_splits a power of two: the splits per (row, KV head). chunk_tokens [M] int64: tokens
    per split for each row (`split_chunk_tokens`, with block_n and at most num_splits of them
    per row); None: each row in num_splits even splits. counters: int32 [M, Hkv], zero, for
    the last split of a (row, KV head) to find itself (the kernel leaves it zero again); a
    CUDA graph needs a fixed one (`FusedDecodeStep` keeps one); None: allocated here (a memset
    per call). Returns the attention output [M, Hq, D] in q's dtype.

    One launch: a row with one live split writes its output directly; with more, the last of
    its splits to finish merges their partials (see `_decode_attention_kernel`)."""
    M, num_q_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    out = torch.empty_like(q)
    if num_splits == 1:  # every row has one live split: no partials, no counter
        part_o = part_lse = counters = out
    else:
        part_o = torch.empty(
            M, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(M, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        if counters is None:
            counters = torch.zeros(M, num_kv_heads, dtype=torch.int32, device=q.device)
        elif (
            counters.dtype != torch.int32
            or counters.numel() < M * num_kv_heads
            or not counters.is_contiguous()
        ):
            raise ValueError(f"counters must be int32 [{M}, {num_kv_heads}] (zero)")
    _decode_attention_kernel[(M, num_kv_heads, num_splits)](
        q,
        k_flat,
        v_flat,
        block_table,
        seq_lens,
        seq_lens if chunk_tokens is None else chunk_tokens,
        part_o,
        part_lse,
        out,
        counters,
        block_table.stride(0),
        sm_scale,
        HQ=num_q_heads,
        HKV=num_kv_heads,
        D=head_dim,
        GROUP=group,
        BLOCK_G=max(16, _pow2(group)),
        BLOCK_N=block_n or ATTENTION_TILE["block_n"],
        PAGE=block_size,
        S=num_splits,
        ROW_CHUNKS=chunk_tokens is not None,
        DOT_F32=_INTERPRETED,
        num_warps=num_warps or ATTENTION_TILE["num_warps"],
        **_pdl(q),
    )
    return out
