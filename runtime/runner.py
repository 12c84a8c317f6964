"""`ModelRunner.launch(plan) -> PendingOutput`: tensors in, tokens and label probabilities out,
without waiting for the device (`run(plan)` waits).

A step's prefill part and decode part are separate forward calls, each with its own
`ForwardBatch` and attention backend instance. That is the seam for running them on two CUDA
streams (prefill on one SM partition, decode on the other); on CPU the two calls simply run
one after the other.

GPU runtime (when the given backend is FlashInfer):
- `runtime.model.ops.use_flashinfer(True)`: norms, SiLU-and-mul and RoPE use FlashInfer kernels;
- a second FlashInfer instance (its own workspace) serves decode unless one is passed, so the
  prefill and decode parts may run concurrently on two streams;
- with `config.cuda_graphs`, decode batches of up to `max_batch_size` sequences replay a
  captured CUDA graph (padded to the next captured size; the pad rows use the KV pool's
  reserved pad block, outside the block manager's range). Graphs keep the SM partition of the
  stream they were captured on, so they are kept per decode stream (`graph_registry`):
  `decode_graphs`, captured at start-up on the ordinary `decode_stream` (all SMs), serves
  every ordinary stream; a split's green decode stream gets its own set, captured on that
  stream the first time it decodes there (`ensure_split_graphs`, the PD loop calls it) or
  up front (`capture_for_streams`). A decode step picks the set of the current stream.
Public pieces for a caller that drives the parts itself (e.g. on green-context streams):
`build_batch`, `forward_part(seqs, is_decode, backend) -> (hidden, wanting)`,
`outputs_from_hidden`, `decode_graphs`, `graph_registry`, `prefill_backend`, `decode_backend`.
Sampling and label scoring stay on the device. A sampled token is written to its request's row
of the device token table (`token_slots`), where the request's next decode step reads its input:
the host may plan and launch that step before it has seen the token (overlapped scheduling).
Everything the host needs is copied to pinned memory once per part, behind an event.

A serving launch (`launch(plan, interruptible=True)`) asks `interrupt(plan)` before each layer
of an eager prefill forward and stops with `ForwardInterrupted` when it says so (the engine:
every request of the step is being aborted, or shutdown's grace is over).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from runtime.attention.base import (
    AttentionBackend,
    ForwardBatch,
    SeqSlice,
    load_rope_kv_write,
)
from runtime.config import EngineConfig
from runtime.diagnostics import fallbacks
from runtime.graphs.decode import (
    SPLIT_BATCH_SIZES,
    DecodeGraphRegistry,
    GraphSet,
    Progress,
    graph_batch_sizes,
)
from runtime.graphs.prefill import PrefillGraphs, prefill_graph_max_tokens, prefill_graph_sizes
from runtime.kv.kv_pool import KVPool
from runtime.model import ops
from runtime.model.config import ModelConfig
from runtime.model.llama import LlamaForCausalLM
from runtime.model.ops import h2d
from runtime.request import Request, RequestKind, TokenLogprob
from runtime.sampling.sampler import PenaltyState, Sampler, has_penalties, make_generator
from runtime.sampling.structured import GrammarMasks
from runtime.scheduler import RunnerOutput, ScheduledSeq, StepPlan

log = logging.getLogger("greenlane.runner")

# Eager prefill forwards of at least this many tokens keep the host within a few layers of the
# device on CUDA (`ModelRunner._interrupt_for`), so an abort stops them soon. A shorter step
# ends within about a second on the H200 anyway (16k tokens of the 8B shape), and the gate's
# event per layer (a few us each) would cost a few percent of a step of 2-4k tokens.
INTERRUPT_GATE_MIN_TOKENS = 16_384


def use_ops_for(backend: AttentionBackend) -> bool:
    """Route the model's norms, SiLU-and-mul and RoPE through FlashInfer when the attention
    backend is FlashInfer's (the only place that decides it). True when it is."""
    fi = getattr(backend, "name", "") == "flashinfer"
    if fi:
        ops.use_flashinfer(True)
    return fi


