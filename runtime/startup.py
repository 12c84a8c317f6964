"""Start-up work of an engine before its thread runs: memory sizing, warm-ups, measured prefills.

Memory, in the order `Engine.__init__` runs it (CUDA only): hybrid prefill's chunk
(`size_prefill_chunk`, with `--prefill-chunk-tokens` left to auto), then the activation reserve
kept free beside the KV pool (`MemorySizing.activation_reserve`: dry-run prefills on the ops
that will serve) and, without `--max-score-tokens`, the longest scoring prompt that reserve
leaves room for (`MemorySizing.fit_max_score_tokens`). The KV pool gets the rest
(runtime/kv/kv_pool.py `compute_num_blocks`).

Warm-ups (`warm_up_prefill`): one long discarded prefill through the serving runner, then one
forward of each form a chat's first chunked steps take (`warm_up_forms`), so a user's first
request does not pay first-use host costs with decodes waiting.

Measured prefills (`measure_prefill_batch`, `served_keeps_kv`): one real prefill step through
the serving runner on borrowed blocks, timed; what the warm-ups, the JCT profile
(runtime/calibrate.py) and the partition profile run, through `Engine.measure_prefill` and
`Engine.measure_prefill_batch`. Everything here runs before `Engine.start()`.

Logged as the engine (`greenlane.engine`): bench/startup_memory.py reads these lines from a
server's start-up log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import AttentionBackend
from runtime.config import EngineConfig
from runtime.diagnostics import fallbacks
from runtime.graphs.prefill import prefill_graph_bytes, prefill_graph_max_tokens
from runtime.kv.block_manager import BlockManager
from runtime.kv.kv_pool import (
    CHUNK_MEMORY_SHARE,
    CUDA_SAFETY_BYTES,
    NUM_RESERVED_BLOCKS,
    PREFILL_CHUNK_CHOICES,
    KVPool,
    auto_prefill_chunk_tokens,
    bytes_per_block,
    chunk_temporaries_bytes,
    cuda_memory_budget_bytes,
)
from runtime.model.config import ModelConfig
from runtime.request import Request, RequestKind
from runtime.runner import (
    ActivationLine,
    ModelRunner,
    activation_line,
    activation_probe_lengths,
    profile_activation_peak,
)
from runtime.scheduler import Lease, ScheduledSeq, StepPlan

log = logging.getLogger("greenlane.engine")

# A warm-up form: (uncached, cached) tokens per sequence, and whether their KV is kept.
WarmUpForm = tuple[list[tuple[int, int]], bool]


# ---- memory ---------------------------------------------------------------------------------
def size_prefill_chunk(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    reserved_at_start: int,
) -> int:
    """`prefill_chunk_tokens` = auto on CUDA (`auto_prefill_chunk_tokens`): from the bytes
    the KV pool and the activations may share here, less an explicitly sized pool.
    `reserved_at_start`: what this process's allocator held before the engine."""
    cfg, mc = config, model_config
    shared = cuda_memory_budget_bytes(cfg, device, reserved_at_start)
    pool = ""
    if cfg.num_kv_blocks is not None:
        pool_bytes = cfg.num_kv_blocks * bytes_per_block(mc, cfg.block_size, dtype)
        shared -= pool_bytes
        pool = f" beside the {pool_bytes / 2**30:.1f} GiB pool asked for"
    elem = torch.empty((), dtype=dtype).element_size()
    chunk = auto_prefill_chunk_tokens(mc, elem, shared)
    temporaries = chunk_temporaries_bytes(mc, chunk, elem)
    log.info(
        "hybrid prefill's chunk: %d tokens (auto: the largest of %s whose MLP temporaries "
        "take at most %g %% of the %.1f GiB the KV pool and activations share%s, else the "
        "smallest; %.2f GiB, %.1f %%; --prefill-chunk-tokens sets it)",
        chunk,
        "/".join(map(str, PREFILL_CHUNK_CHOICES)),
        CHUNK_MEMORY_SHARE * 100,
        shared / 2**30,
        pool,
        temporaries / 2**30,
        100 * temporaries / max(shared, 1.0),
    )
    return chunk


