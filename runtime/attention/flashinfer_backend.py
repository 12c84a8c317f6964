"""FlashInfer attention over the paged KV pool (CUDA only).

One instance per CUDA stream that runs model work: the workspace buffer and the planned
wrappers belong to that stream (prefill and decode run concurrently on different streams when
the GPU is partitioned, and sharing a workspace between concurrently running wrappers corrupts
it). `plan()` must run on the stream that will run the forward: FlashInfer copies plan
metadata to the device with non-blocking copies on the current stream.

Kernel choice per step (`plan`):
- decode (every sequence: one new token, context > 0): paged decode, tensor cores when
  num_q_heads / num_kv_heads >= 4 (GQA), after writing the new token's k/v into the pool;
- prefill with no cached context anywhere in the batch: ragged prefill over this step's k/v;
- prefill with cached context (prefix hit, later chunk) and nothing discarded: write the new
  k/v into the pool, then paged prefill over context + new tokens; a batch of mostly
  one-token rows (a merged step: prefill parts + decodes) on FlashInfer's FA2 kernels, which
  size the query tile from the batch's mean query length, instead of its Hopper (FA3) ones,
  whose 128-row tiles a one-token row leaves mostly empty. H200, Llama-3.1-8B shape, 48 chat
  streams: the merged steps took 15.0 ms on FA3 and 12.5-13.1 ms on FA2, +1-6 % output
  tokens/s through HTTP (docs/benchmarks.md, "Three kernel options A/B'd against vLLM").
  Not when the step's chunk runs over a long context (`FA3_WORK_RATIO_*`): there FA2's plan
  gives the chunk a few long tiles, and past 2 x SMs // KV heads tiles stops splitting its
  KV at all (8B on an H100, 41k of context: 44 ms on FA2, 74 past that cliff, 35 on FA3).
  Also on FA2: a batch whose FA3 work items would fill at most half the SMs (a short query
  over a long cached prefix; FA3 never splits the KV): `prefill_on_fa2`;
- prefill with cached context AND a discarded suffix (a scoring request with a prefix hit):
  the suffix has no pool slots, so the context is gathered from the pool into a per-layer
  buffer next to this step's k/v and ragged prefill runs over that (on FA2's kernels by the
  same rule, `prefill_on_fa2`). This costs one copy of the context per layer, for EVERY
  member of the batch with context once any one member discards; so the scheduler keeps a
  scoring prompt's whole KV (its partial last block too) whenever the pool has room, and this
  is the uncommon case (the pool too full to keep a suffix).

Suffix-KV discard: tokens at positions >= num_kept_tokens are attended from this step's k/v
(which live only as long as the layer's forward: the per-layer scratch) and never written.

KV layout (runtime/kv/kv_pool.py): per layer k and v, each [num_blocks, block_size, Hkv, D]
(FlashInfer's "NHD" paged layout with page_size = block_size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import (
    ForwardBatch,
    IndexSpans,
    Rope,
    SeqSlice,
    fuse_rope_for,
    load_rope_kv_write,
)
from runtime.model import ops

DEFAULT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
# FlashInfer 0.5.3's FA2 scheduler (attention/scheduler.cuh, PrefillPlan): a plan that splits
# the KV runs at most (CTAS_PER_SM * num_SMs) // num_kv_heads work tiles of up to
# FA2_MAX_TILE_ROWS packed query rows, and keeps a float32 partial output and log-sum-exp for
# every tile row of every query head in the float workspace.
FA2_CTAS_PER_SM = 2
FA2_MAX_TILE_ROWS = 128


def float_workspace_bytes(num_q_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The float workspace one instance needs: FlashInfer's default, or more where a split-KV
    FA2 prefill plan (a merged step of mostly one-token rows) can need more. Hazard: with a
    buffer below that bound the plan raises "Buffer overflow when allocating memory for
    batch_prefill_tmp_v" on some merged steps; the engine then re-runs the step's requests one
    at a time (H200, Qwen2.5-3B shape: 16 query heads over 2 KV heads need 133 MiB, and 77
    merged steps failed so in a 48-stream chat run: output tokens/s 0.67x, P99 gap between
    tokens 150 ms against 15 ms)."""
    max_tiles = (FA2_CTAS_PER_SM * num_sms) // num_kv_heads
    per_tile_row = num_q_heads * (head_dim + 1) * 4  # partial output (head_dim) + lse, float32
    need = max_tiles * FA2_MAX_TILE_ROWS * per_tile_row + (1 << 20)  # + alignment slack
    return max(DEFAULT_WORKSPACE_BYTES, need)


