"""The row-streamed hybrid prefill (`DecoderLayer.forward_rows`) against the whole forward:
same hidden states, same K/V in the pool (kept rows only), taken only for the batches the
backend allows, and in layer slices as the split executor runs them. CPU, float32, the torch
attention backend (the FlashInfer one: tests/gpu/test_flashinfer_backend.py)."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.base import ForwardBatch, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.kv.kv_pool import KVPool
from runtime.model import ops
from runtime.model.loader import load_model

BLOCK = 4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def setup(preset: str, seed: int = 3):
    model, cfg, _ = load_model(f"random:{preset}", torch.float32, "cpu", seed=seed)
    pool = KVPool.for_model(cfg, 64, BLOCK, torch.float32, "cpu")
    return model, cfg, pool, TorchAttentionBackend(pool)


def one_prompt(cfg, num_tokens: int, num_kept: int, first_block: int = 1) -> ForwardBatch:
    ids = torch.randint(
        0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(7)
    )
    blocks = list(range(first_block, first_block + (num_kept + BLOCK - 1) // BLOCK))
    return ForwardBatch(
        input_ids=ids,
        positions=torch.arange(num_tokens),
        seqs=[SeqSlice(0, num_tokens, 0, num_kept, blocks)],
        logits_indices=torch.tensor([num_tokens - 1]),
        is_decode=False,
    )


def spy_rows(backend: TorchAttentionBackend) -> list[tuple[int, int]]:
    """Records (query rows, keys) of every attend_rows call."""
    calls: list[tuple[int, int]] = []
    real = backend.attend_rows

    def spy(layer_idx, q, k, v):  # type: ignore[no-untyped-def]
        calls.append((int(q.shape[0]), int(k.shape[0])))
        return real(layer_idx, q, k, v)

    backend.attend_rows = spy  # type: ignore[method-assign]
    return calls


def kept_kv(pool: KVPool, batch: ForwardBatch) -> list[torch.Tensor]:
    s = batch.seqs[0]
    slots = torch.tensor(
        [s.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(s.num_kept_tokens)],
        dtype=torch.int64,
    )
    return [pool.flat_k(i)[slots].clone() for i in range(len(pool.k))] + [
        pool.flat_v(i)[slots].clone() for i in range(len(pool.v))
    ]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("num_kept", [37, 18, 0])  # all kept, a discarded suffix, scoring
def test_streamed_rows_match_the_whole_forward(preset: str, num_kept: int) -> None:
    model, cfg, pool, be = setup(preset)
    batch = one_prompt(cfg, 37, num_kept)
    with torch.inference_mode():
        be.plan(batch)
        full = model(batch.input_ids, batch.positions, be)
        kv_full = kept_kv(pool, batch)
        for t in pool.k + pool.v:
            t.zero_()
        calls = spy_rows(be)
        be.plan(batch)
        assert be.attends_rows()
        rows = model(batch.input_ids, batch.positions, be, chunk_tokens=8)
    # Every layer: chunks of 8 query rows, each against the keys up to its last row.
    per_layer = [(8, 8), (8, 16), (8, 24), (8, 32), (5, 37)]
    assert calls == per_layer * cfg.num_layers
    assert rel_err(rows, full) < 2e-5
    for a, b in zip(kept_kv(pool, batch), kv_full, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # Nothing past the kept rows was written: the pool's other slots stay zero.
    flat = [pool.flat_k(i) for i in range(cfg.num_layers)]
    written = {s for s in range(flat[0].shape[0]) if any(bool(t[s].any()) for t in flat)}
    first = BLOCK * batch.seqs[0].block_ids[0] if num_kept else 0
    assert written == set(range(first, first + num_kept))


def test_several_sequences_attend_all_rows_at_once() -> None:
    """Two sequences in one batch: the whole-T attention path (no row streaming)."""
    model, cfg, pool, be = setup("tiny")
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    two = ForwardBatch(
        ids, torch.cat([torch.arange(20), torch.arange(10)]),
        [SeqSlice(0, 20, 0, 20, [1, 2, 3, 4, 5]), SeqSlice(20, 10, 0, 10, [6, 7, 8])],
        torch.tensor([19, 29]), is_decode=False,
    )  # fmt: skip
    calls = spy_rows(be)
    with torch.inference_mode():
        be.plan(two)
        assert not be.attends_rows()
        full = model(two.input_ids, two.positions, be)
        be.plan(two)
        chunked = model(two.input_ids, two.positions, be, chunk_tokens=8)
    assert rel_err(chunked, full) < 2e-5
    assert calls == []


def test_one_sequence_within_the_budget_attends_all_rows_at_once() -> None:
    """`stream_rows_above` (the runner passes the prefill budget): one sequence of at most
    that many tokens takes the whole-T form (faster on the GPU; its peak is the budget step's,
    which the start-up dry run reserves), one longer streams rows; both give the whole
    forward's hidden states and K/V."""
    model, cfg, pool, be = setup("tiny")
    batch = one_prompt(cfg, 37, 37)
    calls = spy_rows(be)
    with torch.inference_mode():
        be.plan(batch)
        full = model(batch.input_ids, batch.positions, be)
        kv_full = kept_kv(pool, batch)
        for above, streamed in ((37, False), (64, False), (36, True)):
            for t in pool.k + pool.v:
                t.zero_()
            calls.clear()
            be.plan(batch)
            out = model(
                batch.input_ids, batch.positions, be, chunk_tokens=8, stream_rows_above=above
            )
            assert bool(calls) == streamed, above
            assert rel_err(out, full) < 2e-5
            for a, b in zip(kept_kv(pool, batch), kv_full, strict=True):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("num_kept", [45, 30, 16])  # all kept, part of the new rows, none