@dataclass(slots=True)
class MemorySizing:
    """The activation reserve and the longest scoring prompt, for one engine's model on one
    CUDA device. `config` is the served one (its hybrid chunk already sized);
    `max_score_tokens` starts at `--max-score-tokens` (else `max_model_len`) and
    `fit_max_score_tokens` may lower it: the engine serves what it ends at."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    reserved_at_start: int  # what this process's allocator held before the engine
    max_model_len: int
    max_score_tokens: int

    def activation_reserve(
        self, model: Any, backend_for: Callable[[KVPool], AttentionBackend]
    ) -> int:
        """Activation bytes to keep free beside the KV pool, measured, not guessed: dry-run
        prefills of one step's budget and of two longer prompts (`activation_probe_lengths`:
        where the per-token term leads) give the step's peak, a fixed part and a per-token
        slope; the reserve covers the larger of one budget-sized step and the longest scoring
        prompt (`max_score_tokens`, which runs alone with hybrid prefill). `backend_for(pool)`:
        the attention backend that will serve, over a dry run's own pool."""
        cfg, mc = self.config, self.model_config
        chunk, _ = cfg.hybrid_form()
        # Only a scoring prompt runs whole (generation prompts are cut to the step's budget), so
        # no dry run needs to be longer than the longest one; nor than the model's positions,
        # where profile_activation_peak stops.
        longest = min(self.max_score_tokens, model.rotary.max_positions)
        step = min(cfg.prefill_token_budget, self.max_model_len)
        n0, lo, hi = activation_probe_lengths(step, chunk, longest)
        # The piecewise prefill graphs hold their buffers and pool for the engine's life: a
        # fixed part of the reserve (over by that much if the backend turns out not to be
        # FlashInfer, which they need).
        graphs = 0
        if cfg.cuda_graphs:
            graphs = prefill_graph_bytes(model, prefill_graph_max_tokens(cfg), self.dtype)

        def peak_at(num_tokens: int) -> int:
            # A step of the budget may hold several sequences (chat parts, short scoring
            # prompts): hybrid prefill then attends all rows at once, the higher peak per
            # token; a longer prompt runs alone and streams rows (DecoderLayer.forward_rows).
            several = chunk is not None and num_tokens == n0 and n0 > chunk
            peak = profile_activation_peak(
                cfg, model, mc, num_tokens, backend_for, num_seqs=2 if several else 1
            )
            return peak + graphs

        # Start-up's first forwards: on a machine without FlashInfer's compiled kernels they
        # JIT-compile them first (on the H200, ~3 min before anything else was logged).
        log.info(
            "measuring the activation peak: dry-run prefills of up to %d tokens (the first "
            "forwards on this machine compile the attention kernels: minutes, once)",
            max(n0, hi),
        )
        t0 = time.perf_counter()
        line = activation_line(peak_at, n0, lo, hi)
        if cfg.max_score_tokens is None and line.slope > 0:
            self.fit_max_score_tokens(line)
        reserve = int(line.reserve(self.max_score_tokens))
        log.info(
            "activation peak measured in %.1f s: %.2f GiB at %d tokens, %.1f KiB/token; "
            "reserving %.2f GiB (scoring prompts up to %d tokens)",
            time.perf_counter() - t0,
            line.step_peak / 2**30,
            n0,
            line.slope / 1024,
            reserve / 2**30,
            self.max_score_tokens,
        )
        return reserve

    def fit_max_score_tokens(self, line: ActivationLine) -> None:
        """Without --max-score-tokens the longest scoring prompt defaults to max_model_len; if
        reserving its activations (`line.reserve`) would leave the KV pool unable to hold one
        max_model_len sequence, lower it to what fits (never below one step's budget) and say
        so, rather than refusing to start.

        When no reserve at all leaves room for a max_model_len sequence's KV (a cap smaller
        than that KV: `--max-model-len 262144` in 24 GB), generation requests are limited by
        the pool whatever is reserved, and only scoring prompts can be long (suffix-KV discard
        keeps no KV past their prefix). Then the pool keeps one step's budget of tokens, so
        chat still runs, and scoring takes the rest; both limits are logged."""
        mc, bs = self.model_config, self.config.block_size
        per_block = bytes_per_block(mc, bs, self.dtype)

        def pool_bytes(num_tokens: int) -> int:
            return (-(-num_tokens // bs) + NUM_RESERVED_BLOCKS) * per_block

        budget = cuda_memory_budget_bytes(self.config, self.device, self.reserved_at_start)
        room = budget - CUDA_SAFETY_BYTES
        min_pool = pool_bytes(self.max_model_len)
        floor_tokens = line.step_tokens
        if room - line.step_peak < min_pool:
            min_pool = pool_bytes(min(floor_tokens, self.max_model_len))
        fits = line.longest_within(room - min_pool) // bs * bs
        if fits >= self.max_score_tokens:
            return
        new = max(floor_tokens, fits)
        pool_tokens = int((room - line.reserve(new)) // per_block - NUM_RESERVED_BLOCKS) * bs
        log.warning(
            "scoring prompts limited to %d tokens (not %d): the activations of a longer one "
            "would leave too little memory for the KV cache (about %d tokens left for it, "
            "which limits generation requests); set --max-score-tokens to choose, or a smaller "
            "--prefill-token-budget when the pool was left one step's budget (it then keeps "
            "less, and scoring gets the rest)",
            new,
            self.max_score_tokens,
            max(0, pool_tokens),
        )
        self.max_score_tokens = new


# ---- warm-ups -------------------------------------------------------------------------------
def warm_up_prefill(
    num_tokens: int,
    measure_prefill: Callable[[int, int], float],
    measure_prefill_batch: Callable[..., float],
    forms: Callable[[], list[WarmUpForm]],
    device: torch.device,
) -> float | None:
    """One prefill of `num_tokens` (the caller caps it at the longest scoring prompt) through
    the serving runner, its KV kept or discarded as a served scoring prompt's would be
    (`measure_prefill`), before the first request, so its first-use host costs are paid
    here: on the H200 a fresh server's first 16k prompt spent ~130 ms more host time inside
    cuBLAS (its first GEMMs of that many rows) and in the scoring path's first elementwise
    kernels, with the GPU waiting (docs/benchmarks.md, "A fresh server's first long
    prompt"). The activation dry runs do not do it: other lengths, their own pool, no
    scoring head. Then one forward of each of `forms()` (`warm_up_forms`) through
    `measure_prefill_batch`. Returns the long prefill's seconds (None if it failed). A
    failure is said and serving starts without it."""
    n = num_tokens
    try:
        warm_up_s = measure_prefill(n, 0)
    except Exception as e:  # noqa: BLE001 - a warm-up must never stop the server starting
        fallbacks.take(
            "prefill warm-up",
            e,
            "the first long prompt pays its first-use costs",
            log,
            failed=f"the {n}-token prefill warm-up failed",
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    log.info("prefill warm-up: %d tokens in %.3f s", n, warm_up_s)
    t0 = time.perf_counter()
    try:
        for items, keep_kv in forms():
            measure_prefill_batch(items, keep_kv=keep_kv)
    except Exception as e:  # noqa: BLE001 - as above
        fallbacks.take(
            "step forms warm-up",
            e,
            "the first such steps pay their first-use costs",
            log,
            failed="warming up the first chunked steps' forms failed",
        )
        return warm_up_s
    log.info("warm-up of the first steps' forms: %.3f s", time.perf_counter() - t0)
    return warm_up_s


def warm_up_forms(
    config: EngineConfig, block_manager: BlockManager, max_model_len: int
) -> list[WarmUpForm]:
    """The forms of forward a chat's first chunked steps take, as (uncached, cached) items
    and whether their KV is kept: each one's first run through the serving path pays
    one-time host costs (a Triton variant of the RoPE + K/V write compiled) on the engine
    thread, with the decodes beside it waiting. (FlashInfer's kernels and wrappers are the
    runner's attention warm-up's: `ModelRunner.warm_up_attention`.) On the H200 (3B,
    bf68d3a) a fresh engine's first chunk next to eight chats took 164 ms for a 25-ms target
    and an 11-token chunk beside them 300 ms (tests/gpu/test_auto_chunked_gpu.py). Odd sizes
    on purpose; the start-up graph capture runs only bucket sizes."""
    budget = config.prefill_token_budget
    eager = config.prefill_graph_max_tokens + 77
    forms: list[WarmUpForm] = [
        ([(19, 0)], False),  # a short forward: RoPE one program a token
        # Mostly one-token rows (decodes) beside a short part: the FA2 kernels, on a
        # gathered context (a scoring suffix discarded) and on a paged one (a merged step)
        ([(1, 64)] * 8 + [(19, 0)], False),
        ([(1, 64)] * 8 + [(19, 0)], True),
        ([(333, 1499)], True),  # a later chunk: paged, RoPE tiled
        ([(eager, 0)], True),  # a first chunk past the graphs' largest bucket: eager
    ]
    # Within the step budget, the model's length and the pool (a small engine skips some).
    bm = block_manager

    def fits(items: list[tuple[int, int]], keep: bool) -> bool:
        blocks = sum(bm.num_blocks_for(c + n if keep else c) for n, c in items)
        return (
            sum(n for n, _ in items) <= budget
            and all(n + c <= max_model_len for n, c in items)
            and blocks <= bm.num_free_blocks
        )

    return [(items, keep) for items, keep in forms if fits(items, keep)]


# ---- measured prefills ----------------------------------------------------------------------
def served_keeps_kv(
    block_manager: BlockManager, items: list[tuple[int, int]], share_context: bool = False
) -> bool:
    """Whether served scoring requests of these (uncached, cached) shapes would keep their
    new tokens' KV: the scheduler keeps a scoring prompt's whole KV when the pool has the
    blocks for it now (runtime/scheduler.py, `_admit`), and only then does a request with
    cached context run on the paged attention path; a discarded suffix after a context
    is attended from a copy of the context made in every layer (the FlashInfer backend's
    "gather" path). Here: the pool is free now (nothing is served before `start()`).
    The scheduler keeps what fits block by block; a partial keep takes the gathered path
    as no keep does, which is what this answers for it."""
    bm = block_manager
    if share_context:
        need = bm.num_blocks_for(items[0][1]) + sum(bm.num_blocks_for(n) for n, _ in items)
    else:
        need = sum(bm.num_blocks_for(n + c) for n, c in items)
    return need <= bm.num_free_blocks


def measure_prefill_batch(
    runner: ModelRunner,
    block_manager: BlockManager,
    stream_device: Any,
    device: torch.device,
    items: list[tuple[int, int]],
    *,
    keep_kv: bool | None = None,
    share_context: bool = False,
    device_s_out: list[float] | None = None,
) -> float:
    """Seconds of one real prefill step over several sequences, (uncached, cached) tokens
    each (the JCT profiles: runtime/calibrate.py, bench/prefill_profile.py), launched on
    `runner` over blocks borrowed from `block_manager` (freed after) and timed on
    `stream_device`'s events. The engine thread must not be running. The contexts' KV values
    are whatever the pool holds, which does not change the timing.

    `keep_kv`: True, the new tokens' KV is written to the pool (blocks for it too) and a
    step with context takes the paged attention path; False, it is discarded (only the
    contexts need blocks) and a step with context attends a per-layer copy of it (the
    gathered path); None (the default), as a served scoring request of that shape would:
    kept when the pool holds it (`served_keeps_kv`). Until 2026-12-05 the default was
    False, so every profile point with cached context was priced on the gathered path,
    which served steps take only when the pool is too full to keep a suffix.
    `share_context`: every member reads one context's blocks, as one user's requests
    share a profile (equal cached lengths; with `keep_kv`, whole blocks of it, since each
    member writes its own new tokens after it, as after a prefix-cache hit).
    `device_s_out`: the step's device span is appended to it (events around the launch,
    as the serial executor times a served step), beside the wall time returned."""
    bm = block_manager
    if share_context and len({c for _, c in items}) > 1:
        raise ValueError("share_context needs equal cached lengths")
    if keep_kv is None:
        keep_kv = served_keeps_kv(bm, items, share_context)
    if share_context and keep_kv and items[0][1] % bm.block_size:
        raise ValueError(
            f"share_context with keep_kv needs a context of whole blocks "
            f"({items[0][1]} tokens, blocks of {bm.block_size}): members write after it"
        )
    ctx_key = "__measure_prefill_context__"
    keys: list[str] = []
    try:
        ctx_blocks: list[int] = []
        if share_context:
            ctx_blocks = bm.allocate(ctx_key, bm.num_blocks_for(items[0][1]))
            keys.append(ctx_key)
        seqs = []
        for i, (uncached, cached) in enumerate(items):
            key = f"__measure_prefill_{i}__"
            kept = cached + uncached if keep_kv else cached
            if share_context and not keep_kv:
                blocks = ctx_blocks  # nothing written: the members read the one context
            elif share_context:
                blocks = bm.allocate(key, bm.num_blocks_for(uncached), ctx_blocks)
                keys.append(key)
            else:
                blocks = bm.allocate(key, bm.num_blocks_for(kept))
                keys.append(key)
            req = Request(key, RequestKind.SCORE, [0] * (cached + uncached), label_token_ids=[0])
            seqs.append(
                ScheduledSeq(
                    request=req,
                    lease=Lease(req, key, -1),
                    num_context_tokens=cached,
                    num_new_tokens=uncached,
                    num_kept_tokens=kept,
                    block_ids=list(blocks),
                    input_ids=[0] * uncached,
                    needs_output=True,
                )
            )
        plan = StepPlan(step_id=-1, prefill=seqs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, end = stream_device.event(), stream_device.event()
        t0 = time.perf_counter()
        start.record()
        pending = runner.launch(plan)
        end.record()
        pending.result()  # waits for the outputs
        wall_s = time.perf_counter() - t0
        if device_s_out is not None:
            end.synchronize()
            device_s_out.append(start.elapsed_time(end) / 1e3)
        return wall_s
    finally:
        for key in reversed(keys):  # the members before the context they share
            bm.free(key)
