"""RoPE on q and k and the K/V pool write of one layer in one launch (Triton).

Why: the FlashInfer path spends three launches per layer before attention: RoPE (FlashInfer's
kernel), then `index_copy_` of k and of v into the pool. In a CUDA-graph decode step they are
~13 % of the kernels and their gaps (H200, plan w: 3B x 48 streams has 482 kernels, 3.6 us of
gap each; 8B x 16 has 462), and every eager prefill layer pays their host launches. This
kernel reads the q|k|v projection's output through its strides, rotates q and k (neox halves,
in float32, rounded to the model dtype like `runtime.model.ops.apply_rope`), writes the
rotated q and k as new contiguous tensors (attention and ragged prefill read them) and k and v
into the pool at each token's slot (-1: not written, a scoring request's discarded suffix).

Grid: one program per (token, head) over Hq + 2 Hkv heads: q heads rotate, k heads rotate and
write, v heads only write. `tokens_per_program` > 1 runs a variant whose program takes that
many tokens of one head (a [tokens, D/2] tile): the per-token grid is 786k programs a layer
for a 16k-token prefill on the 8B shape. Measured per token count (`bench/gpu_suite.py
--sections rope_kv`, H200, 2026-12-03, `b5f0e9e`, one layer, CUDA events): up to 256 tokens
every variant takes the same ~50-60 us (a launch's time); from 1,024 tokens 16 tokens a
program is the fastest on both shapes (8B: 57 / 66 / 112 / 175 us at 1k / 2k / 8k / 16k
against 79 / 109 / 290 / 532 one token a program and 244 / 250 / 320 / 433 unfused). So
`tokens_per_program=None` (the backends') takes one token a program up to
`TILED_MIN_TOKENS` and 16 above. The backends still fuse only forwards of at most
`FUSED_ROPE_MAX_TOKENS` rows (base.py: a longer one would hold a second copy of q and k). On a
machine without CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1, set by the tests'
conftest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Forwards of more rows than this take the tiled variant, this many tokens a program (measured:
# the module docstring).
TILED_MIN_TOKENS = 256
TILED_TOKENS_PER_PROGRAM = 16


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,  # [T, Hq, D] view: row stride q_st, head stride q_sh, dims packed
    k_ptr,  # [T, Hkv, D] view
    v_ptr,  # [T, Hkv, D] view
    q_out_ptr,  # [T, Hq, D] contiguous out: rotated q
    k_out_ptr,  # [T, Hkv, D] contiguous out: rotated k
    kc_ptr,  # [num_slots, Hkv, D] this layer's K pool (flat slots)
    vc_ptr,  # [num_slots, Hkv, D] this layer's V pool
    pos_ptr,  # [T] int64 positions
    slot_ptr,  # [T] int64 pool slot of each token, -1: not written
    cs_ptr,  # [P, D] fp32: cos in [0, D/2), sin in [D/2, D)
    q_st,
    q_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF_BLOCK: tl.constexpr,  # next power of two >= D / 2
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    j = tl.arange(0, HALF_BLOCK)
    mask = j < half
    slot = tl.load(slot_ptr + t)
    if h < HQ + HKV:  # q or k: rotate
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cs_ptr + pos * D + j, mask=mask, other=0.0)
        sin = tl.load(cs_ptr + pos * D + half + j, mask=mask, other=0.0)
        if h < HQ:
            src = q_ptr + t * q_st + h * q_sh
            dst = q_out_ptr + (t * HQ + h) * D
        else:
            src = k_ptr + t * k_st + (h - HQ) * k_sh
            dst = k_out_ptr + (t * HKV + (h - HQ)) * D
        x1 = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + j, mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty)
        o2 = (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty)
        tl.store(dst + j, o1, mask=mask)
        tl.store(dst + half + j, o2, mask=mask)
        if h >= HQ:
            if slot >= 0:
                c = kc_ptr + (slot * HKV + (h - HQ)) * D
                tl.store(c + j, o1, mask=mask)
                tl.store(c + half + j, o2, mask=mask)
    elif slot >= 0:  # v: copy into the pool
        hv = h - HQ - HKV
        src = v_ptr + t * v_st + hv * v_sh
        c = vc_ptr + (slot * HKV + hv) * D
        tl.store(c + j, tl.load(src + j, mask=mask, other=0.0), mask=mask)
        tl.store(c + half + j, tl.load(src + half + j, mask=mask, other=0.0), mask=mask)


# T is not specialized: Triton would compile a variant per T % 16 == 0 (and T == 1) on the
# first call of each, and a forward's row count (a chunk plus the decodes beside it) is any
# number. On the H200 the start-up graphs compiled the divisible variant only, and the first
# chunked step of an odd size then compiled the other on the engine thread: ~160 ms with the
# chats beside it waiting (tests/gpu/test_auto_chunked_gpu.py, bf68d3a). The mask is the only
# use of T; nothing vectorizes on it.
@triton.jit(do_not_specialize=["T"])
def _rope_kv_write_tiled_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    slot_ptr,
    cs_ptr,
    T,  # number of tokens (the last tile is partial)
    q_st,
    q_sh,
    k_st,
    k_sh,
    v_st,
    v_sh,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
):
    """`_rope_kv_write_kernel` over a [BLOCK_T tokens, D/2] tile of one head."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    j = tl.arange(0, HALF_BLOCK)
    in_t = t < T
    mask = in_t[:, None] & (j < half)[None, :]  # [BLOCK_T, HALF_BLOCK]
    slot = tl.load(slot_ptr + t, mask=in_t, other=-1)
    wmask = mask & (slot >= 0)[:, None]
    jj = j[None, :]
    if h < HQ + HKV:  # q or k: rotate
        pos = tl.load(pos_ptr + t, mask=in_t, other=0)
        cs = cs_ptr + pos[:, None] * D + jj
        cos = tl.load(cs, mask=mask, other=0.0)
        sin = tl.load(cs + half, mask=mask, other=0.0)
        if h < HQ:
            src = q_ptr + t[:, None] * q_st + h * q_sh + jj
            dst = q_out_ptr + (t[:, None] * HQ + h) * D + jj
        else:
            src = k_ptr + t[:, None] * k_st + (h - HQ) * k_sh + jj
            dst = k_out_ptr + (t[:, None] * HKV + (h - HQ)) * D + jj
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty)
        o2 = (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty)
        tl.store(dst, o1, mask=mask)
        tl.store(dst + half, o2, mask=mask)
        if h >= HQ:
            c = kc_ptr + (slot[:, None] * HKV + (h - HQ)) * D + jj
            tl.store(c, o1, mask=wmask)
            tl.store(c + half, o2, mask=wmask)
    else:  # v: copy into the pool
        hv = h - HQ - HKV
        src = v_ptr + t[:, None] * v_st + hv * v_sh + jj
        c = vc_ptr + (slot[:, None] * HKV + hv) * D + jj
        tl.store(c, tl.load(src, mask=wmask, other=0.0), mask=wmask)
        tl.store(c + half, tl.load(src + half, mask=wmask, other=0.0), mask=wmask)


