"""runtime.attention.base.IndexSpans: slots and rows built span by span equal the per-token
loop the FlashInfer backend used to run (the GPU tests check the backend itself)."""

from __future__ import annotations

import random

import torch

from runtime.attention.base import IndexSpans


def _slot(block_ids: list[int], p: int, bs: int) -> int:
    return block_ids[p // bs] * bs + p % bs


def test_spans_match_the_per_token_loop() -> None:
    rng = random.Random(0)
    for bs in (1, 4, 16):
        spans, slots, want_spans, want_slots = IndexSpans(), IndexSpans(), [], []
        for _ in range(40):
            # Short and long spans, starting mid-block or on a block edge, and empty ones.
            n = rng.choice([0, 1, 3, IndexSpans.LONG - 1, IndexSpans.LONG, 300, 2000])
            start = rng.choice([0, bs, rng.randint(0, 500)])
            blocks = rng.sample(range(10_000), (start + n) // bs + 1)
            spans.add_range(start, start + n)
            want_spans.extend(range(start, start + n))
            slots.add_slots(blocks, start, start + n, bs)
            want_slots.extend(_slot(blocks, p, bs) for p in range(start, start + n))
        assert spans.tensor().tolist() == want_spans
        got = slots.tensor()
        assert got.dtype == torch.int64 and got.tolist() == want_slots
    assert IndexSpans().tensor().tolist() == []


def test_host_tensor_equals_torch_tensor() -> None:
    """`ops.host_tensor` (through array.array) gives what `torch.tensor` gives, and its tensor
    keeps the buffer it views alive."""
    import gc

    from runtime.model.ops import host_tensor

    rng = random.Random(1)
    ints = [rng.randrange(-(2**40), 2**40) for _ in range(500)]
    cases = [
        (ints, torch.int64),
        ([v % 2**31 for v in ints], torch.int32),
        ([rng.uniform(-3, 3) for _ in range(300)] + [float("-inf")], torch.float32),
        ([True, False, 3], torch.int64),
        ([], torch.int64),
        ([[1, 2], [3, 4]], torch.int64),  # nested: through torch.tensor
        ([1, 0, 1], torch.bool),  # no array code: through torch.tensor
    ]
    for values, dtype in cases:
        got = host_tensor(values, dtype)
        gc.collect()
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want), (dtype, values[:4])


def test_bench_host_lists_writes_its_figures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from bench import host_lists

    lists = host_lists.step_lists(2, 10, 64, 3, 40)
    indptr, indices, last = (v for v, _ in lists[:3])
    assert indptr == [0, 5, 10, 13, 16, 19] and len(indices) == 19
    assert last == [10, 10, 9, 9, 9]  # 74 tokens: 4 full pages + 10; 41: 2 + 9
    out = tmp_path / "r.json"
    argv = ["--queries", "2", "--query-tokens", "10", "--cached-tokens", "64", "--decodes", "3"]
    argv += ["--decode-context", "40"]
    assert host_lists.main([*argv, "--repeats", "1", "--iters", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["median_ms_a_step"]) == {"torch.tensor", "host_tensor"}
    assert data["shape"]["num_ints"] == sum(len(v) for v, _ in lists) and data["device"]