class PeakMeter:
    """Bytes-allocated high-water mark of one device (CUDA: the caching allocator's stats).
    `profile_activation_peak` takes another meter in tests (CPU has no allocator stats)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"no allocator statistics on {device.type}; pass a meter")
        self.device = device

    def reset(self) -> int:
        """Start a measurement; returns the bytes allocated now (the baseline)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def profile_activation_peak(
    config: EngineConfig,
    model: LlamaForCausalLM,
    model_config: ModelConfig,
    num_tokens: int,
    make_backend: Callable[[KVPool], AttentionBackend],
    *,
    meter: PeakMeter | None = None,
    num_seqs: int = 1,
) -> int:
    """Measured activation peak, in bytes, of one step: a dry-run prefill of `num_tokens`
    tokens through the real model (hybrid prefill as configured), plus the fp32 logits and
    log-softmax of `max_num_seqs` rows (the widest sampling step). Call it after the weights
    are on the device and BEFORE the KV pool exists: it builds a one-block pool of its own and
    discards every token's K/V (num_kept_tokens = 0), so the step's K/V live in the per-layer
    scratch exactly as for a kept prompt's ragged prefill (pool writes allocate nothing).
    The result is what `compute_num_blocks(activation_bytes=...)` takes. It excludes the
    attention workspaces (allocated before the measurement starts). `num_seqs`: the tokens
    split over that many sequences (several take hybrid prefill's whole-T attention path,
    whose peak per token is the higher; one long prompt streams rows)."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    meter = meter or PeakMeter(dev)
    if num_tokens < 1:
        raise ValueError("num_tokens must be >= 1")
    # Positions beyond the model's limit would index past the RoPE table.
    num_tokens = min(num_tokens, model.rotary.max_positions)
    pool = KVPool.for_model(model_config, 1, config.block_size, dtype, dev, num_reserved_blocks=0)
    backend = make_backend(pool)
    # Measure the ops that will serve: before this the dry run took the torch paths (fp32
    # norms, RoPE), whose temporaries made the reserve 44.5 KiB a token on the 8B shape.
    use_ops_for(backend)
    ids = torch.randint(0, model_config.vocab_size, (num_tokens,), device=dev)
    num_seqs = max(1, min(num_seqs, num_tokens))
    spans = [
        (i * num_tokens // num_seqs, (i + 1) * num_tokens // num_seqs) for i in range(num_seqs)
    ]
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.cat([torch.arange(b - a) for a, b in spans]).to(dev),
        seqs=[SeqSlice(a, b - a, 0, 0, []) for a, b in spans],  # nothing kept: no pool blocks
        logits_indices=torch.tensor([b - 1 for _, b in spans], device=dev),
        is_decode=False,
    )
    chunk, stream_rows_above = config.hybrid_form()  # as the engine runs it
    rows = min(config.max_num_seqs, num_tokens)
    base = meter.reset()
    with torch.inference_mode():
        backend.plan(batch)
        hidden = model(
            batch.input_ids,
            batch.positions,
            backend,
            chunk_tokens=chunk,
            stream_rows_above=stream_rows_above,
        )
        # Sampling-sized LM head: [rows, vocab] fp32 logits and their log-softmax.
        logits = model.compute_logits(hidden[:rows])
        lp = logits.log_softmax(dim=-1)
        del hidden, logits, lp
    peak = meter.peak()
    del backend, pool, batch, ids
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return max(0, peak - base)


# With hybrid prefill a prompt's activation peak is the larger of two lines in its length T:
# at attention, the [T, ...] hidden/residual/q/k/v buffers (steep); in the chunked MLP, the
# hidden/residual buffers plus C rows of MLP temporaries (flatter, but with a constant of about
# C * (3 * intermediate + 2 * hidden) elements). Below the crossing, about 13 * C for the
# presets (Qwen2.5-3B's few KV heads put it highest), the flat line is the peak, and a slope
# measured there under-reserves longer prompts. So the slope is measured at and above 16 * C.
SLOPE_FROM_CHUNKS = 16


def activation_probe_lengths(
    step_tokens: int, chunk_tokens: int | None, longest_score_tokens: int
) -> tuple[int, int, int]:
    """(the tokens of the widest step, and two lengths to measure the per-token slope
    between). `step_tokens`: the prefill budget, at most max_model_len (a generation prompt is
    cut to it). The two lengths are at most `longest_score_tokens` (only a scoring prompt runs
    whole: a longer dry run measures nothing the engine will run). Without hybrid prefill the
    peak is one line, and the two are the step's tokens and twice that."""
    n0 = max(1, step_tokens)
    lo = n0 if chunk_tokens is None else max(n0, SLOPE_FROM_CHUNKS * chunk_tokens)
    lo = min(lo, longest_score_tokens)
    hi = min(2 * lo, longest_score_tokens)
    if hi <= lo:  # the longest prompt is short: measure below it
        lo = max(1, hi // 2)
    return n0, lo, max(hi, lo + 1)


@dataclasses.dataclass(frozen=True, slots=True)
class ActivationLine:
    """What the start-up dry runs measured (`activation_line`): `step_peak` bytes for a
    `step_tokens` step, and the chord `fixed + slope * n` through the peaks at `lo` and a longer
    length. The peak is convex in the prompt's tokens (the larger of two linear phases), so a
    chord lies above it between its ends and, once the steeper phase leads, its extension
    beyond: `reserve` is an upper bound on any prompt's peak, never below one step's."""

    step_tokens: int
    step_peak: float
    lo: int
    slope: float
    fixed: float

    @property
    def peak_lo(self) -> float:
        return self.fixed + self.slope * self.lo

    def reserve(self, num_tokens: int) -> float:
        """Bytes to keep free for a prompt of up to `num_tokens` (whole, hybrid prefill)."""
        if num_tokens >= self.lo:
            bound = self.fixed + self.slope * num_tokens
        elif num_tokens <= self.step_tokens:
            bound = self.step_peak
        else:  # between the step and lo: the chord between those two measured peaks
            frac = (num_tokens - self.step_tokens) / (self.lo - self.step_tokens)
            bound = self.step_peak + frac * (self.peak_lo - self.step_peak)
        return max(self.step_peak, bound)

    def longest_within(self, num_bytes: float) -> int:
        """The most prompt tokens whose `reserve` fits in `num_bytes` (0 when not even one
        step's peak does)."""
        if num_bytes < self.step_peak:
            return 0
        if self.lo > self.step_tokens and num_bytes < self.peak_lo:
            rise = self.peak_lo - self.step_peak
            frac = (num_bytes - self.step_peak) / rise if rise > 0 else 1.0
            return int(self.step_tokens + frac * (self.lo - self.step_tokens))
        if self.slope <= 0:
            return 1 << 62
        return max(int((num_bytes - self.fixed) // self.slope), self.step_tokens)


def activation_line(
    peak_at: Callable[[int], int], budget_tokens: int, lo: int, hi: int
) -> ActivationLine:
    """From dry runs: the peak of a `budget_tokens` step and the line through the peaks at `lo`
    and `hi` tokens (its slope: the bytes a prompt token adds; its bytes at 0 tokens). A prompt
    of N >= lo tokens needs at most `fixed + slope * N` (the peak is convex in N: the chord
    lies above it between the two, and its extension beyond once the steepest phase leads at
    lo), one of fewer the peak at lo (the peak only grows with N)."""
    p0 = peak_at(budget_tokens)
    p_lo = p0 if lo == budget_tokens else peak_at(lo)
    p_hi = peak_at(hi)
    slope = max(0.0, (p_hi - p_lo) / (hi - lo))
    fixed = max(0.0, p_hi - slope * hi)
    return ActivationLine(budget_tokens, p0, lo, slope, fixed)


class OutOfMemoryForStep(RuntimeError):
    """A step ran out of device memory; the message says how big it was."""


class PendingOutput:
    """A launched step's outputs on their way to the host.

    The runner adds device tensors (sampled ids, logprobs, label probabilities, prompt
    logprobs); `seal()` starts one non-blocking copy of each into pinned host memory and
    records an event on the current stream. `ready()` polls it, `result()` waits for it and
    builds the `RunnerOutput`. On CPU everything is already on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[tuple[str, Any, list[torch.Tensor]]] = []
        self._event: Any = None
        self._result: RunnerOutput | None = None
        self.grammar_ids: list[str] = []  # requests under a grammar sampled in this step

    def add(self, kind: str, meta: Any, *tensors: torch.Tensor | None) -> None:
        self._parts.append((kind, meta, [t for t in tensors if t is not None]))

    def seal(self) -> PendingOutput:
        if self.device.type == "cuda":
            for _, _, tensors in self._parts:
                for i, t in enumerate(tensors):
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    tensors[i] = host
            self._event = torch.cuda.Event()
            self._event.record()
        return self

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> RunnerOutput:
        if self._result is None:
            self.wait()
            self._result = _build_output(self._parts)
            self._parts = []
        return self._result


def _build_output(parts: list[tuple[str, Any, list[torch.Tensor]]]) -> RunnerOutput:
    out = RunnerOutput()
    for kind, meta, tensors in parts:
        if kind == "sample":
            rids, want = meta
            tokens = tensors[0].tolist()
            chosen = tensors[1].tolist() if len(tensors) > 1 else None
            top_v = tensors[2].tolist() if len(tensors) > 3 else None
            top_i = tensors[3].tolist() if len(tensors) > 3 else None
            for i, rid in enumerate(rids):
                out.sampled_token_ids[rid] = tokens[i]
                k = want[i]
                if k is None or chosen is None:
                    continue
                top = list(zip(top_i[i][:k], top_v[i][:k], strict=True)) if k and top_i else []
                out.logprobs[rid] = TokenLogprob(tokens[i], chosen[i], top)
        elif kind == "score":
            rids, counts = meta
            flat = tensors[0].tolist()
            pos = 0
            for rid, n in zip(rids, counts, strict=True):
                out.label_probs[rid] = flat[pos : pos + n]
                pos += n
        elif kind == "prompt":
            rid, targets, k = meta
            chosen = tensors[0].tolist()
            top_v = tensors[1].tolist() if k else None
            top_i = tensors[2].tolist() if k else None
            out.prompt_logprobs[rid] = [
                TokenLogprob(
                    t,
                    chosen[i],
                    list(zip(top_i[i], top_v[i], strict=True)) if top_i and top_v else [],
                )
                for i, t in enumerate(targets)
            ]
    return out


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        kv_pool: KVPool,
        backend: AttentionBackend,
        decode_backend: AttentionBackend | None = None,
        *,
        decode_stream: torch.cuda.Stream | None = None,
        max_model_len: int | None = None,
        capture_graphs: bool = True,
        num_sampleable_tokens: int | None = None,
        split_graph_batch_sizes: tuple[int, ...] | None = None,
        num_token_slots: int | None = None,
    ) -> None:
        """max_model_len sizes the graphs' per-sequence block tables (default: the model's
        position limit). capture_graphs=False builds the graphs object without capturing
        (call `decode_graphs.capture()` later, e.g. on another stream).
        split_graph_batch_sizes: the batch sizes captured per split decode stream (default
        `SPLIT_BATCH_SIZES`, cut at max_num_seqs, plus max_num_seqs itself).
        num_token_slots: rows of the device token table (the scheduler's `SlotPool` size)."""
        self.config = config
        # Why steps that mix prefill with decodes stopped running as one forward (None: they
        # merge as `config.merge_mixed_steps` says). Set by `stop_merging`.
        self.merge_off_reason: str | None = None
        # Whether an interruptible launch should stop (the engine sets it); `_launching` is the
        # plan of the interruptible launch under way (None outside one).
        self.interrupt: Callable[[StepPlan], bool] | None = None
        self._launching: StepPlan | None = None
        # Where the interruptible forward under way is: the layer it is about to run and its
        # tokens (None outside one). Written per layer, read by other threads (progress).
        self.forward_layer: int | None = None
        self.forward_tokens = 0
        self.model = model
        # Sampling only picks ids the tokenizer can decode: a model whose embedding table is
        # padded past the tokenizer (random:<preset> models with the SmolLM2 tokenizer,
        # Qwen's padded vocab) would otherwise emit ids that decode to nothing.
        vocab = model_config.vocab_size
        self.num_sampleable_tokens = min(num_sampleable_tokens or vocab, vocab)
        self.model_config = model_config
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        # The device token table: row `slot` holds the last token sampled for the request
        # leasing that slot, which its next decode step reads (overlapped scheduling: the
        # host learns the token one step later).
        slots = num_token_slots or 2 * config.max_num_seqs + 2
        self.token_slots = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.penalties = PenaltyState(self.num_sampleable_tokens, self.device)
        # Structured outputs' matchers (runtime/sampling/structured.py), set by the engine: None
        # means a runner without a tokenizer (tests), where a request with a grammar fails its step.
        self.grammars: GrammarMasks | None = None
        # Per constrained request: the launched step whose output holds its latest sample. A
        # request may be planned with that sample still in flight (overlapped scheduling);
        # its mask then waits here for that one token (`_grammar_masks`).
        self._grammar_pending: dict[str, PendingOutput] = {}
        self.prefill_backend = backend
        self.uses_flashinfer = use_ops_for(backend)
        # The decode backend and graphs fuse RoPE + the K/V write when the prefill one does
        # (make_attention_backend decided: CUDA, the setting, an even head_dim).
        fuse_rope = bool(getattr(backend, "fuses_rope", False))
        if self.uses_flashinfer:
            if decode_backend is None:
                # Own workspace: the decode part may run concurrently with the prefill part.
                decode_backend = type(backend).from_pool(  # type: ignore[attr-defined]
                    kv_pool,
                    model_config.num_q_heads,
                    fuse_rope_kv_write=fuse_rope,
                )
        self.decode_backend = decode_backend if decode_backend is not None else backend
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}  # seeded requests only
        # Hazard: FlashInfer plans and the fused decode fill *persistent* pinned host buffers
        # and copy them to the device asynchronously. Under overlapped scheduling the next
        # step is planned while the previous one may not have consumed its copy yet, so each
        # planner waits for the event recorded after its previous copies (`_guard_staging`).
        self._staging_events: dict[int, Any] = {}
        # Host seconds spent waiting for the device inside launches since start (`_wait_for`):
        # these staging waits and a gated prefill's (`_interrupt_for`). The engine's trace reads the
        # difference over a launch (`launch_wait_ms`).
        self.device_wait_s = 0.0
        self.decode_graphs = None  # the whole-GPU set (ordinary streams)
        self.prefill_graphs: PrefillGraphs | None = None  # piecewise, whole GPU
        self.graph_registry: DecodeGraphRegistry | None = None  # every set, by stream
        self.decode_stream = decode_stream
        graphs_ok = self.uses_flashinfer and kv_pool.pad_block_id is not None
        if config.cuda_graphs and self.device.type == "cuda" and graphs_ok:
            from runtime.graphs.decode import DecodeGraphs

            limit = max_model_len or model_config.max_position_embeddings
            bs = kv_pool.block_size
            if self.decode_stream is None:
                self.decode_stream = torch.cuda.Stream(self.device)
            # All sets share one graph memory pool and one FlashInfer float workspace: decode
            # steps of different sets never replay concurrently (one decode stream at a time,
            # and a new decode stream is ordered after the previous one).
            pool = torch.cuda.graph_pool_handle()
            max_blocks = min((limit + bs - 1) // bs, kv_pool.num_blocks)
            fused = self._fused_decode_max_batch(config, model_config, kv_pool)
            whole = DecodeGraphs(
                model,
                kv_pool.k,
                kv_pool.v,
                self.decode_stream,
                pad_block_id=kv_pool.pad_block_id,
                max_blocks_per_seq=max_blocks,
                batch_sizes=graph_batch_sizes(config.max_num_seqs),
                pool=pool,
                fused_max_batch=fused,
                fuse_rope_kv_write=fuse_rope,
                kv_split=config.decode_kv_split,
            )
            split_sizes = graph_batch_sizes(
                config.max_num_seqs, split_graph_batch_sizes or SPLIT_BATCH_SIZES
            )

            def make_split_set(stream: torch.cuda.Stream, label: str) -> GraphSet:
                return DecodeGraphs(
                    model,
                    kv_pool.k,
                    kv_pool.v,
                    stream,
                    pad_block_id=kv_pool.pad_block_id,
                    max_blocks_per_seq=max_blocks,
                    batch_sizes=split_sizes,
                    workspace=whole.workspace,
                    pool=pool,
                    label=label,
                    fused_max_batch=fused,
                    fuse_rope_kv_write=fuse_rope,
                    kv_split=config.decode_kv_split,
                )

            self.decode_graphs = whole
            self.graph_registry = DecodeGraphRegistry(make_split_set, whole)
            if capture_graphs:
                whole.capture()
            sizes = prefill_graph_sizes(
                prefill_graph_max_tokens(config), config.prefill_graph_padding
            )
            if sizes:
                # With the fused RoPE + K/V write, the graphs may run it themselves (captured),
                # so that attention alone runs between replays (one Python launch a layer
                # fewer; `prefill_graphs_write_kv`).
                kv_write = None
                write = None
                # (the kernel takes a float32 RoPE cache, as attention's fused path checks)
                f32_rope = model.rotary.cos_sin_cache.dtype == torch.float32
                if config.prefill_graphs_write_kv != "false" and f32_rope:
                    write = load_rope_kv_write(fuse_rope, self.device, model_config.head_dim)
                if write is not None:
                    layers = range(model_config.num_layers)
                    kv_write = (
                        write,
                        [kv_pool.flat_k(i) for i in layers],
                        [kv_pool.flat_v(i) for i in layers],
                    )
                # Their own pool: their intermediates must not alias a decode graph's.
                self.prefill_graphs = PrefillGraphs(
                    model,
                    self.device,
                    kv_pool.dtype,
                    sizes,
                    stream=self.decode_stream,
                    rotate_in_attention=fuse_rope,
                    kv_write=kv_write,
                )
                if capture_graphs:
                    self.capture_prefill_graphs()
        elif config.cuda_graphs and self.device.type == "cuda":
            log.warning(
                "CUDA graphs need the FlashInfer backend and a pool with a pad block; "
                "decoding eagerly"
            )
        pg = self.prefill_graphs
        if config.prefill_graphs_write_kv == "true" and (pg is None or pg.kv_write is None):
            log.warning(
                "prefill_graphs_write_kv has no effect here: it needs the prefill graphs (CUDA, "
                "FlashInfer) and the fused RoPE + K/V write (a float32 RoPE cache)"
            )
        if self.uses_flashinfer:
            self.warm_up_attention()

    @staticmethod
    def _fused_decode_max_batch(
        config: EngineConfig, model_config: ModelConfig, kv_pool: KVPool
    ) -> int:
        """config.fused_decode_max_batch, or 0 (said once) where the fused kernels cannot
        run this model."""
        if config.fused_decode_max_batch == 0:
            return 0
        from runtime.model.fused_decode import unsupported_reason

        why = unsupported_reason(model_config, kv_pool.dtype)
        if why:
            log.warning("fused small-batch decode off: %s; FlashInfer + cuBLAS decode it", why)
            return 0
        return config.fused_decode_max_batch

    def warm_up_attention(self) -> None:
        """Compile and load FlashInfer's attention kernels now, before the first request
        (FlashInferBackend.warm_up). Dummy k/v go to the pad block, which only pad rows read;
        without one (no graphs), to block 0, which no request holds yet. A failure is said and
        the kernels load at their first use instead."""
        warm_up = getattr(self.prefill_backend, "warm_up", None)
        if warm_up is None:
            return
        pad = self.kv_pool.pad_block_id
        t0 = time.perf_counter()
        try:
            modes = warm_up(pad if pad is not None else 0)
        except Exception as e:  # noqa: BLE001 - the kernels then load at their first use
            fallbacks.take(
                "attention warm-up",
                e,
                "FlashInfer's kernels compile or load inside the first requests' steps",
                log,
            )
            return
        log.info("attention kernels ready in %.2f s (%s)", time.perf_counter() - t0, modes)

    def capture_prefill_graphs(self) -> None:
        """Capture the piecewise prefill graphs; a failure (e.g. out of memory) is said once
        and prefill parts run eagerly."""
        pg = self.prefill_graphs
        if pg is None:
            return
        try:
            pg.capture()
        except Exception as e:  # noqa: BLE001 - any failure: prefill runs eagerly, said once
            fallbacks.take(
                "prefill graphs",
                e,
                "prefill parts run eagerly",
                log,
                failed="prefill graphs could not be captured",
            )
            self.prefill_graphs = None
            torch.cuda.empty_cache()
            return
        log.info(
            "prefill graphs captured in %.2f s: %d token buckets up to %d, %.0f MiB%s",
            pg.capture_s,
            len(pg.token_sizes),
            pg.max_tokens,
            pg.memory_bytes / 2**20,
            f" ({len(pg.dropped)} slower than a larger one dropped)" if pg.dropped else "",
        )

    # ---- decode graphs per stream -----------------------------------------------------------
    def ensure_split_graphs(self, stream: Any, label: str) -> None:
        """`stream` is a split's (green) decode stream: capture its decode graphs now unless
        already done (the split executor calls this before the step's timing events, so a
        capture is not measured as a decode step). No-op without CUDA graphs."""
        if self.graph_registry is not None:
            self.graph_registry.register(stream, label)
            self.graph_registry.for_stream(stream)

    def capture_for_streams(
        self, streams: dict[str, Any], progress: Progress | None = None
    ) -> None:
        """Capture the decode graphs of these split decode streams ({label: stream}) up front,
        e.g. every pre-created split at engine start-up. No-op without CUDA graphs."""
        if self.graph_registry is not None:
            self.graph_registry.capture_for_streams(streams, progress)

    def current_decode_graphs(self) -> GraphSet | None:
        """The graph set for a decode step on the current stream (None: decode eagerly)."""
        reg = self.graph_registry
        if reg is None:
            return None
        return reg.for_stream(reg.current_stream())

    def release(self, request_id: str) -> None:
        """Forget per-request state (seeded generator, penalty row). Call only once no
        launched step uses the request any more (its lease was freed)."""
        self._generators.pop(request_id, None)
        self.penalties.free(request_id)
        self._grammar_pending.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    # ---- steps ------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, plan: StepPlan, interruptible: bool = False) -> PendingOutput:
        """Enqueue a step (prefill part, then decode part) on the current stream without
        waiting for the device; the outputs arrive through the returned `PendingOutput`.
        `interruptible`: an eager prefill forward may stop with `ForwardInterrupted` between
        layers (module docstring); nothing of the step is then in flight."""
        pending = PendingOutput(self.device)
        self._launching = plan if interruptible else None
        try:
            if plan.prefill and plan.decode and self._mergeable(plan.prefill, len(plan.decode)):
                self._run_merged(plan.prefill, plan.decode, pending)
            else:
                if plan.prefill:
                    self._run_part(plan.prefill, False, self.prefill_backend, pending)
                if plan.decode:
                    self._run_part(plan.decode, True, self.decode_backend, pending)
        except torch.cuda.OutOfMemoryError as e:
            # Free what the failed step cached so the next step starts clean; the engine
            # fails only the request(s) at fault (it re-runs a batch one request at a time).
            torch.cuda.empty_cache()
            raise OutOfMemoryForStep(describe_oom(plan)) from e
        finally:
            self._launching = None
            self.forward_layer = None
        pending.seal()
        self.track_grammar_samples(pending)
        return pending

    def track_grammar_samples(self, pending: PendingOutput) -> None:
        """Remember a sealed step as the one holding its constrained requests' latest samples
        (a later mask may wait for one). Only a launch that went through: a failed one's
        samples are never used."""
        for rid in pending.grammar_ids:
            self._grammar_pending[rid] = pending

    def run(self, plan: StepPlan) -> RunnerOutput:
        """One step, waited for (calibration, tests, re-runs of a failed batch)."""
        return self.launch(plan).result()

    # ---- a step's two parts as one forward -------------------------------------------------
    def merges(self, plan: StepPlan) -> bool:
        """Whether `launch` runs this plan's prefill parts and decodes as one forward."""
        return bool(plan.prefill and plan.decode) and self._mergeable(
            plan.prefill, len(plan.decode)
        )

    def stop_merging(self, reason: str) -> None:
        """Run steps that mix prefill with decodes as separate forwards from now on (the
        engine's fallback when merged steps keep failing while their requests run fine
        alone: a kernel that breaks on merged batches only). Said once."""
        if self.merge_off_reason is None:
            self.merge_off_reason = reason
            fallbacks.take(
                "merged steps",
                reason,
                "steps that mix prefill with decodes run as separate forwards from now on (slower)",
                log,
                failed="merged steps keep failing",
            )

    def _mergeable(self, prefill: list[ScheduledSeq], num_decodes: int) -> bool:
        """Whether a step's prefill parts and its `num_decodes` decodes run as one forward
        (`merge_mixed_steps`). Not when a prefill part discards its suffix KV (a scoring
        request: the pool-only attention of a batch with decodes cannot read it). On CUDA only
        when the merged rows fit a captured prefill graph's bucket: the decode rows would
        otherwise leave their graph for an eager forward, host-launch-bound (plan z). Merged
        eagerly past the buckets (3B, 48 decodes, H100, `844423b`) a 2-4k chunk's step was no
        faster at no context (-0.9 to +1.3 ms) and 2-8 ms slower after 8-16k tokens of it:
        the chunk's attention moves from the ragged kernel to the paged one, and the decode
        rows leave the fused decode's kernels (bench/results/mixed-step-2026-12-07-844423b)."""
        if not self.config.merge_mixed_steps or self.merge_off_reason is not None:
            return False
        if any(s.num_kept_tokens != s.num_context_tokens + s.num_new_tokens for s in prefill):
            return False
        if self.device.type != "cuda":
            return True  # no graphs to leave: both ways run eagerly
        pg = self.prefill_graphs
        num_tokens = sum(s.num_new_tokens for s in prefill) + num_decodes
        return pg is not None and pg.captured and pg.bucket_for(num_tokens) is not None

    def _run_merged(
        self, prefill: list[ScheduledSeq], decode: list[ScheduledSeq], pending: PendingOutput
    ) -> None:
        """Prefill parts and decodes in one forward on the prefill backend: the weights are
        read once a step instead of twice (the prefill part's forward, then the decode graph);
        the decode rows ride in the prefill graphs' bucket."""
        batch = self.build_batch(prefill, decode)
        backend = self.prefill_backend
        self.plan_attention(backend, batch)
        hidden = self._prefill_forward(batch, backend)
        head = dataclasses.replace(batch, seqs=batch.seqs[: len(prefill)])
        self.prompt_logprobs(hidden, head, prefill, pending)
        wanting = [s for s in (*prefill, *decode) if s.needs_output]
        if wanting:
            self.outputs_from_hidden(hidden[batch.logits_indices], wanting, pending)

    # ---- one forward ----------------------------------------------------------------------
    def _prefill_forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """The final hidden states of a planned non-decode batch: the prefill graphs' bucket
        when one fits, else the model eagerly (hybrid-chunked when long)."""
        pg = self.prefill_graphs
        if pg is not None and pg.captured and pg.bucket_for(batch.num_tokens):
            # A prefill part here runs on the whole GPU (the split executor's partitioned
            # prefill runs the layers itself), where these graphs belong.
            return pg.run(batch.input_ids, batch.positions, backend)
        chunk, stream_rows_above = self.config.hybrid_form()
        return self.model(
            batch.input_ids,
            batch.positions,
            backend,
            chunk_tokens=chunk,
            stream_rows_above=stream_rows_above,
            interrupt=self._interrupt_for(batch.num_tokens),
        )

    def _gates(self, num_tokens: int) -> bool:
        """Whether an eager forward of `num_tokens` keeps the host within two layers of the
        device (`_interrupt_for`)."""
        return self.device.type == "cuda" and num_tokens >= INTERRUPT_GATE_MIN_TOKENS

    def holds_host(self, plan: StepPlan) -> bool:
        """Whether launching `plan` (serial executor) returns only near the step's end: its
        prefill forward is gated (`_interrupt_for`), so the host trails the device by two
        layers. The engine answers the steps in flight before such a launch."""
        if self.interrupt is None or not plan.prefill:
            return False
        num_tokens = sum(s.num_new_tokens for s in plan.prefill)
        if plan.decode and self._mergeable(plan.prefill, len(plan.decode)):
            num_tokens += len(plan.decode)  # one forward, the decode rows included
        return self._gates(num_tokens)

    def _interrupt_for(self, num_tokens: int) -> Callable[[int], bool] | None:
        """What an eager prefill forward asks before each layer (None: not interruptible); it
        also keeps `forward_layer` (progress) current."""
        ask, plan = self.interrupt, self._launching
        if ask is None or plan is None:
            return None
        self.forward_tokens = num_tokens
        if not self._gates(num_tokens):

            def ask_at(layer: int) -> bool:
                self.forward_layer = layer
                return ask(plan)

            return ask_at
        # A long prompt on CUDA (seconds to tens of seconds): the host would enqueue
        # layers as far ahead as the launch queue lets it, so an answer between layers would
        # say little about what the device still has to run. Keep the host within about two
        # layers of the device: before enqueueing layer i, wait for the end of layer i - 3
        # (the event recorded before layer i - 2). The device still has layers i - 2 and
        # i - 1 queued then, so it does not idle for this while a layer outlasts its launch.
        ends: deque[torch.cuda.Event] = deque()

        def ask_in_step(layer: int) -> bool:
            end = torch.cuda.Event(blocking=True)  # a waiting host yields its core
            end.record()
            ends.append(end)
            if len(ends) > 2:
                self._wait_for(ends.popleft())
            self.forward_layer = layer  # (the device is within two layers of it)
            return ask(plan)

        return ask_in_step

    def build_batch(self, prefill: list[ScheduledSeq], decodes: list[ScheduledSeq]) -> ForwardBatch:
        """Flatten the sequences' new tokens, prefill parts first, then decodes (both: a merged
        step; decodes only: a decode batch); logits rows = last row of each sequence whose
        step ends its pending tokens (it needs a sampled token or label scores). A decode's
        input token is read on the device from its token slot."""
        input_ids: list[int] = []  # the prefill parts' token ids
        slot_rows: list[int] = []  # the decodes' token slots, after the prefill tokens
        positions: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        for s in prefill:
            slices.append(self._slice(s, len(input_ids)))
            input_ids.extend(s.input_ids)
            positions.extend(range(s.num_context_tokens, s.num_context_tokens + s.num_new_tokens))
            if s.needs_output:
                logits_rows.append(len(input_ids) - 1)
        P = len(input_ids)
        for s in decodes:
            slices.append(self._slice(s, P + len(slot_rows)))
            slot_rows.append(s.lease.slot)
            positions.append(s.num_context_tokens)
            if s.needs_output:
                logits_rows.append(P + len(slot_rows) - 1)
        # One host-to-device copy for all (from pinned memory on CUDA: asynchronous).
        T = P + len(slot_rows)
        flat = h2d(input_ids + slot_rows + positions + logits_rows, torch.int64, self.device)
        ids = flat[:T]
        if slot_rows:  # [D]: the previous steps' samples, read on the device
            from_slots = self.token_slots.index_select(0, flat[P:T])
            ids = from_slots if not P else torch.cat([flat[:P], from_slots])
        return ForwardBatch(
            input_ids=ids,
            positions=flat[T : 2 * T],
            seqs=slices,
            logits_indices=flat[2 * T :],
            is_decode=not prefill,
        )

    @staticmethod
    def _slice(s: ScheduledSeq, start: int) -> SeqSlice:
        return SeqSlice(
            query_start=start,
            num_query_tokens=s.num_new_tokens,
            num_context_tokens=s.num_context_tokens,
            num_kept_tokens=s.num_kept_tokens,
            block_ids=s.block_ids,
        )

    def _run_part(
        self,
        seqs: list[ScheduledSeq],
        is_decode: bool,
        backend: AttentionBackend,
        pending: PendingOutput,
    ) -> None:
        hidden, wanting = self.forward_part(seqs, is_decode, backend, pending)
        if wanting:
            self.outputs_from_hidden(hidden, wanting, pending)

    def plan_attention(self, backend: AttentionBackend, batch: ForwardBatch) -> None:
        """Plan `backend` for `batch` once its previous plan's staged copies are consumed
        (every planner of a backend the runner's steps use goes through here)."""
        self._guard_staging(backend)
        backend.plan(batch)
        self._mark_staging(backend)

    def _guard_staging(self, key: object) -> None:
        ev = self._staging_events.get(id(key))
        if ev is not None:
            self._wait_for(ev)

    def _wait_for(self, event: Any) -> None:
        """Block the host until `event` has fired, counted in `device_wait_s`."""
        t0 = time.perf_counter()
        event.synchronize()
        self.device_wait_s += time.perf_counter() - t0

    def _mark_staging(self, key: object) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._staging_events[id(key)] = ev

    def forward_part(
        self,
        seqs: list[ScheduledSeq],
        is_decode: bool,
        backend: AttentionBackend,
        pending: PendingOutput | None = None,
    ) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """One forward of a part (on the current stream). Returns the hidden states of the
        rows that need an output, [N, hidden], and those sequences (in order). Prompt
        logprobs asked by any prefill sequence go to `pending`."""
        # Pick (and, the first time on a split stream, capture) the graphs before building
        # the batch: capture synchronises the stream, and its warm-ups need no inputs.
        graphs = self.current_decode_graphs() if is_decode else None
        batch = self.build_batch([], seqs) if is_decode else self.build_batch(seqs, [])
        if graphs is not None and len(seqs) <= graphs.max_batch_size:
            self._guard_staging(graphs)
            hidden = graphs.run(batch)  # [n, hidden]: one row per sequence
            self._mark_staging(graphs)
            rows = [i for i, s in enumerate(seqs) if s.needs_output]
            if len(rows) != len(seqs):
                hidden = hidden.index_select(0, h2d(rows, torch.int64, self.device))
            return hidden, [seqs[i] for i in rows]
        self.plan_attention(backend, batch)
        if is_decode:  # eager decode (no graph for this stream or batch size)
            hidden = self.model(batch.input_ids, batch.positions, backend)
        else:
            hidden = self._prefill_forward(batch, backend)
        if not is_decode and pending is not None:
            self.prompt_logprobs(hidden, batch, seqs, pending)
        wanting = [s for s in seqs if s.needs_output]
        return hidden[batch.logits_indices], wanting

    def prompt_logprobs(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        seqs: list[ScheduledSeq],
        pending: PendingOutput,
        rows_per_chunk: int = 1024,
    ) -> None:
        """For each prefill sequence asking for prompt logprobs: the logprob (and top-k) of
        every prompt token this chunk predicts. hidden: [T, H] final-normed states of the
        batch. The LM head runs over `rows_per_chunk` rows at a time ([rows, vocab] fp32)."""
        for s, sl in zip(seqs, batch.seqs, strict=True):
            k = s.request.sampling.prompt_logprobs
            if k is None:
                continue
            prompt = s.request.prompt_token_ids
            start = s.num_context_tokens + 1
            targets = prompt[start : min(start + s.num_new_tokens, len(prompt))]
            if not targets:
                continue
            tgt = h2d(targets, torch.int64, self.device)
            chosen, top_v, top_i = [], [], []
            for a in range(0, len(targets), rows_per_chunk):
                b = min(a + rows_per_chunk, len(targets))
                h = hidden[sl.query_start + a : sl.query_start + b]
                logp = self.model.compute_logits(h).log_softmax(dim=-1)
                chosen.append(logp.gather(1, tgt[a:b, None]).squeeze(1))
                if k:
                    v, i = logp.topk(min(k, logp.shape[-1]), dim=-1)
                    top_v.append(v)
                    top_i.append(i)
            pending.add(
                "prompt",
                (s.request.request_id, targets, k),
                torch.cat(chosen),
                torch.cat(top_v) if k else None,
                torch.cat(top_i) if k else None,
            )

    def outputs_from_hidden(
        self, hidden: torch.Tensor, wanting: list[ScheduledSeq], pending: PendingOutput
    ) -> None:
        """LM head, sampling and label scoring on the device. Sampled tokens go to their
        token slots (the next decode step reads them there) and, with everything else, to
        `pending` for the host."""
        logits = self.model.compute_logits(hidden)  # [N, vocab] fp32

        gen_rows = [i for i, s in enumerate(wanting) if s.samples]
        score_rows = [i for i, s in enumerate(wanting) if s.request.kind == RequestKind.SCORE]
        if gen_rows:
            seqs = [wanting[i] for i in gen_rows]
            reqs = [s.request for s in seqs]
            init = [s for s in seqs if s.init_penalties]
            if init:
                self.penalties.init_rows(
                    [self.penalties.row(s.request.request_id) for s in init],
                    [s.request.prompt_token_ids for s in init],
                    [list(s.request.output_token_ids) for s in init],
                )
            pen_rows = [
                self.penalties.row(r.request_id) if has_penalties(r.sampling) else None
                for r in reqs
            ]
            gens = [self._generator(r.request_id, r.sampling.seed) for r in reqs]
            rows = logits
            if len(gen_rows) != len(wanting):
                rows = logits.index_select(0, h2d(gen_rows, torch.int64, self.device))
            rows = rows[:, : self.num_sampleable_tokens]  # a view: ids beyond are never drawn
            eos = self.model_config.eos_token_ids
            banned = [
                (i, [*r.sampling.stop_token_ids, *(() if r.sampling.ignore_eos else eos)])
                for i, (s, r) in enumerate(zip(seqs, reqs, strict=True))
                if s.bans_stop
            ]
            constrained = [i for i, r in enumerate(reqs) if r.sampling.grammar is not None]
            allowed = self._grammar_masks(constrained, reqs) if constrained else None
            pending.grammar_ids += [reqs[i].request_id for i in constrained]
            sampled = self.sampler.sample(
                rows, [r.sampling for r in reqs], gens, pen_rows, self.penalties, banned, allowed
            )
            slots = h2d([s.lease.slot for s in seqs], torch.int64, self.device)
            self.token_slots.index_copy_(0, slots, sampled.token_ids)
            pending.add(
                "sample",
                ([r.request_id for r in reqs], [r.sampling.logprobs for r in reqs]),
                sampled.token_ids,
                sampled.chosen_logprobs,
                sampled.top_logprobs,
                sampled.top_ids,
            )
        if score_rows:
            reqs = [wanting[i].request for i in score_rows]
            flat = label_probs(
                logits,
                score_rows,
                [r.label_token_ids for r in reqs],
                [r.apply_softmax for r in reqs],
            )
            pending.add(
                "score",
                ([r.request_id for r in reqs], [len(r.label_token_ids) for r in reqs]),
                flat,
            )

    def _grammar_masks(
        self, rows: list[int], reqs: list[Request]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's `allowed` for the rows with a grammar: their row indices and masks
        ([R, 32 * words] bool) on the device. Each mask follows all of its request's output
        tokens. One of them may still be in flight (the scheduler plans at most one sample
        of such a request ahead of the host, `MAX_GRAMMAR_SAMPLES_AHEAD`): the host then
        waits for the step that samples it. This step's forward is enqueued by then, so the
        device keeps working while the host waits, and a constrained request decodes every
        step beside unconstrained ones instead of every other one."""
        g = self.grammars
        if g is None:
            raise RuntimeError("this runner has no grammar tokenizer (structured outputs)")
        dev = self.device
        outputs = []
        for i in rows:
            r = reqs[i]
            ahead = r.num_output_placeholders - 1  # (this step's sample is counted too)
            output = r.output_token_ids
            if ahead == 1:
                earlier = self._grammar_pending.get(r.request_id)
                if earlier is None:
                    raise RuntimeError(f"request {r.request_id}: its sample in flight is lost")
                output = [*output, earlier.result().sampled_token_ids[r.request_id]]
            elif ahead > 1:
                raise RuntimeError(
                    f"request {r.request_id}: {ahead} samples in flight under a grammar (at most 1)"
                )
            outputs.append((r.request_id, r.sampling.grammar, output))
        # Filled in place (pinned on CUDA: the copy does not wait for the step in flight).
        host = torch.zeros(
            (len(rows), g.words_per_mask), dtype=torch.int32, pin_memory=dev.type == "cuda"
        )
        g.fill(outputs, host.numpy())
        words = host.to(dev, non_blocking=True)  # [R, W] int32, one bit per token id
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        mask = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
        return h2d(rows, torch.int64, dev), mask

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = make_generator(seed, self.device)
            self._generators[request_id] = g
        return g


def label_probs(
    logits: torch.Tensor,
    rows: list[int],
    label_ids: list[list[int]],
    apply_softmax: list[bool],
) -> torch.Tensor:
    """Probabilities of each scoring row's label tokens, flattened in row order, computed
    with one host-to-device copy for all rows (no per-request transfer).

    apply_softmax True: softmax over the row's label logits only; False: the labels' entries
    of the softmax over the whole vocabulary. logits: [N, vocab] fp32."""
    dev = logits.device
    seg_l: list[int] = []
    row_l: list[int] = []
    tok_l: list[int] = []
    for j, (r, labels) in enumerate(zip(rows, label_ids, strict=True)):
        seg_l.extend([j] * len(labels))
        row_l.extend([r] * len(labels))
        tok_l.extend(labels)
    use_l = [int(apply_softmax[j]) for j in seg_l]
    row_t, tok_t, seg_t, use_t = h2d([row_l, tok_l, seg_l, use_l], torch.int64, dev)
    sel = h2d(rows, torch.int64, dev)
    full = logits.index_select(0, sel).log_softmax(dim=-1)  # [R, vocab]
    row_in_sel = seg_t  # row j of `full` is scoring row j
    vocab_lp = full[row_in_sel, tok_t]  # [L] log p over the whole vocabulary
    picked = logits[row_t, tok_t]  # [L] raw label logits
    n_seg = len(rows)
    seg_max = torch.full((n_seg,), float("-inf"), device=dev, dtype=picked.dtype)
    seg_max = seg_max.scatter_reduce(0, seg_t, picked, reduce="amax")
    ex = (picked - seg_max[seg_t]).exp()
    seg_sum = torch.zeros(n_seg, device=dev, dtype=picked.dtype).index_add_(0, seg_t, ex)
    local = ex / seg_sum[seg_t]
    return torch.where(use_t.bool(), local, vocab_lp.exp())


def describe_oom(plan: StepPlan) -> str:
    """The message for a step that ran out of device memory (names the sizes involved)."""
    parts = []
    if plan.prefill:
        n = sum(s.num_new_tokens for s in plan.prefill)
        longest = max(s.num_context_tokens + s.num_new_tokens for s in plan.prefill)
        parts.append(f"a prefill of {n} tokens (longest sequence {longest} tokens)")
    if plan.decode:
        parts.append(f"a decode batch of {len(plan.decode)} sequences")
    what = " and ".join(parts) or "an empty step"
    return (
        f"out of GPU memory running {what}; the prompt is too long for this memory budget "
        f"(lower the prompt length, or raise --gpu-memory-utilization / --max-gpu-memory-gb)"
    )