def test_streamed_rows_after_a_cached_prefix(preset: str, num_kept: int) -> None:
    """A prompt whose first 16 positions are cached (a prefix hit): the rows read the
    context's K/V from the pool, attend to it, and match both the batch's whole-T forward and
    the same positions of the uncached prompt's forward."""
    model, cfg, pool, be = setup(preset)
    whole = one_prompt(cfg, 45, 16)  # writes the prefix's K/V: blocks 1..4
    blocks = list(range(1, 1 + (num_kept + BLOCK - 1) // BLOCK))
    rest = ForwardBatch(
        whole.input_ids[16:], torch.arange(16, 45), [SeqSlice(0, 29, 16, num_kept, blocks)],
        torch.tensor([28]), is_decode=False,
    )  # fmt: skip
    with torch.inference_mode():
        be.plan(whole)
        uncached = model(whole.input_ids, whole.positions, be)[16:]
        be.plan(rest)
        assert be.attends_rows() and be.num_context_rows() == 16
        full = model(rest.input_ids, rest.positions, be)
        kv_full = kept_kv(pool, rest)
        # Clear what `full` wrote (positions 16 .. kept), keep the context: the rows must
        # write those positions again themselves.
        new_slots = [b * BLOCK + o for b in blocks for o in range(BLOCK)][16:num_kept]
        for t in [pool.flat_k(i) for i in range(cfg.num_layers)] + [
            pool.flat_v(i) for i in range(cfg.num_layers)
        ]:
            t[new_slots] = 0
        calls = spy_rows(be)
        be.plan(rest)
        rows = model(rest.input_ids, rest.positions, be, chunk_tokens=8)
    assert calls[:4] == [(8, 24), (8, 32), (8, 40), (5, 45)]  # context + rows up to the chunk
    assert rel_err(rows, full) < 2e-5
    assert rel_err(rows, uncached) < 2e-5
    for a, b in zip(kept_kv(pool, rest), kv_full, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_streamed_rows_in_layer_slices() -> None:
    """The split executor runs layers in slices: the stream comes back as (h, None) and the
    next slice continues it; a slice after a whole-attention one folds h + residual first."""
    model, cfg, pool, be = setup("tiny-qwen3")
    batch = one_prompt(cfg, 29, 29)
    with torch.inference_mode():
        be.plan(batch)
        full = model(batch.input_ids, batch.positions, be)
        h, residual = model.forward_layers(
            model.embed(batch.input_ids), None, batch.positions, be, 0, 1, 5
        )
        assert residual is None
        h, residual = model.forward_layers(h, residual, batch.positions, be, 1, cfg.num_layers, 5)
        assert rel_err(model.final_norm(h, residual), full) < 2e-5
        # Layer 0 by the whole-attention path (a backend without row streaming), the rest
        # streamed: the pair is folded into one stream.
        h, residual = model.forward_layers(
            model.embed(batch.input_ids), None, batch.positions, _NoRows(be), 0, 1, 5
        )
        assert residual is not None
        h, residual = model.forward_layers(h, residual, batch.positions, be, 1, cfg.num_layers, 5)
        assert residual is None
        assert rel_err(model.final_norm(h, residual), full) < 2e-5


class _NoRows:
    """The backend without its row-streaming methods (as a backend written before them)."""

    def __init__(self, inner: TorchAttentionBackend) -> None:
        self._inner = inner
        self.fuses_rope = inner.fuses_rope
        self.writes_out = inner.writes_out

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self._inner.forward(*args, **kwargs)


def test_rope_of_one_tensor_is_the_pair_s() -> None:
    model, cfg, _, _ = setup("tiny")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(9, cfg.num_q_heads, cfg.head_dim, generator=g)
    k = torch.randn(9, cfg.num_kv_heads, cfg.head_dim, generator=g)
    pos = torch.arange(100, 109)
    cache = model.rotary.cos_sin_cache
    rq, rk = ops.apply_rope(q, k, pos, cache)
    assert torch.equal(ops.apply_rope_one(q, pos, cache), rq)
    assert torch.equal(ops.apply_rope_one(k, pos, cache), rk)


@pytest.mark.parametrize("pieces", [[10, 29], [5, 15, 25, 29], [29]])
def test_a_streamed_layer_in_row_pieces_is_the_whole_layer(pieces: list[int]) -> None:
    """Sub-layer slices: rows [s, e) of one streamed layer at a time (`forward_layer_rows`),
    the first piece projecting the layer's K/V, later ones taking them back, give the very
    stream and pool K/V of `forward_layers` over the same layers (the same chunks run)."""
    model, cfg, pool, be = setup("tiny-qwen3")
    batch = one_prompt(cfg, 29, 29)
    with torch.inference_mode():
        be.plan(batch)
        assert model.streams_rows(29, be, 5) and not model.streams_rows(29, be, 5, 29)
        h0, r0 = model.forward_layers(
            model.embed(batch.input_ids), None, batch.positions, be, 0, cfg.num_layers, 5
        )
        kv_whole = kept_kv(pool, batch)
        for t in pool.k + pool.v:
            t.zero_()
        be.plan(batch)
        h, residual, kv = model.embed(batch.input_ids), None, None
        for layer in range(cfg.num_layers):
            start = 0
            for end in pieces:
                h, kv = model.forward_layer_rows(
                    h, residual, batch.positions, be, layer, start, end, 5, kv
                )
                residual = None
                assert (kv is None) == (end == 29)
                start = end
    assert r0 is None and torch.equal(h, h0)
    for a, b in zip(kept_kv(pool, batch), kv_whole, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="multiple"):
        model.layers[0].attend_rows_range(h, batch.positions, be, model.rotary, 5, None, 3, 8)  # type: ignore[arg-type]
