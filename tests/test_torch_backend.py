"""Torch SDPA backend over the paged pool against a naive attention reference, with cached
context, several sequences, GQA, a decode batch and a discarded suffix."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.attention.base import ForwardBatch, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.kv.kv_pool import KVPool

HQ, HKV, D, BS = 4, 2, 8, 4


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """q: [n, Hq, D]; k, v: [ctx + n, Hkv, D] (context then new); causal with offset."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        keys, vals = k[: ctx + i + 1], v[: ctx + i + 1]  # positions <= ctx + i
        scores = torch.einsum("hd,shd->hs", q[i], keys) / math.sqrt(q.shape[-1])
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), vals)
    return out


def _setup(seed: int, specs: list[tuple[int, int, int]]):
    """specs: (num_context, num_query, num_kept) per sequence. Fills each sequence's context
    into its own pool blocks and returns the backend, the batch and the context k/v."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(
        1,
        num_blocks=64,
        block_size=BS,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
        device="cpu",
    )
    perm = torch.randperm(64, generator=g).tolist()  # scattered, non-contiguous blocks
    seqs, ctx_kv, start = [], [], 0
    for ctx, n, kept in specs:
        nblocks = -(-max(kept, ctx) // BS)
        blocks = [perm.pop() for _ in range(nblocks)]
        ck = torch.randn(ctx, HKV, D, generator=g)
        cv = torch.randn(ctx, HKV, D, generator=g)
        for p in range(ctx):
            pool.k[0][blocks[p // BS], p % BS] = ck[p]
            pool.v[0][blocks[p // BS], p % BS] = cv[p]
        seqs.append(SeqSlice(start, n, ctx, kept, blocks))
        ctx_kv.append((ck, cv))
        start += n
    positions = torch.cat(
        [
            torch.arange(s.num_context_tokens, s.num_context_tokens + s.num_query_tokens)
            for s in seqs
        ]
    )
    is_decode = all(s.num_query_tokens == 1 and s.num_context_tokens > 0 for s in seqs)
    batch = ForwardBatch(
        torch.zeros(start, dtype=torch.int64), positions, seqs, torch.arange(start), is_decode
    )
    q = torch.randn(start, HQ, D, generator=g)
    k = torch.randn(start, HKV, D, generator=g)
    v = torch.randn(start, HKV, D, generator=g)
    return pool, batch, ctx_kv, q, k, v


@pytest.mark.parametrize(
    "specs",
    [
        [(0, 7, 7)],  # fresh prompt, everything kept
        [(8, 5, 13), (0, 3, 3), (4, 9, 13)],  # cached context + fresh, mixed
        [(8, 10, 16), (0, 11, 8)],  # scoring: suffix beyond the kept blocks discarded
        [(5, 1, 6), (12, 1, 13), (1, 1, 2)],  # decode batch (padded)
    ],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_matches_naive_reference(specs: list[tuple[int, int, int]], device: str) -> None:
    pool, batch, ctx_kv, q, k, v = _setup(0, specs)
    before_k = pool.k[0].clone()
    run_pool = pool
    if device != "cpu":  # same contents on the device; results come back to the host
        run_pool = KVPool(1, pool.num_blocks, BS, HKV, D, torch.float32, device)
        run_pool.k[0].copy_(pool.k[0])
        run_pool.v[0].copy_(pool.v[0])
    backend = TorchAttentionBackend(run_pool)
    backend.plan(batch)
    out = backend.forward(0, q.to(device), k.to(device), v.to(device)).cpu()
    pool.k[0].copy_(run_pool.k[0].cpu())
    pool.v[0].copy_(run_pool.v[0].cpu())
    tol = 1e-5 if device == "cpu" else 1e-4
    written = torch.zeros(pool.num_blocks, BS, dtype=torch.bool)
    for s, (ck, cv) in zip(batch.seqs, ctx_kv, strict=True):
        lo, hi = s.query_start, s.query_start + s.num_query_tokens
        ref = _naive(
            q[lo:hi], torch.cat([ck, k[lo:hi]]), torch.cat([cv, v[lo:hi]]), s.num_context_tokens
        )
        torch.testing.assert_close(out[lo:hi], ref, rtol=tol, atol=tol)
        for i in range(s.num_query_tokens):  # kept positions written, discarded ones not
            p = s.num_context_tokens + i
            if p < s.num_kept_tokens:
                b, off = s.block_ids[p // BS], p % BS
                torch.testing.assert_close(pool.k[0][b, off], k[lo + i])
                torch.testing.assert_close(pool.v[0][b, off], v[lo + i])
                written[b, off] = True
    # Nothing else in the pool changed (no stray writes for discarded tokens).
    assert torch.equal(pool.k[0][~written], before_k[~written])


def test_decode_after_prefill_reads_back_the_pool() -> None:
    """Prefill writes a prompt, then a decode step attends over it from the pool alone."""
    pool, batch, _, q, k, v = _setup(1, [(0, 6, 6)])
    backend = TorchAttentionBackend(pool)
    backend.plan(batch)
    backend.forward(0, q, k, v)
    blocks = batch.seqs[0].block_ids
    g = torch.Generator().manual_seed(2)
    q1, k1, v1 = (
        torch.randn(1, HQ, D, generator=g),
        torch.randn(1, HKV, D, generator=g),
        torch.randn(1, HKV, D, generator=g),
    )
    dec = ForwardBatch(
        torch.zeros(1, dtype=torch.int64),
        torch.tensor([6]),
        [SeqSlice(0, 1, 6, 7, blocks)],
        torch.arange(1),
        True,
    )
    backend.plan(dec)
    out = backend.forward(0, q1, k1, v1)
    ref = _naive(q1, torch.cat([k, k1]), torch.cat([v, v1]), 6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_out_is_honoured() -> None:
    """`out=` gets the attention output (the torch backend computes, then copies: it does not
    set `writes_out`, so the model never hands it one, but the interface's parameter works)."""
    pool, batch, _, q, k, v = _setup(3, [(8, 5, 13), (0, 3, 3)])
    backend = TorchAttentionBackend(pool)
    assert backend.writes_out is False
    backend.plan(batch)
    want = backend.forward(0, q, k, v)
    out = torch.full_like(q, float("nan"))
    pool2, batch2, _, q2, k2, v2 = _setup(3, [(8, 5, 13), (0, 3, 3)])
    backend2 = TorchAttentionBackend(pool2)
    backend2.plan(batch2)
    got = backend2.forward(0, q2, k2, v2, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want)
