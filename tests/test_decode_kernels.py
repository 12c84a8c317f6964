"""The fused small-batch decode kernels (runtime/model/decode_kernels.py) and FusedDecodeStep
(runtime/model/fused_decode.py) against plain torch and against the model's unfused decode.

Without CUDA the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1
before anything imports triton): the same kernel code, executed on the CPU with numpy. On a
GPU the same tests run the compiled kernels. Skipped where triton is not installed."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

# Runs twice under make test on a GPU machine: interpreted in the CUDA-hidden pass, compiled in
# the GPU pass (`-m "gpu or kernels"`).
pytestmark = pytest.mark.kernels


def _interpreter_broken() -> str | None:
    """Triton before 3.8 fails in its interpreter under numpy >= 2.4 ("only 0-dimensional
    arrays can be converted to Python scalars"): the CUDA torch images bundle such a Triton."""
    import numpy as np

    def version(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])

    if version(triton.__version__) < (3, 8) and version(np.__version__) >= (2, 4):
        return f"Triton {triton.__version__}'s interpreter fails under numpy {np.__version__}"
    return None


if not torch.cuda.is_available() and (why := _interpreter_broken()):
    pytest.skip(f"{why}; the GPU pass checks the compiled kernels", allow_module_level=True)

from runtime.attention.base import ForwardBatch, SeqSlice  # noqa: E402
from runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from runtime.kv.kv_pool import KVPool  # noqa: E402
from runtime.model import decode_kernels as dk  # noqa: E402
from runtime.model import ops  # noqa: E402
from runtime.model.config import RopeScaling  # noqa: E402
from runtime.model.fused_decode import FusedDecodeStep, unsupported_reason  # noqa: E402
from runtime.model.loader import _materialise, init_random_weights  # noqa: E402
from runtime.model.presets import get_preset  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds float32 -> bfloat16 toward zero (a bias of ~1 % over a few roundings);
# its float16 rounds to nearest like the GPU, so the CPU run checks the kernels in float16.
DT = torch.bfloat16 if DEV == "cuda" else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def poisoned(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("num_parts", [0, 1, 3])
def test_add_rmsnorm(rows: int, num_parts: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + num_parts)
    H = 96  # not a power of two: the masked tail is exercised
    res = torch.randn(rows, H, generator=g).to(DEV, DT)
    parts = torch.randn(num_parts, rows, H, generator=g).to(DEV) if num_parts else None
    w = torch.rand(H, generator=g).to(DEV, DT) + 0.5
    ref_res = res.float() + (parts.sum(0) if parts is not None else 0)
    ref_res = ref_res.to(DT)
    ref = ops.rms_norm(ref_res.float(), w.float(), 1e-5)  # fp32 reference
    out = poisoned(rows, H)
    got = dk.add_rmsnorm(parts, res, w, 1e-5, out=out)
    assert rel_err(res, ref_res) < 1e-2
    assert not got.isnan().any()
    assert rel_err(got, ref) < 1e-2


def _pool(num_blocks: int, page: int, hkv: int, d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(num_blocks * page, hkv, d, generator=g).to(DEV, DT)


# rows 1: the element-wise kernel; 2 and more: the tensor-core one (block_m 16, 32, 64).
@pytest.mark.parametrize("rows,bias", [(1, False), (2, True), (5, False), (20, True), (48, False)])
def test_qkv_rope_write(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    hq, hkv, d, K = 4, 2, 32, 80
    n_out = (hq + 2 * hkv) * d
    x = torch.randn(rows, K, generator=g).to(DEV, DT)
    w = (torch.randn(n_out, K, generator=g) / K**0.5).to(DEV, DT)
    b = (torch.randn(n_out, generator=g) * 0.1).to(DEV, DT) if bias else None
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    cs = ops.rope_cos_sin_cache(256, d, 10000.0, scaling).to(DEV)
    pos = torch.randint(0, 256, (rows,), generator=g).to(DEV)
    num_blocks = max(10, rows)  # 4 slots a block: room for every row's distinct slot
    slots = torch.randperm(num_blocks * 4, generator=g)[:rows].to(DEV)
    kf = _pool(num_blocks, 4, hkv, d, g)
    vf = kf.clone()
    k_before, v_before = kf.clone(), vf.clone()
    q = dk.qkv_rope_write(x, w, b, pos, cs, kf, vf, slots, hq)
    # Reference: projection (rounded to bf16 like the unfused path), then RoPE in fp32.
    qkv = (x.float() @ w.float().T + (b.float() if b is not None else 0)).to(DT)
    rq, rk, rv = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rq, rk = ops.apply_rope(rq.view(rows, hq, d), rk.view(rows, hkv, d), pos, cs)
    assert rel_err(q, rq) < 1e-2
    assert rel_err(kf[slots], rk) < 1e-2
    assert rel_err(vf[slots], rv.view(rows, hkv, d)) < 1e-2
    untouched = torch.ones(kf.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(kf[untouched], k_before[untouched])  # no other slot written
    assert torch.equal(vf[untouched], v_before[untouched])


@pytest.mark.parametrize(
    "rows,K,N,splits",
    [(1, 256, 40, None), (3, 300, 24, 2), (8, 64, 8, 1), (33, 520, 100, None), (64, 256, 72, 3)],
)
def test_gemv_splitk(rows: int, K: int, N: int, splits: int | None) -> None:
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(rows, K, generator=g).to(DEV, DT)
    w = torch.randn(N, K, generator=g).to(DEV, DT)
    parts = dk.gemv_splitk(x, w, num_splits=splits)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, N)
    assert rel_err(parts.sum(0), x.float() @ w.float().T) < 1e-4


@pytest.mark.parametrize("rows", [1, 4, 6, 40])
def test_gate_up_silu(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    K, inter = 64, 44
    x = torch.randn(rows, K, generator=g).to(DEV, DT)
    w = (torch.randn(2 * inter, K, generator=g) / K**0.5).to(DEV, DT)
    ref = ops.silu_and_mul((x.float() @ w.float().T).to(DT).float())
    assert rel_err(dk.gate_up_silu(x, w), ref) < 1e-2


class _PoisonedEmpty:
    """Stands for `torch` inside decode_kernels: its empty buffers start as NaN, so a kernel
    that reads a partial it never wrote fails the test instead of reading zeros by luck.
    `made` keeps the buffers `empty` made (the attention's partials), to look at after."""

    def __init__(self) -> None:
        self.made: list[torch.Tensor] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, *shape, dtype=None, device=None):
        self.made.append(torch.full(shape, float("nan"), dtype=dtype, device=device))
        return self.made[-1]

    @staticmethod
    def empty_like(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan"))


def _paged(lens: list[int], page: int, hkv: int, d: int, g: torch.Generator):
    """Pools and a block table with each row's blocks at scattered places."""
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need) + 4
    kf, vf = _pool(num_blocks, page, hkv, d, g), _pool(num_blocks, page, hkv, d, g)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[start : start + nb].to(torch.int32)
        start += nb
    return kf, vf, table


def _attention_ref(q, kf, vf, table, lens, page, hq, hkv, d, row):
    n = lens[row]
    pos = torch.arange(n)
    slots = (table[row, pos // page].long() * page + pos % page).to(DEV)
    k = kf[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
    v = vf[slots].float().repeat_interleave(hq // hkv, dim=1)
    p = torch.einsum("hd,nhd->hn", q[row].float(), k).mul(d**-0.5).softmax(-1)
    return torch.einsum("hn,nhd->hd", p, v)


def test_split_chunk_tokens_cuts_the_long_row() -> None:
    """One long context among short ones: its splits are cut to about half an SM's share of
    the step's KV, the short rows keep few, every row fits its splits, tiles are whole."""
    import numpy as np

    lens = np.array([14_000] + [1_000] * 47)
    max_splits = dk.attention_splits(48, 2, 132)
    assert max_splits == 32  # 32 programs an SM over 48 rows x 2 KV heads: 44, to a power of two
    chunk = dk.split_chunk_tokens(lens, 2, max_splits, 132, block_n=64)
    assert (chunk % 64 == 0).all()
    used = -(-lens // chunk)
    assert (used <= max_splits).all() and (used * chunk >= lens).all()
    share = 2 * lens.sum() / 132  # one SM's tokens (per KV head) at a perfect balance
    assert chunk[0] <= share  # the old fixed split (2 a row) gave it 7,000 tokens
    assert used[0] >= 8 and used[1:].max() <= 3
    # Even contexts: about 2 * 132 / (M * Hkv) splits a row, as the fixed count gave.
    even = dk.split_chunk_tokens(np.full(4, 2048), 8, dk.attention_splits(4, 8), 132, 64)
    assert (-(-2048 // even) == 8).all()
    # A row too long for max_splits pieces of the share still fits in max_splits.
    capped = dk.split_chunk_tokens(np.array([100_000, 10]), 8, 4, 132, 64)
    assert capped[0] * 4 >= 100_000 and capped[0] % 64 == 0


@pytest.mark.parametrize("lens,num_splits", [([700, 37, 5, 64, 1], 8), ([300, 9], 1)])
def test_decode_attention_row_chunks(
    lens: list[int], num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-row split sizes: the long row splits many ways, the short ones use one split and
    leave the rest dead: those programs exit at once, their partials are never written (NaN
    here) and the merge by the long row's last split reads only its live ones."""
    import numpy as np

    g = torch.Generator().manual_seed(len(lens))
    hq, hkv, d, page = 8, 2, 32, 4
    kf, vf, table = _paged(lens, page, hkv, d, g)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, DT)
    chunk = dk.split_chunk_tokens(np.array(lens), hkv, num_splits, num_sms=8, block_n=16)
    if num_splits > 1:
        assert chunk[0] < lens[0] and (chunk[1:] >= np.array(lens[1:])).any()
    monkeypatch.setattr(dk, "torch", _PoisonedEmpty())
    out = dk.decode_attention(
        q,
        kf,
        vf,
        table.to(DEV),
        torch.tensor(lens, dtype=torch.int64, device=DEV),
        page,
        d**-0.5,
        num_splits,
        block_n=16,
        chunk_tokens=torch.from_numpy(chunk).to(DEV),
    )
    for i in range(len(lens)):
        ref = _attention_ref(q, kf, vf, table, lens, page, hq, hkv, d, i)
        assert rel_err(out[i], ref) < 1e-2, f"row {i} (len {lens[i]})"


@pytest.mark.parametrize(
    "lens,hq,hkv,splits",
    [([1], 8, 2, 4), ([37, 5, 64], 4, 4, 2), ([100, 3], 8, 1, 8), ([37, 5, 64], 8, 2, 1)],
)
def test_decode_attention(lens: list[int], hq: int, hkv: int, splits: int) -> None:
    g = torch.Generator().manual_seed(sum(lens))
    d, page = 32, 4
    kf, vf, table = _paged(lens, page, hkv, d, g)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, DT)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=DEV)
    out = dk.decode_attention(q, kf, vf, table.to(DEV), lens_t, page, d**-0.5, splits)
    for i, n in enumerate(lens):
        ref = _attention_ref(q, kf, vf, table, lens, page, hq, hkv, d, i)
        assert rel_err(out[i], ref) < 1e-2, f"row {i} (len {n})"


def _attention_case(lens: list[int], hq: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    d, page = 32, 4
    kf, vf, table = _paged(lens, page, hkv, d, g)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEV, DT)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=DEV)
    refs = [_attention_ref(q, kf, vf, table, lens, page, hq, hkv, d, i) for i in range(len(lens))]
    return (q, kf, vf, table.to(DEV), lens_t, page, d**-0.5), refs


@pytest.mark.parametrize("row_chunks", [True, False])
def test_decode_attention_mixes_one_split_and_merged_rows(
    row_chunks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch with rows of one live split (written directly) and rows of several (merged
    by their last split), on NaN-filled partials: every row matches the reference."""
    import numpy as np

    lens, hq, hkv, splits = [5, 300, 2000, 17], 8, 2, 8
    args, refs = _attention_case(lens, hq, hkv, seed=11)
    chunk = None
    if row_chunks:
        chunk_np = dk.split_chunk_tokens(np.array(lens), hkv, splits, num_sms=8, block_n=16)
        used = -(-np.array(lens) // chunk_np)
        assert used[0] == used[3] == 1 and used[1] > 1 and used[2] > 1
        chunk = torch.from_numpy(chunk_np).to(DEV)
    monkeypatch.setattr(dk, "torch", _PoisonedEmpty())
    out = dk.decode_attention(*args, splits, block_n=16, chunk_tokens=chunk)
    for i, n in enumerate(lens):
        assert rel_err(out[i], refs[i]) < 1e-2, f"row {i} (len {n})"


def test_decode_attention_leaves_its_counters_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last split of a (row, KV head) zeroes its counter after the merge, so one buffer
    serves call after call (a CUDA graph's replays, every layer): a second call on the same
    counters gives the first call's output exactly."""
    lens, hq, hkv, splits = [70, 3, 200], 4, 2, 4
    args, refs = _attention_case(lens, hq, hkv, seed=12)
    counters = torch.zeros(len(lens), hkv, dtype=torch.int32, device=DEV)
    monkeypatch.setattr(dk, "torch", _PoisonedEmpty())  # an output never written stays NaN
    first = dk.decode_attention(*args, splits, block_n=16, counters=counters)
    assert not counters.any(), counters
    second = dk.decode_attention(*args, splits, block_n=16, counters=counters)
    assert not counters.any(), counters
    assert torch.equal(first, second)
    for i, n in enumerate(lens):
        assert rel_err(second[i], refs[i]) < 1e-2, f"row {i} (len {n})"


def test_decode_attention_one_split_rows_skip_the_partials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of one live split under a bound of several (the 8B's even contexts at 48-64 rows):
    the output is written directly, right on NaN partials, which stay unwritten, and no
    counter is touched."""
    lens, hq, hkv, splits = [20, 33, 7], 8, 2, 4
    args, refs = _attention_case(lens, hq, hkv, seed=13)
    chunk = torch.full((len(lens),), 48, dtype=torch.int64, device=DEV)  # >= every row's length
    # Not zero, as a merging launch would need: a ticket taken would show, and be wrong.
    counters = torch.full((len(lens), hkv), 7, dtype=torch.int32, device=DEV)
    poisoned_torch = _PoisonedEmpty()
    monkeypatch.setattr(dk, "torch", poisoned_torch)
    out = dk.decode_attention(*args, splits, block_n=16, chunk_tokens=chunk, counters=counters)
    assert (counters == 7).all()
    for i, n in enumerate(lens):
        assert rel_err(out[i], refs[i]) < 1e-2, f"row {i} (len {n})"
    parts = [t for t in poisoned_torch.made if t.dtype == torch.float32]
    assert len(parts) == 2 and all(t.isnan().all() for t in parts)  # partial o and lse


def _tiny_model(preset: str):
    cfg = get_preset(preset)
    model = _materialise(cfg, DT, torch.device(DEV))
    init_random_weights(model, seed=3)
    return model, cfg


def _decode_batch(ctx_lens: list[int], page: int, blocks: list[list[int]]) -> ForwardBatch:
    seqs = [
        SeqSlice(i, 1, c, c + 1, b) for i, (c, b) in enumerate(zip(ctx_lens, blocks, strict=True))
    ]
    ids = torch.tensor([(97 * i + 5) % 1000 for i in range(len(ctx_lens))], device=DEV)
    pos = torch.tensor(ctx_lens, device=DEV)
    return ForwardBatch(ids, pos, seqs, torch.arange(len(ctx_lens), device=DEV), True)


@pytest.mark.parametrize(
    "preset,rows", [("tiny", 3), ("tiny-qwen2", 3), ("tiny", 1), ("tiny-qwen2", 20)]
)
def test_fused_step_matches_unfused_decode(preset: str, rows: int) -> None:
    """A decode step through FusedDecodeStep gives the logits of the model's own forward
    (torch attention backend) and writes the same K/V into the pool: element-wise kernels at
    1 row, tensor-core ones from 2, one KV split at 20 rows (no partials); at 3 rows the
    attention merges its splits in-kernel and leaves the step's counters zero."""
    model, cfg = _tiny_model(preset)
    page = 4
    g0 = torch.Generator().manual_seed(rows)
    ctx_lens = [9, 30, 1] if rows == 3 else torch.randint(1, 40, (rows,), generator=g0).tolist()
    # Each row's blocks at scattered places in the pool (a permutation, no block shared).
    need = [c // page + 1 for c in ctx_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g0).tolist()
    blocks, start = [], 0
    for n in need:
        blocks.append(perm[start : start + n])
        start += n
    pool = KVPool.for_model(cfg, num_blocks, page, DT, DEV)
    g = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:  # a filled pool: the context the step attends to
        t.copy_(torch.randn(t.shape, generator=g).to(DEV, DT))
    ref_pool = KVPool.for_model(cfg, num_blocks, page, DT, DEV)
    for a, b in zip(ref_pool.k + ref_pool.v, pool.k + pool.v, strict=True):
        a.copy_(b)
    batch = _decode_batch(ctx_lens, page, blocks)
    with torch.inference_mode():
        be = TorchAttentionBackend(ref_pool)
        be.plan(batch)
        ref = model.compute_logits(model(batch.input_ids, batch.positions, be))
        # 1 SM at 20 rows: the grid has room for one split a (row, KV head): no merge.
        step = FusedDecodeStep(
            model,
            pool.k,
            pool.v,
            batch_size=rows,
            max_blocks_per_seq=12,
            num_sms=1 if rows == 20 else 16,
        )
        if rows == 20:
            assert step.num_splits == 1
        step.plan(batch)
        got = model.compute_logits(step.forward(batch.input_ids, batch.positions))
    assert rel_err(got, ref) < 3e-2
    assert not step.attn_counters.any()
    for layer in range(cfg.num_layers):
        assert rel_err(pool.k[layer], ref_pool.k[layer]) < 1e-2
        assert rel_err(pool.v[layer], ref_pool.v[layer]) < 1e-2


def test_fused_step_refuses_what_it_cannot_run() -> None:
    assert "q/k norms" in unsupported_reason(get_preset("tiny-qwen3"), DT)
    assert "float32" in unsupported_reason(get_preset("tiny"), torch.float32)
    model, cfg = _tiny_model("tiny")
    pool = KVPool.for_model(cfg, 4, 4, DT, DEV)
    with pytest.raises(ValueError, match="1..64 rows"):
        FusedDecodeStep(model, pool.k, pool.v, batch_size=65, max_blocks_per_seq=4)
    step = FusedDecodeStep(model, pool.k, pool.v, batch_size=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="2 decode rows got 1"):
        step.plan(_decode_batch([3], 4, [[0]]))