def unsupported_reason(q: torch.Tensor, k_flat: torch.Tensor, cos_sin_cache: torch.Tensor) -> str:
    """ "" when `rope_kv_write` can take these, else why not (the caller falls back)."""
    if q.shape[-1] % 2:
        return f"odd head_dim {q.shape[-1]}"
    if cos_sin_cache.dtype != torch.float32:
        return f"RoPE cache in {cos_sin_cache.dtype}, not float32"
    if k_flat.dtype != q.dtype:
        return f"KV pool in {k_flat.dtype}, model in {q.dtype}"
    return ""


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    token_slots: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    tokens_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k / v [T, Hkv, D] (views of the projection's output: any row and head
    strides, dims packed), positions [T] int64, token_slots [T] int64 (-1: not written),
    k_flat / v_flat [num_slots, Hkv, D] -> (q, k) rotated, new contiguous tensors; k (rotated)
    and v written to the pool. tokens_per_program: 1 (one program per token and head), a
    power of two for the tiled variant, or None: the measured best for T (module docstring)."""
    if tokens_per_program is None:
        tokens_per_program = 1 if q.shape[0] <= TILED_MIN_TOKENS else TILED_TOKENS_PER_PROGRAM
    if tokens_per_program < 1 or tokens_per_program & (tokens_per_program - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {tokens_per_program}")
    T, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1:
            raise ValueError(f"{name}'s head dim must be packed, got strides {x.stride()}")
    q_out = torch.empty(T, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    num_heads = num_q_heads + 2 * num_kv_heads
    tensors = (q, k, v, q_out, k_out, k_flat, v_flat, positions, token_slots, cos_sin_cache)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    meta = {
        "HQ": num_q_heads,
        "HKV": num_kv_heads,
        "D": head_dim,
        "HALF_BLOCK": triton.next_power_of_2(head_dim // 2),
    }
    if tokens_per_program > 1:
        grid = (triton.cdiv(T, tokens_per_program), num_heads)
        _rope_kv_write_tiled_kernel[grid](*tensors, T, *strides, **meta, BLOCK_T=tokens_per_program)
    else:
        _rope_kv_write_kernel[(T, num_heads)](*tensors, *strides, **meta)
    return q_out, k_out


def rope_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    token_slots: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch (the unfused path: RoPE, then the two pool writes)."""
    from runtime.model import ops

    q_out, k_out = ops.apply_rope(q, k, positions, cos_sin_cache)
    keep = token_slots >= 0
    slots = token_slots[keep]
    k_flat.index_copy_(0, slots, k_out[keep])
    v_flat.index_copy_(0, slots, v[keep])
    return q_out.contiguous(), k_out.contiguous()