# FlashInfer 0.5.3's Hopper (FA3) prefill plan (attention/scheduler.cuh, PrefillSM90Plan):
# one work item per query head per FA3_TILE_ROWS query rows of a sequence, never split along
# the KV, query heads of a group not packed together.
FA3_TILE_ROWS = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fa2_split_plan(
    query_lens: list[int],
    kv_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    num_sms: int,
    page_size: int,
) -> dict[str, Any]:
    """The work split FlashInfer 0.5.3's FA2 paged-prefill plan chooses for a batch (no CUDA
    graph, no sliding window; include/flashinfer/attention/scheduler.cuh, `PrefillPlan` ->
    `PrefillSplitQOKVIndptr` -> `PrefillBinarySearchKVChunkSize`): a query tile from the mean
    packed query length, then the smallest KV chunk (in pages) whose work tiles fit in
    (FA2_CTAS_PER_SM x SMs) // KV heads; `split_kv` when that chunk is shorter than the
    longest KV. `query_lens`, `kv_lens`: tokens per sequence (kv = context + this step's
    tokens). Host cost: a binary search over the longest KV's pages, O(batch) an iteration."""
    group = num_q_heads // num_kv_heads
    packed = [n * group for n in query_lens]
    avg = sum(packed) // len(packed)
    cta_tile_q = 128 if avg > 64 else 64 if avg > 16 else 16  # FA2DetermineCtaTileQ, sm80+
    kv_pages = [max(1, _ceil_div(n, page_size)) for n in kv_lens]
    max_tiles = (FA2_CTAS_PER_SM * num_sms) // num_kv_heads  # max_batch_size_if_split
    q_tiles = [_ceil_div(p, cta_tile_q) for p in packed]
    lo, hi = max(128 // page_size, 1), max(kv_pages)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(t * _ceil_div(k, mid) for t, k in zip(q_tiles, kv_pages, strict=True)) > max_tiles:
            lo = mid + 1
        else:
            hi = mid
    num_chunks = [_ceil_div(k, lo) for k in kv_pages]
    return {
        "cta_tile_q": cta_tile_q,
        "split_kv": lo < max(kv_pages),
        "kv_chunk_tokens": lo * page_size,
        "num_work_tiles": sum(t * c for t, c in zip(q_tiles, num_chunks, strict=True)),
        "max_work_tiles_if_split": max_tiles,
        "kv_chunks_per_seq": num_chunks,
    }


# A merged step (mostly one-token rows) stays on FA2 while the prefill rows' attention work
# (query rows x KV tokens) is under FA3_WORK_RATIO_LOW times what FA3's 128-row tiles spend
# on its one-token rows (FA3_TILE_ROWS x each one's KV tokens), and goes to FA3 from
# FA3_WORK_RATIO_HIGH times. Between, it stays on FA2 only where FA2's plan splits the KV:
# otherwise the chunk's few long tiles run one after another on a few SMs. Either way it
# stays on FA2 where FA3's grid would leave most of the GPU idle (`FA3_IDLE_RATIO`): FA3
# never splits a sequence's KV, so a short chunk of a model with few KV heads is a handful of
# CTAs each reading the whole context, while FA2's plan spreads it over every SM.
# Engine-level, bench.mixed_step on an H100, 120 merged steps:
# - the fit (bench/results/mixed-step-2026-12-06-{08d613e,22053ec}/, 96 steps): a 330-460-
#   token chunk after 8-41k of context beside 6 or 10 decodes of 2k (8B shape), and a
#   512-token one after 4-12k beside 16 or 48 decodes of 1k (8B and 3B shapes);
# - the held-out check (bench/results/mixed-step-2026-12-06-31fee8e/, 24 steps): 256 and
#   700 tokens after 16k and 30k beside 4 or 24 decodes of 1.5k, 8B and 3B. There the first
#   rule took up to 1.74x the faster kernel (+6.2 % over the 24): the 3B's 256-token chunk
#   ran on FA3's 32 CTAs (2 KV heads) where FA2 split it over 132 SMs (12.8 against 22.2 ms at
#   30k); and the 8B's 256 tokens beside 24 decodes stayed on an unsplit FA2 plan that
#   "filled" its tile budget with 40 tiles each reading 30k keys (38.1 against 31.2 ms).
# This rule is within 3.2 % of the faster kernel on the 24 and 8.3 % on all 120 (+0.13 % in
# all); FA2 always took up to 2.1x (+32 %), FA3 always up to 1.74x (+2.5 %). The idle ratio
# was read off the held-out steps, which are therefore no longer held out. `python -m
# bench.kernel_rule FILES` scores the rule on any such files.
FA3_WORK_RATIO_LOW = 1.0
FA3_WORK_RATIO_HIGH = 2.5
# FA2 when FA3's attention makespan bound is at least this many times FA2's (`_makespans`):
# FA3's tiles run ~1.2-2x faster than FA2's on Hopper, so only a grid that idles most of the
# GPU loses to FA2. Measured: the 3B's 256-token chunks at 16-30k, ratio 3.6-4.1, FA2 took
# 0.58-0.67x FA3's step; every step at ratio <= 2.0 was FA3's or within 4 % of it.
FA3_IDLE_RATIO = 3.0


def _makespans(
    query_lens: list[int],
    kv_lens: list[int],
    group: int,
    num_kv_heads: int,
    num_sms: int,
    fa2_plan: dict[str, Any],
) -> tuple[float, float]:
    """Lower bounds of FA2's and FA3's attention makespans (packed query rows x keys per SM):
    the larger of the whole grid's work spread over the SMs and its longest CTA. FA2's CTAs
    are its plan's query tiles x KV chunks; FA3's are 128-row tiles over the whole KV. A tile
    costs its full row count, empty rows included. O(batch)."""
    ct, chunk = fa2_plan["cta_tile_q"], fa2_plan["kv_chunk_tokens"]
    fa2_work = fa3_work = 0
    for n, kv in zip(query_lens, kv_lens, strict=True):
        fa2_work += _ceil_div(n * group, ct) * ct * kv
        fa3_work += _ceil_div(n * group, FA3_TILE_ROWS) * FA3_TILE_ROWS * kv
    longest = max(kv_lens)
    fa2 = max(num_kv_heads * fa2_work / num_sms, ct * min(chunk, longest))
    fa3 = max(num_kv_heads * fa3_work / num_sms, FA3_TILE_ROWS * longest)
    return fa2, fa3


def prefill_on_fa2(
    query_lens: list[int],
    kv_lens: list[int],
    num_q_heads: int | None,
    num_kv_heads: int,
    num_sms: int,
    page_size: int,
) -> bool:
    """Whether a prefill batch with context (paged, or gathered next to a discarded suffix)
    runs FlashInfer's FA2 kernels rather than its Hopper ones (`kv_lens`: context + query
    tokens per sequence; `num_q_heads` None: unknown, the work rules below not judged).
    - Mostly one-token rows (a merged step), FA2: FA3's 128-row tiles would stay mostly
      empty. Unless the prefill rows' attention work outweighs that waste and FA2's plan
      would not split the KV (`FA3_WORK_RATIO_*`): a chunk over a long context beside a few
      decodes, where FA2's plan gives the chunk a few long tiles (at 41k of context on an
      H100, 8B shape, a 350-token chunk beside 10 decodes took 44 ms on FA2, 35 on FA3, and
      74 on FA2 at 360 tokens, where its plan stopped splitting the KV). And never where
      FA3's grid would idle most of the GPU (`FA3_IDLE_RATIO`).
    - Otherwise FA2 when FA3's work items could fill at most half the SMs: FA3 never splits
      a sequence's KV, so a short query over a long cached prefix (a scoring request's
      ~150-token suffix after a 10-15k-token profile) runs on a few SMs, while FA2's plan
      splits the KV until the GPU is full. On the H200 (3B shape, serving next to chat,
      `96bc96d`) such a suffix step took 12.4-13.3 ms on FA3 (0 or 1 decodes beside it) and
      7.5-8.4 ms on FA2 with 2 or more decodes in the same batch."""
    one_token_kv = [kv for n, kv in zip(query_lens, kv_lens, strict=True) if n == 1]
    if 2 * len(one_token_kv) > len(query_lens):
        if num_q_heads is None:
            return True
        fa3_waste = FA3_TILE_ROWS * sum(one_token_kv)
        work = sum(n * kv for n, kv in zip(query_lens, kv_lens, strict=True) if n > 1)
        if work < FA3_WORK_RATIO_LOW * fa3_waste:
            return True  # chat's merged steps: decided without the plan's O(batch) search
        plan = fa2_split_plan(query_lens, kv_lens, num_q_heads, num_kv_heads, num_sms, page_size)
        group = num_q_heads // num_kv_heads
        fa2, fa3 = _makespans(query_lens, kv_lens, group, num_kv_heads, num_sms, plan)
        if fa3 >= FA3_IDLE_RATIO * fa2:
            return True  # FA3's grid would idle most of the GPU
        if work >= FA3_WORK_RATIO_HIGH * fa3_waste:
            return False
        return bool(plan["split_kv"])
    if num_q_heads is None:
        return False
    fa3_works = num_q_heads * sum(_ceil_div(n, FA3_TILE_ROWS) for n in query_lens)
    return 2 * fa3_works <= num_sms


def uses_tensor_core_decode(num_q_heads: int, num_kv_heads: int) -> bool:
    """Decode on FlashInfer's tensor-core (FA2 prefill) kernel: it pays off for GQA >= 4."""
    return num_q_heads // num_kv_heads >= 4


# Decode attention in CUDA graphs. FlashInfer 0.5.3 plans a graph's decode with split KV on
# every step (scheduler.cuh: `PrefillBinarySearchKVChunkSize` returns split whenever CUDA graphs
# are on), so a captured decode step runs a merge kernel a layer even when every request ends up
# in one chunk: at batch 64 on the Llama-3.1-8B shape its heuristic gives each request one
# chunk (64 rows > its 2 * 132 // 8 = 33 tiles), and the merge only copies. Its
# `disable_split_kv` is no way out (the plan multiplies its INT64_MAX chunk by the page size:
# wrong results and an illegal access on the H200, 2026-12-02). `fixed_split_size` = the
# longest request's pages is: no request splits, no merge kernel is captured, the attention
# kernel runs the same tiles. Such a graph is correct for any batch of its size; whether it is
# faster is `prefer_one_chunk`.
one_chunk_decode_supported = uses_tensor_core_decode  # fixed_split_size: tensor cores only


def one_chunk_min_rows(num_kv_heads: int, num_sms: int) -> int:
    """FlashInfer's tile budget for a split plan, (FA2_CTAS_PER_SM * num_sms) // num_kv_heads:
    from this many padded decode rows its split gives every request one chunk anyway."""
    return max(1, (FA2_CTAS_PER_SM * num_sms) // num_kv_heads)


def prefer_one_chunk(num_rows: int, min_rows: int) -> bool:
    """Whether a decode step of `num_rows` padded rows replays its one-chunk graph. From
    `min_rows` on, the split graph runs the very same tiles (each request one chunk: its binary
    search cannot fit two chunks of anyone in the budget) plus a merge that only copies: the
    one-chunk graph is that minus the merge. Below, the split spreads each request's KV over
    more CTAs, and whether that beats one CTA a request without the merge is measured
    (bench/attention_split.py)."""
    return num_rows >= min_rows


def flashinfer_unavailable_reason() -> str:
    """ "" when FlashInfer can be used here, else why not (said once by the caller)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return f"flashinfer cannot be imported ({type(exc).__name__}: {exc})"
    return ""


@dataclass(slots=True)
class _Plan:
    mode: str  # "decode" | "ragged" | "paged" | "paged_fa2" | "gather"
    write_rows: torch.Tensor | None  # [W] int64 rows of this step's k/v to keep; None = all rows
    write_slots: torch.Tensor  # [W] int64 flat slot = block * block_size + offset
    # "gather" only: where pooled context and this step's k/v go in the per-layer buffer
    gather_slots: torch.Tensor | None = None  # [C] flat pool slots of cached context
    gather_dst: torch.Tensor | None = None  # [C] rows in the buffer
    new_dst: torch.Tensor | None = None  # [T] rows in the buffer for this step's tokens
    total_kv: int = 0
    ragged_fa2: bool = False  # "gather" only: on the FA2 ragged kernels (`prefill_on_fa2`)
    # With the fused RoPE + pool write: each row's slot, -1 where not written; else None.
    token_slots: torch.Tensor | None = None
    # One prefill sequence (row streaming; None for any other batch): its kept rows are its
    # first ones, in order (write_slots[i] is row i's); its cached context's slots are built
    # at the first read_context.
    row_seq: SeqSlice | None = None
    row_context_slots: torch.Tensor | None = None


class FlashInferBackend:
    """AttentionBackend on FlashInfer. See the module docstring for the kernel choice."""

    name = "flashinfer"

    def __init__(
        self,
        k_caches: list[torch.Tensor] | Any,
        v_caches: list[torch.Tensor] | None = None,
        num_q_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        sm_scale: float | None = None,
        workspace_bytes: int | None = None,
        graph_batch_size: int | None = None,
        max_blocks_per_seq: int | None = None,
        workspace: torch.Tensor | None = None,
        fuse_rope_kv_write: bool = False,
        decode_one_chunk: bool = False,
    ) -> None:
        """k_caches/v_caches: one [num_blocks, block_size, Hkv, D] tensor per layer.

        graph_batch_size: build a CUDA-graph-safe decode-only instance for exactly this many
        sequences (fixed index buffers; `plan` only fills them). max_blocks_per_seq sizes those
        buffers (required with graph_batch_size). fuse_rope_kv_write: the model passes q and k
        un-rotated and this backend rotates them in the launch that writes the pool
        (runtime/attention/rope_kv_write.py) instead of RoPE + two `index_copy_`.
        decode_one_chunk (graph instances with tensor-core decode only): every request's KV in
        one chunk, no merge kernel (`one_chunk_decode_supported`, module notes)."""
        import flashinfer

        if v_caches is None:  # FlashInferBackend(kv_pool): the engine's call
            pool = k_caches
            k_caches, v_caches = pool.k, pool.v
            num_kv_heads, head_dim = pool.num_kv_heads, pool.head_dim
        assert num_kv_heads is not None and head_dim is not None
        if k_caches[0].dtype not in (torch.float16, torch.bfloat16):
            # The engine's auto path catches this and falls back to torch (saying why).
            raise ValueError(
                f"FlashInfer kernels need a float16/bfloat16 KV cache, got {k_caches[0].dtype}"
            )
        self._fi = flashinfer
        self.k_caches = k_caches
        self.v_caches = v_caches
        # Each layer's pool as flat [num_blocks * block_size, Hkv, D] slot views, built once:
        # the pool never moves, and two views a layer a step showed in the host's profile.
        flat_shape = (-1, num_kv_heads, head_dim)
        self._flat = [
            (kc.view(flat_shape), vc.view(flat_shape))
            for kc, vc in zip(k_caches, v_caches, strict=True)
        ]
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = int(k_caches[0].shape[1])
        self.sm_scale = sm_scale if sm_scale is not None else head_dim**-0.5
        self.device = k_caches[0].device
        self.kv_dtype = k_caches[0].dtype
        # num_q_heads may be None (built from a pool alone): then it is read from q at the
        # first forward of each step and the kernel plans run there, on the same stream.
        self._deferred: list = []
        self.graph_batch_size = graph_batch_size
        self._rope_kv_write = load_rope_kv_write(fuse_rope_kv_write, self.device, head_dim)
        self.fuses_rope = self._rope_kv_write is not None
        self.writes_out = True  # every FlashInfer wrapper's run() takes out=
        # One workspace per instance == per stream (see module docstring). `workspace` may be
        # shared only between instances that never run concurrently (e.g. the decode graphs
        # of one stream, replayed one at a time). Default size: float_workspace_bytes, or
        # FlashInfer's default where the query heads are not known yet (benchmarks only).
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if workspace is None:
            if workspace_bytes is None:
                workspace_bytes = DEFAULT_WORKSPACE_BYTES
                if num_q_heads is not None:
                    workspace_bytes = float_workspace_bytes(
                        num_q_heads, num_kv_heads, head_dim, self.num_sms
                    )
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.workspace = workspace
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self._paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # FA2 paged prefill for batches of mostly one-token rows (module docstring); made on
        # first need (a decode-only instance never plans one). Shares the workspace: one
        # paged wrapper is planned a step, never both.
        self._paged_fa2: Any = None
        self._ragged_fa2: Any = None  # the same for a gathered context (made on first need)
        self._max_blocks_per_seq = max_blocks_per_seq
        self._decode_wrapper: Any = None
        self._static_slots: torch.Tensor | None = None
        if graph_batch_size is not None:
            if max_blocks_per_seq is None:
                raise ValueError("max_blocks_per_seq is required with graph_batch_size")
            bs = graph_batch_size
            # Fixed buffers: a captured graph reads these addresses on every replay.
            self._g_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            self._g_indices = torch.zeros(
                bs * max_blocks_per_seq, dtype=torch.int32, device=self.device
            )
            self._g_last = torch.ones(bs, dtype=torch.int32, device=self.device)
            self._static_slots = torch.zeros(bs, dtype=torch.int64, device=self.device)
        self._plan: _Plan | None = None
        self._plan_num_tokens = 0  # the planned batch's rows (row_slots)
        # FlashInfer's `fixed_split_size`, in pages: the longest request a graph instance
        # takes, so that no request is ever split (and no merge kernel is captured).
        self._fixed_split_pages: int | None = None
        if decode_one_chunk:
            if graph_batch_size is None or max_blocks_per_seq is None:
                raise ValueError("decode_one_chunk is for CUDA-graph decode instances")
            if num_q_heads is None or not one_chunk_decode_supported(num_q_heads, num_kv_heads):
                raise ValueError("decode_one_chunk needs tensor-core decode (GQA group >= 4)")
            self._fixed_split_pages = max_blocks_per_seq
        if num_q_heads is not None:
            self._decode_wrapper = self._make_decode_wrapper()

    def _make_decode_wrapper(self) -> Any:
        assert self.num_q_heads is not None
        tc = uses_tensor_core_decode(self.num_q_heads, self.num_kv_heads)
        if self.graph_batch_size is None:
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tc
            )
        # Fixed buffers: a captured graph reads these addresses on every replay.
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_tensor_cores=tc,
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self._g_indptr,
            paged_kv_indices_buffer=self._g_indices,
            paged_kv_last_page_len_buffer=self._g_last,
        )

    def _kernel_plan(self, fn: Any) -> None:
        """Run a wrapper plan now (heads known) or at the next forward (heads from q)."""
        if self.num_q_heads is None:
            self._deferred.append(fn)
        else:
            fn(self.num_q_heads)

    @property
    def _decode(self) -> Any:
        return self._decode_wrapper

    @classmethod
    def from_pool(cls, kv_pool: Any, num_q_heads: int, **kwargs: Any) -> FlashInferBackend:
        """Build over a `runtime.kv.kv_pool.KVPool` (its per-layer `k` / `v` lists)."""
        return cls(
            kv_pool.k, kv_pool.v, num_q_heads, kv_pool.num_kv_heads, kv_pool.head_dim, **kwargs
        )

    def warm_up(self, block_id: int) -> list[str]:
        """Plan and run each kernel family a step can plan (ragged prefill, paged prefill on
        FA3, paged prefill on FA2, a gathered context on FA2's ragged kernels, decode) once, on
        a few dummy rows of layer 0 whose k/v go to `block_id` (a block no sequence reads: the
        pool's pad block). FlashInfer compiles a module at its first use on a machine (JIT, ~1
        min each without its cache) and loads it at its first use in a process: here that
        happens at start-up instead of inside the first requests' steps (a fresh H200's first 48-stream
        chat run on the 8B shape: 1,267 tok/s and a 54 s P99 TTFT, against ~4,900 warm).
        Returns the plan modes that ran. Blocks the host until the device is done."""
        if self.num_q_heads is None or self.graph_batch_size is not None:
            return []  # heads unknown until a forward / a decode-only graph instance
        bs = self.block_size

        def seq(start: int, num_new: int, num_context: int) -> SeqSlice:
            n = num_context + num_new
            return SeqSlice(start, num_new, num_context, n, [block_id] * ((n + bs - 1) // bs))

        # Paged prefill stays on FA3 only with work items for more than half the SMs.
        fa3_rows = FA3_TILE_ROWS * (self.num_sms // (2 * self.num_q_heads) + 1)
        batches = (
            [seq(0, 16, 0)],  # no context: ragged
            [seq(0, fa3_rows, 16)],  # context: paged (FA3)
            [seq(0, 8, 16), seq(8, 1, 16), seq(9, 1, 16)],  # mostly one-token rows: FA2
            # context and a discarded suffix (8 of 16 rows kept): gathered, a short query on
            # FA2's ragged kernels
            [SeqSlice(0, 16, 16, 24, [block_id] * ((24 + bs - 1) // bs))],
            [seq(0, 1, 16), seq(1, 1, 16)],  # decode
        )
        modes = []
        for seqs in batches:
            num_tokens = sum(s.num_query_tokens for s in seqs)
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            is_decode = all(s.num_query_tokens == 1 for s in seqs)
            self.plan(ForwardBatch(ids, ids, seqs, ids[:0], is_decode=is_decode))
            q = torch.randn(
                num_tokens, self.num_q_heads, self.head_dim, dtype=self.kv_dtype, device=self.device
            )
            kv = torch.randn(
                num_tokens, self.num_kv_heads, self.head_dim, dtype=self.kv_dtype,
                device=self.device,
            )  # fmt: skip
            self.forward(0, q, kv, kv)
            assert self._plan is not None
            modes.append(self._plan.mode)
        self._plan = None
        torch.cuda.synchronize(self.device)
        return modes

    # ------------------------------------------------------------------ planning
    def _to_dev(self, values: list[int] | IndexSpans, dtype: torch.dtype) -> torch.Tensor:
        # Pinned host tensor + non_blocking copy on the current stream: no host sync.
        if isinstance(values, IndexSpans):
            t = values.tensor(pin_memory=True)
        else:
            t = ops.host_tensor(values, dtype).pin_memory()
        return t.to(self.device, dtype=dtype, non_blocking=True)

    @staticmethod
    def _host(values: list[int]) -> torch.Tensor:
        """An int32 indptr-like plan argument as a pinned HOST tensor. Hazard: FlashInfer's
        plan reads these on the host (`.to("cpu")`): given device tensors it copies them
        back, which synchronises the stream and stalls the host behind the step in flight.
        Given pinned host tensors, that is a no-op and its own device copies stay async."""
        return ops.host_tensor(values, torch.int32).pin_memory()

    def plan(self, batch: ForwardBatch) -> None:
        self._deferred = []
        self._plan_num_tokens = batch.num_tokens
        bs_tok = self.block_size
        seqs = batch.seqs
        # Built span by span (IndexSpans): a long prompt's or context's indices in one tensor
        # op each, not a Python loop over its tokens.
        write_rows = IndexSpans()
        write_slots = IndexSpans()
        all_rows_written = True
        has_context = False
        has_discard = False
        for s in seqs:
            ctx, nq, kept = s.num_context_tokens, s.num_query_tokens, s.num_kept_tokens
            if kept < ctx or kept > ctx + nq:
                raise ValueError(f"num_kept_tokens {kept} outside [{ctx}, {ctx + nq}]")
            if len(s.block_ids) * bs_tok < kept:
                raise ValueError("block_ids do not cover num_kept_tokens")
            has_context |= ctx > 0
            has_discard |= kept < ctx + nq
            write_rows.add_range(s.query_start, s.query_start + kept - ctx)
            write_slots.add_slots(s.block_ids, ctx, kept, bs_tok)
            if kept - ctx != nq:
                all_rows_written = False
        rows_t = None if all_rows_written else self._to_dev(write_rows, torch.int64)

        if batch.is_decode:
            if has_discard:
                raise ValueError("decode steps keep every token")
            self._plan_decode(seqs, write_slots)
            return
        if self.graph_batch_size is not None:
            raise ValueError("a CUDA-graph backend instance only runs decode batches")
        slots_t = self._to_dev(write_slots, torch.int64)
        qo_indptr = [0]
        for s in seqs:
            qo_indptr.append(qo_indptr[-1] + s.num_query_tokens)
        common = dict(causal=True, sm_scale=self.sm_scale, q_data_type=self.kv_dtype)
        if not has_context:
            qo = self._host(qo_indptr)
            self._kernel_plan(
                lambda hq: self._ragged.plan(qo, qo, hq, self.num_kv_heads, self.head_dim, **common)
            )
            self._plan = _Plan(
                "ragged",
                rows_t,
                slots_t,
                token_slots=self._token_slots(batch, rows_t, slots_t),
            )
        elif not has_discard:
            kv_indptr, kv_indices, last = self._paged_meta(
                [(s.block_ids, s.num_context_tokens + s.num_query_tokens) for s in seqs]
            )
            qo = self._host(qo_indptr)
            fa2 = prefill_on_fa2(
                [s.num_query_tokens for s in seqs],
                [s.num_context_tokens + s.num_query_tokens for s in seqs],
                self.num_q_heads,
                self.num_kv_heads,
                self.num_sms,
                bs_tok,
            )
            if fa2 and self._paged_fa2 is None:
                self._paged_fa2 = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend="fa2"
                )
            wrapper = self._paged_fa2 if fa2 else self._paged
            self._kernel_plan(
                lambda hq: wrapper.plan(
                    qo,
                    kv_indptr,
                    kv_indices,
                    last,
                    hq,
                    self.num_kv_heads,
                    self.head_dim,
                    bs_tok,
                    kv_data_type=self.kv_dtype,
                    **common,
                )
            )
            self._plan = _Plan(
                "paged_fa2" if fa2 else "paged",
                rows_t,
                slots_t,
                token_slots=self._token_slots(batch, rows_t, slots_t),
            )
        else:
            gather_slots = IndexSpans()
            gather_dst = IndexSpans()
            new_dst = IndexSpans()
            kv_indptr_l = [0]
            for s in seqs:
                base, ctx = kv_indptr_l[-1], s.num_context_tokens
                gather_slots.add_slots(s.block_ids, 0, ctx, bs_tok)
                gather_dst.add_range(base, base + ctx)
                new_dst.add_range(base + ctx, base + ctx + s.num_query_tokens)
                kv_indptr_l.append(base + ctx + s.num_query_tokens)
            qo = self._host(qo_indptr)
            kvi = self._host(kv_indptr_l)
            lens = [s.num_query_tokens for s in seqs]
            kv_lens = [s.num_context_tokens + s.num_query_tokens for s in seqs]
            fa2 = self.num_q_heads is not None and prefill_on_fa2(
                lens, kv_lens, self.num_q_heads, self.num_kv_heads, self.num_sms, bs_tok
            )
            if fa2 and self._ragged_fa2 is None:
                self._ragged_fa2 = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
                    self.workspace, "NHD", backend="fa2"
                )
            ragged = self._ragged_fa2 if fa2 else self._ragged
            self._kernel_plan(
                lambda hq: ragged.plan(qo, kvi, hq, self.num_kv_heads, self.head_dim, **common)
            )
            self._plan = _Plan(
                "gather",
                rows_t,
                slots_t,
                gather_slots=self._to_dev(gather_slots, torch.int64),
                gather_dst=self._to_dev(gather_dst, torch.int64),
                new_dst=self._to_dev(new_dst, torch.int64),
                total_kv=kv_indptr_l[-1],
                token_slots=self._token_slots(batch, rows_t, slots_t),
                ragged_fa2=fa2,
            )

        if len(seqs) == 1:  # row streaming is possible (DecoderLayer.forward_rows)
            assert self._plan is not None
            self._plan.row_seq = seqs[0]

    def _paged_meta(
        self, seqs: list[tuple[list[int], int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_ids, kv_len) per sequence -> kv_indptr, kv_indices, kv_last_page_len: the
        indptr and last-page lengths as pinned host tensors (plan reads them on the host), the
        indices on the device (a graph-mode decode plan copies host indices blocking)."""
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for block_ids, kv_len in seqs:
            n_pages = (kv_len + self.block_size - 1) // self.block_size
            indices.extend(block_ids[:n_pages])
            indptr.append(indptr[-1] + n_pages)
            last.append(kv_len - (n_pages - 1) * self.block_size)
        return (
            self._host(indptr),
            self._to_dev(indices, torch.int32),
            self._host(last),
        )

    def _plan_decode(self, seqs: list, write_slots: IndexSpans) -> None:
        if self.graph_batch_size is not None and len(seqs) != self.graph_batch_size:
            raise ValueError(
                f"graph instance for batch {self.graph_batch_size} got {len(seqs)} sequences"
            )
        self._plan_flashinfer_decode(seqs)
        slots = self._to_dev(write_slots, torch.int64)
        if self._static_slots is not None:
            self._static_slots.copy_(slots, non_blocking=True)
            slots = self._static_slots
        # A decode row always writes its token: the slots are the per-row slots.
        fuse = self.fuses_rope and fuse_rope_for(len(seqs))
        self._plan = _Plan("decode", None, slots, token_slots=slots if fuse else None)

    def _plan_flashinfer_decode(self, seqs: list) -> None:
        kv_indptr, kv_indices, last = self._paged_meta(
            [(s.block_ids, s.num_context_tokens + 1) for s in seqs]
        )
        extra = {}
        if self._fixed_split_pages is not None:
            extra["fixed_split_size"] = self._fixed_split_pages
        self._kernel_plan(
            lambda hq: self._decode.plan(
                kv_indptr,
                kv_indices,
                last,
                hq,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                sm_scale=self.sm_scale,
                q_data_type=self.kv_dtype,
                kv_data_type=self.kv_dtype,
                **extra,
            )
        )

    def _token_slots(
        self, batch: ForwardBatch, rows: torch.Tensor | None, slots: torch.Tensor
    ) -> torch.Tensor | None:
        """Each row's pool slot (-1: not written) for the fused RoPE + write, else None (not
        fusing, or a part too long to fuse: `fuse_rope_for`)."""
        if not self.fuses_rope or not fuse_rope_for(batch.num_tokens):
            return None
        if rows is None:  # every row written, in order
            return slots
        out = torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=self.device)
        return out.index_copy_(0, rows, slots)

    def row_slots(self) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before row_slots()")
        if plan.token_slots is not None:
            return plan.token_slots
        if plan.write_rows is None:  # every row written, in order
            return plan.write_slots
        out = torch.full((self._plan_num_tokens,), -1, dtype=torch.int64, device=self.device)
        return out.index_copy_(0, plan.write_rows, plan.write_slots)

    # ------------------------------------------------------------------ forward
    def _flat_caches(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pool as flat [num_blocks * block_size, Hkv, D] slot views."""
        return self._flat[layer_idx]

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan: _Plan) -> None:
        if plan.write_slots.numel() == 0:
            return
        if plan.write_rows is not None:
            k = k.index_select(0, plan.write_rows)
            v = v.index_select(0, plan.write_rows)
        # Flat [num_blocks * block_size, Hkv, D] views; index_copy_ is graph-capturable.
        kc, vc = self._flat_caches(layer_idx)
        kc.index_copy_(0, plan.write_slots, k.to(kc.dtype))
        vc.index_copy_(0, plan.write_slots, v.to(vc.dtype))

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope | None = None,
        out: torch.Tensor | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before forward()")
        if self._deferred:  # heads were unknown at plan time: read them from q now
            self.num_q_heads = int(q.shape[1])
            if self._decode_wrapper is None:
                self._decode_wrapper = self._make_decode_wrapper()
            for fn in self._deferred:
                fn(self.num_q_heads)
            self._deferred = []
        if kv_written:  # rotated and written by the caller (the prefill graphs)
            pass
        elif rope is not None and plan.token_slots is not None and rope[1].dtype == torch.float32:
            kc, vc = self._flat_caches(layer_idx)
            q, k = self._rope_kv_write(q, k, v, *rope, plan.token_slots, kc, vc)
        else:
            if rope is not None:  # asked to rotate, but not fusing here: RoPE, then the writes
                q, k = ops.apply_rope(q, k, *rope)
            self._write(layer_idx, k, v, plan)
        caches = (self.k_caches[layer_idx], self.v_caches[layer_idx])
        if plan.mode == "decode":
            return self._decode.run(q, caches, out=out)
        if plan.mode == "paged":
            return self._paged.run(q, caches, out=out)
        if plan.mode == "paged_fa2":
            assert self._paged_fa2 is not None
            return self._paged_fa2.run(q, caches, out=out)
        if plan.mode == "ragged":
            return self._ragged.run(q, k, v, out=out)
        # "gather": [cached context from the pool | this step's k/v] per sequence.
        assert plan.gather_slots is not None and plan.gather_dst is not None
        assert plan.new_dst is not None
        shape = (plan.total_kv, self.num_kv_heads, self.head_dim)
        kbuf = torch.empty(shape, dtype=k.dtype, device=k.device)
        vbuf = torch.empty(shape, dtype=v.dtype, device=v.device)
        kflat, vflat = self._flat_caches(layer_idx)
        kbuf.index_copy_(0, plan.gather_dst, kflat.index_select(0, plan.gather_slots))
        vbuf.index_copy_(0, plan.gather_dst, vflat.index_select(0, plan.gather_slots))
        kbuf.index_copy_(0, plan.new_dst, k)
        vbuf.index_copy_(0, plan.new_dst, v)
        ragged = self._ragged_fa2 if plan.ragged_fa2 else self._ragged
        return ragged.run(q, kbuf, vbuf, out=out)

    # ------------------------------------------------------------------ row streaming
    def attends_rows(self) -> bool:
        plan = self._plan
        return plan is not None and plan.row_seq is not None

    def num_context_rows(self) -> int:
        plan = self._plan
        assert plan is not None and plan.row_seq is not None, "attends_rows() first"
        return plan.row_seq.num_context_tokens

    def read_context(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        plan = self._plan
        assert plan is not None and plan.row_seq is not None, "attends_rows() first"
        if plan.row_context_slots is None:  # once a step, at the first layer
            s = plan.row_seq
            spans = IndexSpans()
            spans.add_slots(s.block_ids, 0, s.num_context_tokens, self.block_size)
            plan.row_context_slots = self._to_dev(spans, torch.int64)
        kc, vc = self._flat_caches(layer_idx)
        torch.index_select(kc, 0, plan.row_context_slots, out=k)
        torch.index_select(vc, 0, plan.row_context_slots, out=v)

    def write_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        plan = self._plan
        assert plan is not None and plan.row_seq is not None, "attends_rows() first"
        s = plan.row_seq
        end = min(start + k.shape[0], s.num_kept_tokens - s.num_context_tokens)
        if end <= start:
            return
        slots = plan.write_slots[start:end]
        kc, vc = self._flat_caches(layer_idx)
        kc.index_copy_(0, slots, k[: end - start].to(kc.dtype))
        vc.index_copy_(0, slots, v[: end - start].to(vc.dtype))

    def attend_rows(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # FlashInfer's causal mask aligns the queries with the last len(q) keys (append
        # attention): query i sees keys 0 .. len(k) - len(q) + i. No plan: one launch.
        return self._fi.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=self.sm_scale)

    def debug_state(self) -> dict[str, Any]:
        plan = self._plan
        return {
            "mode": None if plan is None else plan.mode,
            "ragged_fa2": None if plan is None else plan.ragged_fa2,
        }
