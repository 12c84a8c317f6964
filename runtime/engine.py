"""`Engine`: the thread that owns all model work, and its one step loop.

Other threads call `add`, `abort`, `set_policy`, `reset_prefix_cache`, `stats`: they only touch
a locked inbox (or the stats snapshot, published at a fixed rate). The engine thread loops:

    apply the inbox (add / abort / policy / calls)
    plan = scheduler.schedule(executor.capacity())      # token ids, no text
    executor.launch(plan)                               # enqueue on the device, do not wait
    for result in executor.results(block=...):          # steps launched earlier
        outputs += scheduler.update(result.plan, result.output)
    sink(outputs)                                       # EngineOutputs: token ids, one batch

Overlapped (`overlap_scheduling`, default on): one step stays queued ahead of the one whose
results are applied, so the host plans and launches step N+1 while the device runs step N;
step N's sampled tokens feed step N+1 on the device (runtime/runner.py token slots) and reach
the host one step later (runtime/scheduler.py). Off: each step is collected before the next is
planned. Greedy outputs are the same either way. A prefill the runner gates for aborts
(`ModelRunner.holds_host`: its launch trails the device by two layers, so it holds this thread
until near its step's end) is launched with nothing in flight, the answers of the steps
collected before it delivered first, and overlapped after.

Executors (runtime/executor/): `SerialExecutor` (the whole device; CPU too) and, on CUDA with
green contexts, `SplitExecutor` (prefill and decode concurrently on a pair of SM partitions,
or time-sliced when the controller predicts that is faster) while the partition mode is not
`off`. In `auto` with a TBT target the controller is asked before a step is planned whether to
cut the queue's head prefill into chunks sized to the target (`_auto_capacity`); its chunk is
then the step's prefill token cap. Switching executors drains the old one first.
`engine.partition` is a `runtime.partition.PartitionManager` (`UnavailablePartition` off CUDA,
saying why).

Failure containment: a step whose launch raises is re-run one request at a time after the
steps before it have been collected, so only the request(s) at fault finish with
FINISHED_ERROR and the loop keeps serving the others; a split whose work failed while the same
requests then ran fine on the whole GPU is taken out of service. An asynchronous device error
found when collecting a step fails the requests of every step in flight; steps collected before
it in the same call are applied first (`HeldFailure`, runtime/executor/base.py). Invalid requests
(empty prompt, ids outside the vocabulary, too long) are failed one by one at `add`.

Stats (`stats()`) are a snapshot rebuilt at most every `STATS_INTERVAL_S` on the engine thread
(and when it goes idle), never per step; counters are O(1) per step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from policies import make_policy
from policies.jct import JCTModel
from runtime import fallbacks
from runtime.attention.base import AttentionBackend
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.compile_watch import CompileWatch, triton_kernels
from runtime.config import PREFILL_WARM_UP_TOKENS, EngineConfig, check_prefill_limits
from runtime.executor.base import StepFailed, StepInterrupted, StepResult
from runtime.executor.serial import SerialExecutor
from runtime.executor.split import SplitExecutor
from runtime.executor.streams import stream_device_for
from runtime.gc_watch import GcWatch, untrack_int_list
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
    compute_num_blocks,
    cuda_memory_budget_bytes,
)
from runtime.kv.prefix_cache import PrefixCache
from runtime.model.llama import rows_stream_at
from runtime.model.loader import load_model
from runtime.partition import PartitionManager, SplitChoice
from runtime.partition.cost_model import (
    PREFILL,
    ChunkInput,
    DecodeShape,
    PrefillShape,
    RowStream,
)
from runtime.partition.setup import capture_split_graphs, make_partition, profile_at_startup
from runtime.prefill_graphs import prefill_graph_bytes, prefill_graph_max_tokens
from runtime.profiling import StepProfile
from runtime.request import FINISH_REASONS, EngineOutput, Request, RequestKind, RequestStatus
from runtime.runner import (
    ActivationLine,
    ModelRunner,
    activation_line,
    activation_probe_lengths,
    profile_activation_peak,
)
from runtime.scheduler import (
    CorrectedCost,
    Lease,
    ScheduledSeq,
    Scheduler,
    StepCapacity,
    StepOutlook,
    StepPlan,
    TailFactor,
)
from runtime.structured import GrammarMasks, grammar_conflict

log = logging.getLogger("greenlane.engine")

STATS_INTERVAL_S = 0.25
# The prefill limits `set_prefill_limits` changes at run time, in its argument order (the
# names `stats()` reports them under).
PREFILL_LIMITS = (
    "prefill_token_budget",
    "tbt_slo_ms",
    "mixed_step_token_budget",
    "chunk_fixed_share",
)
# Merged steps that fail while their requests run fine alone, before merging stops (`_recover`).
MERGED_STEP_FAILURES_BEFORE_FALLBACK = 3
# The fallback decode base (`Engine._decode_base_s`, no calibrated cost model) is an EWMA of
# decode-only steps, each entering at most this many times the current average: one stalled
# step (a host gap inside it, a collector pause) lifted it by a tenth of the stall, and the
# TBT cut planned the steps after it that much shorter until it decayed. A real change of
# batch still moves it by up to 10 % a step.
DECODE_AVG_MAX_JUMP = 2.0


def decode_avg_s(avg_s: float, sample_s: float) -> float:
    """The fallback decode base after one more decode-only step of `sample_s` (0: none yet)."""
    if avg_s == 0.0:
        return sample_s
    return 0.9 * avg_s + 0.1 * min(sample_s, DECODE_AVG_MAX_JUMP * avg_s)


# The least tail factor layer slices aim with once their own tail is measured (`_slice_tail`):
# the engine sees a slice's wait on the device, not the API server's delivery after it. On the
# H200 (8B in 24 GB, 80-ms target, fifty-fourth session) a floor of 1.05 bound (the waits'
# own ratio P99 read 1.04): slices aimed at ~76 ms, the waits behind them read P99 78.3 ms on
# the device and the chats 78.6-80.7 ms at the client. 1.08 aims at ~74 (~79 expected).
SLICE_TAIL_FLOOR = 1.08

# Steps kept for `step_trace` (the admin API's /admin/api/steps): a few seconds of a busy server.
STEP_TRACE_LEN = 4096
STEP_TRACE_FIELDS = (
    "end_s",  # engine clock (monotonic s) when the result was applied
    "on_split",  # ran on a split's partition (else the whole GPU)
    "num_decodes",
    "decode_context_tokens",  # KV tokens the decodes read
    "num_prefill_seqs",
    "num_prefill_tokens",
    "prefill_context_tokens",  # context the prefill parts attend to (cache hits, earlier chunks)
    # Query-key pairs the prefill parts' attention computes: sum of n * (context + n / 2).
    "prefill_attention_pairs",
    "device_ms",  # the step's device time (events), None where unmeasured
    "idle_before_ms",  # device idle since the previous step (the host's gap), None if unknown
    "predicted_ms",  # the TBT cut's prediction (mixed whole-GPU steps), else None
    # The collector's pauses (ms, any generation) since the previous traced step: a host gap
    # with a large one was the collector's.
    "gc_ms",
    "sms",  # SMs of the split partition it ran on (0: the whole GPU)
    "other_sms",  # SMs of the phase beside it on the other partition (0: none)
    # auto's chunked step: the cost model's prediction its `chunked/step` error is scored on
    # (a chunked decision's own step), else None
    "chunked_predicted_ms",
    # Split executor: what this step's continuing decodes waited since the previous step that
    # carried them (device time; a layer slice, a prefill on their stream or the host
    # between), else None (executor/base.py `StepResult.decode_gap_s`)
    "decode_gap_ms",
    # Split executor, a prefill run in layer slices (device_ms None): start to last slice with
    # the decode steps between, and the controller's prediction of it; else None
    "layer_sliced_span_ms",
    "layer_sliced_predicted_ms",
    # A mixed whole-GPU step: the decode base its prediction and the correction's observation
    # used (`Engine._decode_base_s`: the cost model's decode for the batch when calibrated,
    # else the decode-only average), else None. What a replay of the correction needs to be
    # the engine's (`bench.step_fit`).
    "decode_base_ms",
    # Host time (ms, the engine thread's wall clock) that planned this step (capacity,
    # `_auto_capacity`'s decision, `schedule`) and that enqueued it (`executor.launch`). A step
    # whose device_ms is near its launch_ms ran at the pace its host launched it, not at the
    # device's; None for a result that is not its launch's first (a split launch returns its
    # prefill and decode parts separately).
    "plan_ms",
    "launch_ms",
    # Prompt tokens of the prefill parts whose KV the step did not keep (a scoring suffix the
    # pool had no room for). With any prefill context beside them the FlashInfer backend
    # attends every member's context from a per-layer copy of it (its gathered path).
    "prefill_discarded_tokens",
    # A prefill on a split: the controller's predicted prefill on its SMs when it chose the split
    # (what the choice weighed against chunks and layer slices), else None. Against device_ms:
    # how far off the choice was (`prefill/concurrent` is scored on the model at collection).
    "split_predicted_ms",
    # auto's chunked step: the prediction its decision weighed for the whole rest of the head's
    # prefill by chunks (`_chunk_steps`), else None. Against the chunks' measured span: how far
    # off the choice of chunks over layer slices or a split was.
    "chunked_head_predicted_ms",
    # A step whose decodes waited behind a layer slice: the wait the controller promised them
    # (the heaviest slice and the decode step), else None. Against decode_gap_ms + device_ms:
    # what the slices' tail factor reads (`Engine._slice_tail`).
    "slice_promised_ms",
    # The launch that started a prefill on the split executor (layer slices or a split): its
    # launch_ms by part ({choose, build, plan_embed, decode, first_slice}, host ms), else
    # None. The device idles through it only where nothing was queued ahead of it (on an
    # H100 at 9ddecb5 the step before ran meanwhile: 13-39 ms of `decode` were its graphs'
    # staging guard waiting for that step).
    "launch_parts_ms",
    # The same launch: its first slice's slowest forward call and the memory allocator's
    # driver calls ({"slowest_piece": ..., "allocs": ...}, `Executor.launch_detail`), else None.
    "launch_detail",
    # Of launch_ms, the host time spent waiting for the device inside the launch (the staging
    # guard: a backend's pinned inputs are rewritten only once the step that read them has
    # run; a gated long prefill's wait within two layers), else None. launch_ms -
    # launch_wait_ms is the host's own work: a launch that waited had the host ahead of the
    # device, not slow.
    "launch_wait_ms",
)

Sink = Callable[[list[EngineOutput]], None]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _fallback_jct_model(
    model_config: Any, model_name: str, dtype: torch.dtype, device_type: str
) -> JCTModel:
    """Without a calibration: on CUDA, the JCT model's first-principles fallback for this
    model's shape (an H100/H200-class GPU assumed, refined online). Elsewhere the documented
    8B default, as before: no GPU derivation fits a CPU (SmolLM2 prefill on a 2-core VM ran
    ~5,000x slower than its shape's GPU figure, ~200x slower than the 8B default, which the
    TBT cut's bounded online correction gets closer to); `python -m app calibrate` measures."""
    if device_type != "cuda":
        return JCTModel()
    embed = model_config.vocab_size * model_config.hidden_size
    embeddings = embed * (1 if model_config.tie_word_embeddings else 2)
    return JCTModel.for_shape(
        non_embedding_params=model_config.num_params - embeddings,
        num_layers=model_config.num_layers,
        attention_width=model_config.q_size,
        weight_bytes=model_config.num_params * dtype.itemsize,
        model=model_name,
    )


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """auto: cuda + bfloat16 when CUDA is available, else cpu + float32."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif config.dtype in _DTYPES:
        dtype = _DTYPES[config.dtype]
    else:
        raise ValueError(f"unknown dtype {config.dtype!r}; choose auto, float32, bfloat16, float16")
    return device, dtype


def make_attention_backend(
    config: EngineConfig, pool: KVPool, num_q_heads: int
) -> AttentionBackend:
    """The attention backend for `config.attention_backend` (auto = FlashInfer on CUDA when
    it can be used). Falls back to torch SDPA, saying why once in the log."""
    want = config.attention_backend
    # The fused RoPE + K/V write (a Triton kernel): auto = with FlashInfer, where it was
    # measured (the torch SDPA backend is the fallback and fp32 path: unfused unless asked);
    # true = with either backend (without CUDA under Triton's interpreter, for tests).
    mode = config.fused_rope_kv_write
    fuse_torch = mode == "true"
    if want == "torch" or (want == "auto" and pool.device.type != "cuda"):
        return TorchAttentionBackend(pool, fuse_rope_kv_write=fuse_torch)
    if pool.device.type != "cuda":
        fallbacks.take(
            "attention backend",
            f"no CUDA device ({pool.device})",
            "torch SDPA",
            log,
            failed="--attention-backend flashinfer needs CUDA",
        )
        return TorchAttentionBackend(pool, fuse_rope_kv_write=fuse_torch)
    try:  # the GPU runtime provides this module; absent or broken -> the torch fallback
        from runtime.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend.from_pool(
            pool,
            num_q_heads,
            fuse_rope_kv_write=mode != "false",
        )
    except Exception as e:  # noqa: BLE001 - any import/init failure means "cannot use it"
        fallbacks.take(
            "attention backend", e, "torch SDPA", log, failed="FlashInfer attention unavailable"
        )
        return TorchAttentionBackend(pool, fuse_rope_kv_write=fuse_torch)


class Engine:
    def __init__(self, config: EngineConfig, sink: Sink) -> None:
        """sink(outputs) is called on the engine thread once per loop iteration with every
        output of that iteration; it must not block."""
        self.config = config
        self._sink = sink
        fallbacks.clear()  # this engine's own (runtime/fallbacks.py)
        self.device, self.dtype = resolve_device_dtype(config)
        if self.device.type == "cuda":
            # An engine shut down earlier in this process (A/B benchmarks, the GPU tests) is
            # freed only when the cyclic collector runs (its thread, executor and runner refer
            # to each other); until then its weights and KV pool count as used and this
            # engine's pool would be sized smaller, or not fit (seen: 74 GiB held on an H100).
            gc.collect()
            torch.cuda.empty_cache()
        # What this process's allocator held before this engine: --max-gpu-memory-gb caps
        # this engine alone, also beside another engine in the same process (benchmarks).
        self._reserved_at_start = (
            torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        )
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        model, model_config, tokenizer = load_model(
            config.model, self.dtype, self.device, seed=config.seed
        )
        log.info(
            "model %s loaded in %.1f s (%s, %s)",
            config.model,
            time.perf_counter() - t0,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        limit = config.max_model_len or model_config.max_position_embeddings
        if limit > model_config.max_position_embeddings:
            # A raised position limit (memory experiments): extend the RoPE table.
            model.rotary.rebuild(self.device, limit)
        self._max_model_len = limit

        self._max_score_tokens = min(config.max_score_tokens or limit, limit)
        if config.prefill_chunk_tokens is None and self.device.type == "cuda":
            # Sized before anything reads it: the dry runs below reserve its peak, the runner
            # and the executors chunk with it.
            self.config = config = dataclasses.replace(
                config, prefill_chunk_tokens=self._size_prefill_chunk()
            )
        activation_bytes = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            try:
                activation_bytes = self._measure_activation_reserve()
            except Exception as e:  # noqa: BLE001 - fall back to the estimate, and say so
                fallbacks.take(
                    "activation peak",
                    e,
                    "sizing the KV pool with the estimated activation reserve",
                    log,
                    failed="could not measure the activation peak",
                )
                torch.cuda.empty_cache()
        num_blocks = compute_num_blocks(
            config,
            model_config,
            self.dtype,
            self.device,
            activation_bytes=activation_bytes,
            baseline_reserved=self._reserved_at_start,
        )
        self.kv_pool = KVPool.for_model(
            model_config, num_blocks, config.block_size, self.dtype, self.device
        )
        kv_bytes = num_blocks * bytes_per_block(model_config, config.block_size, self.dtype)
        log.info(
            "KV cache: %d blocks of %d tokens, %d tokens, %.2f GiB (%s)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            kv_bytes / 2**30,
            "--num-kv-blocks"
            if config.num_kv_blocks is not None
            else "sized from memory"
            if self.device.type == "cuda"
            else "--cpu-kv-cache-gb",
        )
        self.backend = make_attention_backend(config, self.kv_pool, model_config.num_q_heads)
        cache = PrefixCache(config.block_size) if config.enable_prefix_cache else None
        self.block_manager = BlockManager(num_blocks, config.block_size, cache)
        # One JCT model for the engine's life: switching policies keeps what it learned.
        self.jct_model = (
            JCTModel.load(config.jct_calibration)
            if config.jct_calibration
            else _fallback_jct_model(model_config, config.model, self.dtype, self.device.type)
        )
        self.policy = self._make_policy(config.prefill_policy)
        self.scheduler = Scheduler(
            config, self.block_manager, self.policy, model_config.eos_token_ids
        )
        self.partition: PartitionManager = self._make_partition()
        # Split mode runs prefill and decode at the same time: each needs its own backend
        # instance (plan state, workspace).
        decode_backend = (
            make_attention_backend(config, self.kv_pool, model_config.num_q_heads)
            if self._green is not None
            else None
        )
        self.runner = ModelRunner(
            config,
            model,
            model_config,
            self.kv_pool,
            self.backend,
            decode_backend,
            max_model_len=self._max_model_len,
            num_sampleable_tokens=tokenizer.vocab_size,
            num_token_slots=self.scheduler.slots.num_slots,
        )
        # Structured outputs: matchers built on first use from the served tokenizer (the ids
        # the masks cover are the ones sampling may pick: num_sampleable_tokens).
        self.runner.grammars = GrammarMasks(tokenizer.to_json, model_config.eos_token_ids)
        self.stream_device = stream_device_for(self.device)
        pg = self.runner.prefill_graphs
        # Fixed after start-up: read once, not per stats snapshot.
        self._prefill_graphs_summary = pg.summary() if pg is not None and pg.captured else None
        self.serial = SerialExecutor(
            config,
            self.runner,
            self.stream_device,
            config.mixed_step_tokens(self.device.type == "cuda"),
        )
        log.info("%s", self._describe_prefill_limits())
        self.split: SplitExecutor | None = None
        if self._green is not None and self._partition_choice.action == "profile":
            self._profile_partition()
        if self._green is not None:
            capture_split_graphs(self.runner, self._green)
            self.split = SplitExecutor(
                config,
                self.runner,
                self.stream_device,
                self._choose_split,
                self._green.observe,
                split_usable=lambda sms: sms not in self._green.disabled,
                score=self._green.score,
            )
        self.executor: SerialExecutor | SplitExecutor = self.serial
        # Steps kept queued ahead of the one being collected (overlapped scheduling).
        self._max_in_flight = 1 if config.overlap_scheduling else 0
        # Steps in flight answered before a launch that holds the host (`_launch_holds_host`).
        self._num_drains_before_held_launch = 0

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._accepting = True
        self._stop_deadline_s: float | None = None  # set by shutdown
        # Request ids whose abort is in the inbox (added by `abort_many`, dropped when applied):
        # a launch whose requests are all here stops between layers (`_should_interrupt`).
        self._aborting: set[str] = set()
        self.runner.interrupt = self._should_interrupt
        self._num_interrupted_steps = 0
        self._thread: threading.Thread | None = None
        self._crashed: BaseException | None = None
        self._num_failed_steps = 0
        self._num_failed_requests = 0  # requests failed by a model error (not by input)
        # Merged steps (prefill + decodes in one forward) that failed while each of their
        # requests then ran fine alone; at MERGED_STEP_FAILURES_BEFORE_FALLBACK merging stops.
        self._num_failed_merged_steps = 0
        # Device time of decode steps and device idle between consecutive decode steps (the
        # host was late): their ratio is the GPU idle fraction of a decode-bound server.
        self._decode_device_s = 0.0
        self._decode_idle_s = 0.0
        self._num_decode_steps = 0
        self._prev_had_decode = False
        # --tbt-slo-ms: prefill work per step is cut to fit the target next to the decodes,
        # whose step time is this running average of decode-only steps (serial executor; in
        # auto the controller sizes its chunks with the same arithmetic: _auto_capacity).
        self._tbt_s = None if config.tbt_slo_ms is None else config.tbt_slo_ms / 1e3
        # --chunk-fixed-share (auto's chunks beside decodes; `_auto_step_cap`): a prefill
        # limit, so it changes at run time with the others (`set_prefill_limits`).
        self._chunk_fixed_share = config.chunk_fixed_share
        self._decode_step_avg_s = 0.0
        self._prefill_cost = CorrectedCost(self.jct_model)
        # Mixed whole-GPU steps (prefill + decodes): how many, how many took longer than the
        # TBT target, and measured / predicted time of the recent ones (the prediction the cut
        # works from: decode step + correction). A target missed at the P99 is read from their
        # tail; the mean alone is what the correction fits.
        self._num_mixed_steps = 0
        self._num_mixed_steps_over_tbt = 0
        self._mixed_step_ratios: deque[float] = deque(maxlen=512)
        # The cut aims at the target / this factor: the tail of what decodes waited for mixed
        # steps (host gap included) over their prediction. Whole-GPU steps only.
        self._tbt_tail = TailFactor()
        # auto's layer slices aim at the target / this one's factor once it is measured: what
        # decodes waited behind a slice (device gap + their step) over the wait promised
        # (`_slice_aim_ms`). Slices miss differently from chunked steps: on an H100 (8B in
        # 24 GB, `58a82b9`) the chunked steps' tail (1.1-1.5 over the run) sized the slices
        # of 50-60k-token prompts to 31-43 ms where ~65 fitted, while the slices' spans
        # read within 3 % of their prediction.
        self._slice_tail = TailFactor(floor=SLICE_TAIL_FLOOR)
        # The collector's pauses (a full collection stops this loop): stats, not per step.
        self._gc = GcWatch()
        # Triton variants compiled after start-up: first uses the warm-up missed (CUDA only: the
        # CPU runs Triton's interpreter, which compiles nothing).
        kernels: dict[str, Any] = {}
        if self.device.type == "cuda":
            from runtime.attention import rope_kv_write
            from runtime.model import decode_kernels

            kernels = triton_kernels([rope_kv_write, decode_kernels])
        self._compiles = CompileWatch(kernels)
        # One tuple per applied step (STEP_TRACE_FIELDS), for finding what makes a long gap
        # between tokens: appended in O(1), read only on request (`step_trace`).
        self._step_trace: deque[tuple[Any, ...]] = deque(maxlen=STEP_TRACE_LEN)
        # POST /admin/api/profile: the torch profiler over the next steps (engine thread only;
        # None while none is asked for, the only per-step cost).
        self._profile: StepProfile | None = None
        # auto: the controller's choice for the step being planned, when it chose chunks
        # (`_auto_capacity`); the launch of that step carries it out (`_choose_split`).
        self._planned_choice: SplitChoice | None = None
        self._planned_chunk: ChunkInput | None = None  # its input (to predict that step)
        # step id -> a launched chunked step's predicted ms (scored when its result is in) and
        # the rest of the head its decision predicted (traced)
        self._chunked_predicted_ms: dict[int, tuple[float, float]] = {}
        # step_id -> host ms (planning, launching), the launch's parts and detail
        # (`Executor.launch_parts_ms`, `launch_detail`) until the step's first result is traced
        self._host_ms: dict[
            int, tuple[float, float, dict[str, float] | None, dict[str, Any] | None]
        ] = {}
        self._kv_usage_before_plan = 0.0  # KV usage when the current step was planned
        self._step_started_s: float | None = None  # engine clock at the current step's start
        self._stats: dict[str, Any] = {}
        self._next_stats_s = 0.0
        if self._green is not None:
            self._green.submit = self._submit_call
            self._share_prefill_model()
        self.prefill_warm_up_s: float | None = None
        warm_up_tokens = config.prefill_warm_up_tokens
        if warm_up_tokens is None:
            warm_up_tokens = PREFILL_WARM_UP_TOKENS if self.device.type == "cuda" else 0
        if warm_up_tokens:
            self._warm_up_prefill(warm_up_tokens)
        self._publish_stats()

    def _share_prefill_model(self) -> None:
        """One prefill model: the split controller predicts a prefill's whole-GPU latency with
        the JCT model that sizes the chunks (and the cost model adds what SM shares change),
        so auto weighs chunks and splits on one scale. Only while the JCT model is fitted to
        this device (a file, or a calibration run later): its first-principles fallback (an 8B
        model's) would replace a fitted cost model's own prefill base with a guess."""
        jct = self.jct_model
        num_layers = self.model_config.num_layers

        def whole_prefill_ms(shape: Any) -> float | None:
            if not jct.calibrated:
                return None
            # The JCT model prices a whole forward; a shape of fewer layers (a row piece of
            # one layer, `SplitController._row_slices`) is that many layers' share of it.
            # Priced whole, no piece of a 53-56k-token prompt ever fitted the aim (H100, 8B
            # in 24 GB): they went to a 112-SM split at 1.2x the whole GPU's time.
            whole_ms = jct.predict_totals_s(shape.num_tokens, shape.attention_pairs) * 1e3
            return whole_ms * shape.num_layers / num_layers

        self._green.share_prefill_model(whole_prefill_ms)
        log.info(
            "partition cost model: whole-GPU prefill from the JCT model while it is fitted to "
            "this device (now: %s)",
            jct.source,
        )
        self._seed_prefill_scale()

    def _describe_prefill_limits(self) -> str:
        """The start-up log's line on how much prefill a step takes."""
        cfg, mixed = self.config, self.serial.mixed_step_token_budget
        if mixed is None:
            beside = "the same"
        else:
            beside = f"at most {mixed} (--mixed-step-token-budget {cfg.mixed_step_token_budget})"
            if cfg.chunk_fixed_share is not None:
                beside += (
                    f" (auto's chunks more, until the step's fixed part is at most "
                    f"{cfg.chunk_fixed_share:g} of it)"
                )
        if cfg.tbt_slo_ms is not None:
            cut = f"cut to a {cfg.tbt_slo_ms:g} ms TBT target"
            beside = cut if mixed is None else f"{beside}, {cut}"
        where = (
            "" if cfg.partition == "off" else "; with the partition on, its controller sizes them"
        )
        return (
            f"prefill per step: {cfg.prefill_token_budget} tokens; beside decodes {beside}{where}"
        )

    def _seed_prefill_scale(self) -> None:
        """Until the JCT model is fitted to this device, the chunks' marginal cost (`--tbt-slo-ms`
        and auto's) starts scaled to the partition cost model's whole-GPU prefill fit, when
        that is calibrated (a file, the start-up profile or the labelled fallback): the JCT
        fallback is an 8B model's first-principles guess, and the online correction
        (`CorrectedCost`, from mixed steps) would otherwise start from 1. Ratio of the two
        models' whole prefills at the start-up profile's shapes, bounded as the correction."""
        jct, model = self.jct_model, self._green.cost_model
        if jct.calibrated or not model.calibrated:
            return
        layers = self.model_config.num_layers
        ratios = []
        for tokens, context in ((4096, 0), (1024, 4096)):
            shape = PrefillShape.from_seqs([(context, tokens)], layers)
            jct_ms = jct.predict_totals_s(shape.num_tokens, shape.attention_pairs) * 1e3
            ratios.append(model.base_ms(PREFILL, shape) / jct_ms)
        scale = min(10.0, max(0.1, sum(ratios) / len(ratios)))
        self._prefill_cost.seed_scale(scale)
        log.info(
            "prefill cost for TBT chunks scaled by %.2f to the partition cost model (%s) until "
            "the JCT model is fitted (now: %s)",
            scale,
            model.source,
            jct.source,
        )

    # ---- partition ------------------------------------------------------------------------
    def _make_partition(self) -> PartitionManager:
        """GreenContextPartition on CUDA with green contexts (any mode), else an
        UnavailablePartition that says why (runtime/partition/setup.py)."""
        setup = make_partition(self.config, self.device, self.device_name)
        self._green: Any = setup.green
        self._partition_choice: Any = setup.calibration_choice
        return setup.manager

    def _profile_partition(self) -> None:
        """The bounded start-up profile (`--partition auto`, no calibration file)."""
        profile_at_startup(self, self._green, self._partition_choice)

    def _submit_call(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(("call", fn))
            self._wakeup.notify()

    def _auto_capacity(self, capacity: StepCapacity) -> StepCapacity:
        """auto with a TBT target, before a step is planned: the controller chooses how to run
        the head of the prefill queue beside the decodes, chunked time-slicing included (the
        prefill cut into chunks sized to the target, on the whole GPU). When it chooses
        chunks, the step is planned as `off` plans one, its prefill tokens capped at the
        decision's `chunk_tokens`, and launched on the whole GPU with that decision
        (`_choose_split`). Otherwise the step is planned whole and the controller chooses for
        the planned batch at launch (split, layer slices, or a whole time-slice)."""
        self._planned_choice = self._planned_chunk = None
        g = self._green
        target_ms = self._chunk_tbt_ms()
        if g is None or g.mode != "auto" or target_ms is None:
            return capacity
        if capacity.prefill_token_budget <= 0:
            return capacity  # a prefill is in flight on a split or in layer slices
        look = self.scheduler.outlook(self.config.chunk_scoring_prefill)
        if not (look.prefill_tokens and look.num_decodes):
            return capacity  # nothing to cut, or nothing to protect: planned whole
        if not look.prefill_chunkable:
            # The head, a scoring prompt that runs whole (no room for its KV, or
            # `--chunk-scoring-prefill false`), is planned whole (the scheduler admits a step's
            # first prefill whatever the room) and the controller chooses at launch how to run
            # it; what is admitted behind it is held to the room, as `off --tbt-slo-ms` holds
            # its admissions. Without that a batch of scoring suffixes that waited on one
            # shared prefix went in as one step: on the H200 (3B, plan z at 8c86337) 20-23
            # suffixes, 2.7-3.4k tokens over 264-288k cached, predicted 73-90 ms and measured
            # 83-86 ms for an 80-ms target, run whole beside the decodes.
            return self._timed(capacity, look, target_ms / 1e3)
        layers = self.model_config.num_layers
        p = PrefillShape.from_seqs([(look.prefill_context_tokens, look.prefill_tokens)], layers)
        d = DecodeShape(look.num_decodes, look.decode_context_tokens, layers)
        # The cap on a step with decodes (the serial executor's, `--mixed-step-token-budget`)
        # bounds auto's chunks as it bounds off's steps: decodes share it.
        base_s = self._decode_base_s(look.num_decodes, look.decode_context_tokens)
        cap = self._auto_step_cap(look, base_s, capacity.prefill_token_budget)
        chunk = ChunkInput(
            self._prefill_cost,
            look.prefill_context_tokens,
            target_ms,
            base_s * 1e3,
            self._prefill_cost.offset_s * 1e3,
            max_chunk_tokens=None if cap is None else max(cap - look.num_decodes, 1),
        )
        # Planned whole (a split or layer slices), the head is one sequence of its tokens.
        rows = self._row_stream([(look.prefill_context_tokens, look.prefill_tokens)])
        choice = g.decide(
            p,
            d,
            self._kv_usage_before_plan,
            chunk=chunk,
            record=False,
            rows=rows,
            slice_aim_ms=self._slice_aim_ms(),
        )
        chunk_tokens = choice.decision.chunk_tokens
        if not chunk_tokens:
            # A split or layer slices, predicted for the whole head: the step carries the
            # whole head, not the executor's budget's worth (each piece would be launched and
            # weighed alone, paying the pipeline's fill and drain). On an H100 (8B, 40-44k-token
            # scoring prompts beside chat) such a prompt ran as five 8,192-token pieces on 96
            # SMs, 3.3 s where layer slices take ~1.9 s. Up to the longest prompt the
            # activation reserve was sized to run whole (`max_score_tokens`).
            if capacity.prefill_token_budget < look.prefill_tokens <= self._max_score_tokens:
                return dataclasses.replace(capacity, prefill_token_budget=look.prefill_tokens)
            return capacity
        self._planned_choice, self._planned_chunk = choice, chunk
        # As the serial executor plans a step (decodes share the budget the activation reserve
        # was sized for); the decision's chunk caps the prefill tokens, and the room it was cut
        # to caps their time: the prefills planned behind the head (scoring suffixes over a
        # long cached prefix) cost more a token than its chunk. With the token cap alone, the
        # H200 (3B, scoring next to chat) ran steps predicted at 85-120 ms for an 80 ms aim.
        aim_s = target_ms / 1e3
        return StepCapacity(
            prefill_token_budget=min(
                capacity.prefill_token_budget, chunk_tokens + look.num_decodes
            ),
            decodes_share_budget=True,
            hold_prefills=False,
            chunk_scoring=self.config.chunk_scoring_prefill,
            mixed_step_token_budget=cap,
            tbt_s=aim_s,
            decode_step_s=aim_s - g.chunk_room_ms(d, chunk) / 1e3,
            prefill_cost=self._prefill_cost,
        )

    def _auto_step_cap(self, look: StepOutlook, base_s: float, budget: int) -> int | None:
        """The most tokens auto's chunked step with decodes may take, decodes included: the
        serial executor's cap (`--mixed-step-token-budget`), raised with `--chunk-fixed-share
        s` to the chunk whose marginal cost is (1 - s) / s times the step's fixed part (the
        decode base `base_s` for the batch, the mixed step's offset and its prefix read: what
        the step costs whatever its chunk), so that part is at most s of the step; never past
        `budget` (the prefill budget the activation reserve was sized for). The TBT target's
        room still bounds the chunk (`SplitController._chunked`)."""
        cap = self.serial.mixed_step_token_budget
        share = self._chunk_fixed_share
        if cap is None or share is None:
            return cap
        cost, ctx = self._prefill_cost, look.prefill_context_tokens
        # The cached prefix's read (`CorrectedCost.context_s_per_token`) is paid whatever the
        # chunk too: fixed, and `max_tokens_within` takes it back out of the chunk's time.
        context_s = cost.context_s_per_token * ctx
        fixed_s = max(0.0, base_s + cost.offset_s + context_s)
        chunk_s = fixed_s * (1.0 - share) / share
        tokens = cost.max_tokens_within(chunk_s + context_s, ctx)
        return min(max(cap, tokens + look.num_decodes), budget)

    def _timed(self, capacity: StepCapacity, look: StepOutlook, aim_s: float) -> StepCapacity:
        """`capacity` with the TBT cut's time accounting: the prefill planned beside the
        decodes may add `aim_s` less the decode base for the batch and the mixed step's fixed
        cost (`CorrectedCost`), by the corrected prefill cost. The cap on a step with decodes
        (`mixed_step_token_budget`) stays: the target can only cut such a step shorter."""
        base_s = self._decode_base_s(look.num_decodes, look.decode_context_tokens)
        return dataclasses.replace(
            capacity,
            tbt_s=aim_s,
            decode_step_s=base_s + self._prefill_cost.offset_s,
            prefill_cost=self._prefill_cost,
        )

    def _decode_base_s(self, num_decodes: int, context_tokens: int) -> float:
        """The decode part of a mixed whole-GPU step (s): the base the TBT cut subtracts and
        the step offset (`CorrectedCost`) is fitted against, one for both, in auto and in
        `off --tbt-slo-ms` alike. With a calibrated cost model (green contexts), its
        prediction for this batch (decode alone: 0.6-3.3 % MAPE on the H200; in off its
        decode is refined from the serial executor's decode-only steps, `_observe`); else,
        as a labelled fallback, the average of recent decode-only steps. That average goes
        stale under load: decode-only steps then come between bursts of mixed steps and at
        other batch sizes (the 3B's mixed chat on the H200, `8b4553d`: decode-only steps at a
        median 2-46 decodes per window of 512 steps, the mixed steps beside them at 45-170),
        and the offset absorbs the difference, wrong again as soon as the batch changes. On
        the H200 at `c05f523` off-tbt's offset on that base read 7.2 and 19.6 ms at the end of
        two runs (auto's, on the model's base, 0.04 and 10.8), and the run at 19.6 planned its
        chunked steps to a median 53.5 ms against 59.9 and lost a probe of max QPS."""
        g = self._green
        if g is not None and num_decodes > 0:
            layers = self.model_config.num_layers
            ms = g.predict_decode_ms(DecodeShape(num_decodes, context_tokens, layers))
            if ms is not None and ms > 0.0:
                return ms / 1e3
        return self._decode_step_avg_s

    def _chunk_tbt_ms(self) -> float | None:
        """auto's aim for chunked time-slicing (ms): its target (`_auto_tbt_ms`) divided by the
        measured tail factor."""
        target_ms = self._auto_tbt_ms()
        return None if target_ms is None else target_ms / self._tbt_tail.factor

    def _slice_aim_ms(self) -> float | None:
        """auto's aim for layer slices (ms): its target divided by the slices' own measured
        tail (`_slice_tail`); None until that is measured (the controller then sizes slices
        to the chunks' aim, with the layer-sliced prediction's error as a margin)."""
        target_ms = self._auto_tbt_ms()
        if target_ms is None or not self._slice_tail.measured:
            return None
        return target_ms / self._slice_tail.factor

    def _auto_tbt_ms(self) -> float | None:
        """auto's TBT target itself (ms): `--tbt-slo-ms` (also as changed on the admin page),
        else the controller's (`--partition-tbt-slo-ms`)."""
        if self._tbt_s is not None:
            return self._tbt_s * 1e3
        g = self._green
        return None if g is None else g.controller.config.tbt_slo_ms

    def _cut_target_s(self) -> float | None:
        """The TBT target the running executor cuts mixed steps to (s), else None: the serial
        executor's `--tbt-slo-ms`, or auto's target on the split executor. Only steps cut to a
        target are counted against it and teach the tail factor (an `off` side with a fixed
        budget would otherwise fill it with steps no cut sized)."""
        if self.executor is self.serial:
            return self._tbt_s
        g = self._green
        if g is None or g.mode != "auto":
            return None
        target_ms = self._auto_tbt_ms()
        return None if target_ms is None else target_ms / 1e3

    def _choose_split(self, pplan: StepPlan | None, dplan: StepPlan | None) -> SplitChoice:
        """The controller's split for the next prefill batch (or decode-only step); for a
        prefill planned as chunks (`_auto_capacity`), that decision."""
        g = self._green
        num_layers = self.model_config.num_layers
        planned = self._planned_choice
        chunk = self._planned_chunk
        if pplan is not None and planned is not None and chunk is not None:
            self._planned_choice = self._planned_chunk = None
            g.record(planned.decision)
            # The planned step's own prediction, scored when it is collected (`_observe`).
            seqs = [] if dplan is None else dplan.decode
            d = DecodeShape(len(seqs), sum(s.num_context_tokens for s in seqs), num_layers)
            items = [(s.num_new_tokens, s.num_context_tokens) for s in pplan.prefill]
            if len(self._chunked_predicted_ms) > 64:
                self._chunked_predicted_ms.clear()  # steps that failed never came back
            self._chunked_predicted_ms[pplan.step_id] = (
                g.predict_chunked_step_ms(items, d, chunk),
                planned.decision.predicted_prefill_ms,
            )
            return planned
        p = (
            None
            if pplan is None
            else PrefillShape.from_seqs(
                [(s.num_context_tokens, s.num_new_tokens) for s in pplan.prefill], num_layers
            )
        )
        if pplan is None:
            d = (
                None
                if dplan is None
                else DecodeShape(
                    len(dplan.decode), sum(s.num_context_tokens for s in dplan.decode), num_layers
                )
            )
        else:
            # A prefill runs beside every decode of its time, not only this step's: those of
            # generations whose (held) prefill is still in flight as well (`decodes_ahead`).
            planned = () if dplan is None else dplan.decode
            num, ctx = self.scheduler.decodes_ahead(planned, pplan.prefill)
            d = DecodeShape(num, ctx, num_layers) if num else None
        # A prefill is judged at the KV usage from before its step was planned: its own blocks
        # are not decode pressure (a whole scoring prompt takes every free block to cache its
        # prefix, which would put every such prompt in the decode-favoured regime), and the
        # decision made before planning (`_auto_capacity`) saw the same.
        kv_usage = self._kv_usage_before_plan if pplan is not None else self._kv_usage()
        # Layer slices are sized to an aim (the target less a measured tail), not to the
        # target: a decode waits one slice plus its own step. Their own tail once measured,
        # else the chunks'.
        rows = (
            None
            if pplan is None
            else self._row_stream([(s.num_context_tokens, s.num_new_tokens) for s in pplan.prefill])
        )
        return g.decide(
            p,
            d,
            kv_usage,
            aim_ms=self._chunk_tbt_ms(),
            rows=rows,
            slice_aim_ms=self._slice_aim_ms(),
        )

    def _row_stream(self, seqs: list[tuple[int, int]]) -> RowStream | None:
        """The row stream a prefill batch of (context, new tokens) per sequence runs as, if
        it streams its rows (one sequence past the hybrid chunk and the prefill budget, on a
        backend that attends rows): what sub-layer slices cut (`SplitController`)."""
        if len(seqs) != 1 or not hasattr(self.runner.prefill_backend, "attends_rows"):
            return None
        (context, tokens), (chunk, above) = seqs[0], self.config.hybrid_form()
        if chunk is None or not rows_stream_at(tokens, chunk, above):
            return None
        return RowStream(context, tokens, chunk)

    def _kv_usage(self) -> float:
        """The KV usage the split controller's switch reads as decode pressure: the pool's
        share in use, less the blocks that only running scoring prompts hold. Those go back
        when their prefill ends (the suffix discarded, the prefix evictable), which favouring
        decode only delays. Counted, a whole scoring prompt planned while the previous one's
        last step was still in flight judged the pool full: on an H100 (8B in 24 GB,
        `58a82b9`) such a 50k-token prompt went to the decode-favoured rule once a run.
        O(blocks of running scoring prompts), once a step the split executor plans."""
        bm = self.block_manager
        used = bm.num_used_blocks - self.scheduler.num_sole_scoring_blocks()
        return used / max(bm.num_blocks, 1)

    def _size_prefill_chunk(self) -> int:
        """`prefill_chunk_tokens` = auto on CUDA (`auto_prefill_chunk_tokens`): from the bytes
        the KV pool and the activations may share here, less an explicitly sized pool."""
        cfg, mc = self.config, self.model_config
        shared = cuda_memory_budget_bytes(cfg, self.device, self._reserved_at_start)
        pool = ""
        if cfg.num_kv_blocks is not None:
            pool_bytes = cfg.num_kv_blocks * bytes_per_block(mc, cfg.block_size, self.dtype)
            shared -= pool_bytes
            pool = f" beside the {pool_bytes / 2**30:.1f} GiB pool asked for"
        elem = torch.empty((), dtype=self.dtype).element_size()
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

    def _measure_activation_reserve(self) -> int:
        """Activation bytes to keep free beside the KV pool, measured, not guessed: dry-run
        prefills of one step's budget and of two longer prompts (`activation_probe_lengths`:
        where the per-token term leads) give the step's peak, a fixed part and a per-token
        slope; the reserve covers the larger of one budget-sized step and the longest scoring
        prompt (`max_score_tokens`, which runs alone with hybrid prefill)."""
        cfg, mc = self.config, self.model_config

        def backend_for(pool: KVPool) -> AttentionBackend:
            return make_attention_backend(cfg, pool, mc.num_q_heads)

        chunk, _ = cfg.hybrid_form()
        # Only a scoring prompt runs whole (generation prompts are cut to the step's budget), so
        # no dry run needs to be longer than the longest one; nor than the model's positions,
        # where profile_activation_peak stops.
        longest = min(self._max_score_tokens, self.model.rotary.max_positions)
        step = min(cfg.prefill_token_budget, self._max_model_len)
        n0, lo, hi = activation_probe_lengths(step, chunk, longest)
        # The piecewise prefill graphs hold their buffers and pool for the engine's life: a
        # fixed part of the reserve (over by that much if the backend turns out not to be
        # FlashInfer, which they need).
        graphs = 0
        if cfg.cuda_graphs:
            graphs = prefill_graph_bytes(self.model, prefill_graph_max_tokens(cfg), self.dtype)

        def peak_at(num_tokens: int) -> int:
            # A step of the budget may hold several sequences (chat parts, short scoring
            # prompts): hybrid prefill then attends all rows at once, the higher peak per
            # token; a longer prompt runs alone and streams rows (DecoderLayer.forward_rows).
            several = chunk is not None and num_tokens == n0 and n0 > chunk
            peak = profile_activation_peak(
                cfg, self.model, mc, num_tokens, backend_for, num_seqs=2 if several else 1
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
            self._fit_max_score_tokens(line)
        reserve = int(line.reserve(self._max_score_tokens))
        log.info(
            "activation peak measured in %.1f s: %.2f GiB at %d tokens, %.1f KiB/token; "
            "reserving %.2f GiB (scoring prompts up to %d tokens)",
            time.perf_counter() - t0,
            line.step_peak / 2**30,
            n0,
            line.slope / 1024,
            reserve / 2**30,
            self._max_score_tokens,
        )
        return reserve

    def _fit_max_score_tokens(self, line: ActivationLine) -> None:
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

        budget = cuda_memory_budget_bytes(self.config, self.device, self._reserved_at_start)
        room = budget - CUDA_SAFETY_BYTES
        min_pool = pool_bytes(self._max_model_len)
        floor_tokens = line.step_tokens
        if room - line.step_peak < min_pool:
            min_pool = pool_bytes(min(floor_tokens, self._max_model_len))
        fits = line.longest_within(room - min_pool) // bs * bs
        if fits >= self._max_score_tokens:
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
            self._max_score_tokens,
            max(0, pool_tokens),
        )
        self._max_score_tokens = new

    # ---- limits ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens limit."""
        return self._max_model_len

    @property
    def kv_pool_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size

    @property
    def max_score_tokens(self) -> int:
        """Longest scoring prompt: its activations were reserved at start-up (suffix-KV
        discard means it needs no KV beyond its cacheable prefix)."""
        return self._max_score_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt the engine accepts: a generation prompt must fit the KV pool with at
        least one output token; a scoring prompt only needs `max_model_len` (suffix-KV
        discard). This is the stricter (generation) limit."""
        return min(self._max_model_len, self.kv_pool_tokens - 1)

    def info(self) -> dict[str, Any]:
        """What a front end needs to know about this engine (plain values, picklable): limits,
        vocabulary, EOS ids, device, and where its tokenizer comes from."""
        from runtime.model.loader import tokenizer_dir

        return {
            "model": self.config.model,
            "max_model_len": self.max_model_len,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_score_tokens": self.max_score_tokens,
            "kv_pool_tokens": self.kv_pool_tokens,
            "vocab_size": self.model_config.vocab_size,
            "eos_token_ids": list(self.model_config.eos_token_ids),
            "max_position_embeddings": self.model_config.max_position_embeddings,
            "device": str(self.device),
            "device_name": self.device_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "tokenizer_dir": str(tokenizer_dir(self.config.model)),
            "max_num_seqs": self.config.max_num_seqs,
            # API servers compute prompts' prefix-cache digests at this block size.
            "prefix_block_size": (
                self.config.block_size if self.scheduler.bm.prefix_cache is not None else None
            ),
        }

    # ---- thread-safe API ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._gc.install()
        self._compiles.mark()
        self._thread = threading.Thread(target=self._loop, name="greenlane-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._crashed is None

    def add(self, req: Request) -> None:
        """Queue a request. Invalid or late requests get a final error/abort output."""
        self.add_many([req])

    def add_many(self, reqs: list[Request]) -> None:
        """Queue requests together (e.g. the items of one score call), so one step can take
        them all. Invalid or late ones get a final error/abort output."""
        failed: list[EngineOutput] = []
        checked = []
        for req in reqs:
            try:
                error = self.validate(req)
            except Exception as e:  # noqa: BLE001 - malformed input must fail only this request
                error = f"invalid request: {type(e).__name__}: {e}"
            if error is None:
                # Validated: numbers only. A long prompt's list, left tracked, is walked
                # element by element by the young collections while the request waits, the
                # step loop standing still (runtime/gc_watch.py).
                untrack_int_list(req.prompt_token_ids)
                untrack_int_list(req.block_hashes)
                if req.sampling.grammar is not None and self.runner.grammars is not None:
                    # Compiled here, not on the engine thread (runtime/structured.py).
                    error = self.runner.grammars.prepare(req.request_id, req.sampling.grammar)
            checked.append((req, error))
        with self._lock:
            started = self._thread is not None
            dead = started and not self._thread.is_alive()  # type: ignore[union-attr]
            for req, error in checked:
                if not self._accepting or dead:
                    if error is None and req.sampling.grammar is not None:
                        self.runner.release(req.request_id)  # its prepared matcher
                    failed.append(
                        _failed_output(
                            req,
                            error or "the engine is not running",
                            RequestStatus.FINISHED_ABORTED
                            if not self._accepting and error is None
                            else RequestStatus.FINISHED_ERROR,
                        )
                    )
                elif error is not None:
                    self._inbox.append(("fail", (req, error)))
                else:
                    self._inbox.append(("add", req))
            self._wakeup.notify()
        if failed:
            self._deliver(failed)

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ones are ignored). A step under way whose
        requests are all among them stops at its next layer (eager prefill forwards)."""
        with self._lock:
            self._inbox.append(("abort", list(request_ids)))
            self._aborting.update(request_ids)
            self._wakeup.notify()

    def set_policy(self, name: str) -> None:
        """Switch the prefill policy (ValueError for an unknown name, raised here)."""
        policy = self._make_policy(name)
        with self._lock:
            self._inbox.append(("policy", policy))
            self._stats["policy"] = policy.name
            self._wakeup.notify()

    def set_prefill_limits(
        self,
        prefill_token_budget: int,
        tbt_slo_ms: float | None,
        mixed_step_token_budget: int | None,
        chunk_fixed_share: float | None,
    ) -> None:
        """Change the per-step prefill token budget, the TBT target, the cap on steps that
        carry decodes (None: the budget alone) and auto's fixed-part share past that cap
        (None: the cap alone; `--chunk-fixed-share`) at run time (thread-safe; applied before
        the next step). The budget may only go down from the configured one: activation
        memory was reserved for that (ValueError, raised here)."""
        check_prefill_limits(
            prefill_token_budget,
            tbt_slo_ms,
            mixed_step_token_budget,
            self.config.prefill_token_budget,
            chunk_fixed_share,
        )
        limits = (prefill_token_budget, tbt_slo_ms, mixed_step_token_budget, chunk_fixed_share)
        with self._lock:
            self._inbox.append(("prefill_limits", limits))
            for key, value in zip(PREFILL_LIMITS, limits, strict=True):
                self._stats[key] = value
            self._wakeup.notify()

    def reset_prefix_cache(self) -> None:
        """Drop every prefix-cache block no running request holds (thread-safe; applied on
        the engine thread before its next step)."""
        with self._lock:
            self._inbox.append(("reset_prefix_cache", None))
            self._wakeup.notify()

    def _make_policy(self, name: str) -> Any:
        return make_policy(
            name,
            jct_model=self.jct_model,
            gamma=self.config.spf_gamma,
            fairness_lambda=self.config.fairness_lambda,
            latency_slo_s=(
                self.config.ttft_slo_ms / 1e3 if self.config.ttft_slo_ms is not None else None
            ),
        )

    @property
    def device_name(self) -> str:
        """Human-readable device name (keys calibration files)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

    def _warm_up_prefill(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` (at most the longest scoring prompt) through the serving
        runner, its KV kept or discarded as a served scoring prompt's would be
        (`measure_prefill`), before the first request, so its first-use host costs are paid
        here: on the H200 a fresh server's first 16k prompt spent ~130 ms more host time inside
        cuBLAS (its first GEMMs of that many rows) and in the scoring path's first elementwise
        kernels, with the GPU waiting (docs/benchmarks.md, "A fresh server's first long
        prompt"). The activation dry runs do not do it: other lengths, their own pool, no
        scoring head. A failure is said and serving starts without it."""
        n = min(num_tokens, self._max_score_tokens)
        try:
            self.prefill_warm_up_s = self.measure_prefill(n, 0)
        except Exception as e:  # noqa: BLE001 - a warm-up must never stop the server starting
            fallbacks.take(
                "prefill warm-up",
                e,
                "the first long prompt pays its first-use costs",
                log,
                failed=f"the {n}-token prefill warm-up failed",
            )
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        log.info("prefill warm-up: %d tokens in %.3f s", n, self.prefill_warm_up_s)
        t0 = time.perf_counter()
        try:
            for items, keep_kv in self._warm_up_forms():
                self.measure_prefill_batch(items, keep_kv=keep_kv)
        except Exception as e:  # noqa: BLE001 - as above
            fallbacks.take(
                "step forms warm-up",
                e,
                "the first such steps pay their first-use costs",
                log,
                failed="warming up the first chunked steps' forms failed",
            )
            return
        log.info("warm-up of the first steps' forms: %.3f s", time.perf_counter() - t0)

    def _warm_up_forms(self) -> list[tuple[list[tuple[int, int]], bool]]:
        """The forms of forward a chat's first chunked steps take, as (uncached, cached) items
        and whether their KV is kept: each one's first run through the serving path pays
        one-time host costs (a Triton variant of the RoPE + K/V write compiled) on the engine
        thread, with the decodes beside it waiting. (FlashInfer's kernels and wrappers are the
        runner's attention warm-up's: `ModelRunner.warm_up_attention`.) On the H200 (3B, bf68d3a) a fresh
        engine's first chunk next to eight chats took 164 ms for a 25-ms target and an
        11-token chunk beside them 300 ms (tests/gpu/test_auto_chunked_gpu.py). Odd sizes on
        purpose; the start-up graph capture runs only bucket sizes."""
        budget = self.config.prefill_token_budget
        eager = self.config.prefill_graph_max_tokens + 77
        forms: list[tuple[list[tuple[int, int]], bool]] = [
            ([(19, 0)], False),  # a short forward: RoPE one program a token
            # Mostly one-token rows (decodes) beside a short part: the FA2 kernels, on a
            # gathered context (a scoring suffix discarded) and on a paged one (a merged step)
            ([(1, 64)] * 8 + [(19, 0)], False),
            ([(1, 64)] * 8 + [(19, 0)], True),
            ([(333, 1499)], True),  # a later chunk: paged, RoPE tiled
            ([(eager, 0)], True),  # a first chunk past the graphs' largest bucket: eager
        ]
        # Within the step budget, the model's length and the pool (a small engine skips some).
        bm = self.block_manager

        def fits(items: list[tuple[int, int]], keep: bool) -> bool:
            blocks = sum(bm.num_blocks_for(c + n if keep else c) for n, c in items)
            return (
                sum(n for n, _ in items) <= budget
                and all(n + c <= self._max_model_len for n, c in items)
                and blocks <= bm.num_free_blocks
            )

        return [(items, keep) for items, keep in forms if fits(items, keep)]

    def measure_prefill(self, uncached_tokens: int, cached_tokens: int) -> float:
        """Seconds of one real prefill of `uncached_tokens` new tokens after `cached_tokens`
        of context already in the pool (runtime.calibrate's `measure`), on the attention path
        a served scoring request of that shape takes (`measure_prefill_batch`, `keep_kv=None`)."""
        return self.measure_prefill_batch([(uncached_tokens, cached_tokens)])

    def served_keeps_kv(self, items: list[tuple[int, int]], share_context: bool = False) -> bool:
        """Whether served scoring requests of these (uncached, cached) shapes would keep their
        new tokens' KV: the scheduler keeps a scoring prompt's whole KV when the pool has the
        blocks for it now (runtime/scheduler.py, `_admit`), and only then does a request with
        cached context run on the paged attention path; a discarded suffix after a context
        is attended from a copy of the context made in every layer (the FlashInfer backend's
        "gather" path). Here: the pool is free now (nothing is served before `start()`).
        The scheduler keeps what fits block by block; a partial keep takes the gathered path
        as no keep does, which is what this answers for it."""
        bm = self.block_manager
        if share_context:
            need = bm.num_blocks_for(items[0][1]) + sum(bm.num_blocks_for(n) for n, _ in items)
        else:
            need = sum(bm.num_blocks_for(n + c) for n, c in items)
        return need <= bm.num_free_blocks

    def measure_prefill_batch(
        self,
        items: list[tuple[int, int]],
        *,
        keep_kv: bool | None = None,
        share_context: bool = False,
        device_s_out: list[float] | None = None,
    ) -> float:
        """Seconds of one real prefill step over several sequences, (uncached, cached) tokens
        each (the JCT profiles: runtime/calibrate.py, bench/prefill_profile.py). Call before
        `start()` (the engine thread must not be running). The contexts' KV values are
        whatever the pool holds, which does not change the timing.

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
        if self._thread is not None:
            raise RuntimeError("measure_prefill must run before the engine thread starts")
        bm = self.block_manager
        if share_context and len({c for _, c in items}) > 1:
            raise ValueError("share_context needs equal cached lengths")
        if keep_kv is None:
            keep_kv = self.served_keeps_kv(items, share_context)
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
                req = Request(
                    key, RequestKind.SCORE, [0] * (cached + uncached), label_token_ids=[0]
                )
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
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start, end = self.stream_device.event(), self.stream_device.event()
            t0 = time.perf_counter()
            start.record()
            pending = self.runner.launch(plan)
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

    def stats(self) -> dict[str, Any]:
        """The latest published snapshot: rebuilt every STATS_INTERVAL_S between steps and when
        idle, its queue and KV counts also as of the latest launch with prefill (a long step
        runs for seconds with nothing rebuilt)."""
        with self._lock:
            return dict(self._stats)

    def live_stats(self) -> dict[str, Any]:
        """What moves during one long step, read now (any thread; attribute reads only, no
        lock): how long since the latest launch, and which layer an interruptible prefill
        forward is about to run, of how many, over how many tokens (None outside one)."""
        started = self._step_started_s
        layer = self.runner.forward_layer
        return {
            "step_running_s": None if started is None else time.monotonic() - started,
            "step_layer": layer,
            "step_num_layers": None if layer is None else self.model_config.num_layers,
            "step_prefill_tokens": None if layer is None else self.runner.forward_tokens,
        }

    def fresh_stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """A snapshot built for this call on the engine thread, between two steps (tests and
        benchmarks; falls back to the latest snapshot after `timeout_s`)."""
        if self._thread is None or not self._thread.is_alive():
            self._publish_stats()
            return self.stats()
        done = threading.Event()

        def publish() -> None:
            self._publish_stats()
            done.set()

        self._submit_call(publish)
        done.wait(timeout_s)
        return self.stats()

    def profile_steps(
        self, num_steps: int, timeout_s: float, trace_path: str | None = None
    ) -> dict[str, Any]:
        """Run the torch profiler over the next `num_steps` applied steps and return its
        summary (runtime.profiling.summarize_kernels, plus the steps by kind); the chrome trace
        goes to `trace_path` when given. Blocks the calling thread (never the engine's) until
        the steps are done or `timeout_s` passed: then what was recorded, `timed_out` true.
        Raises ValueError while another profile runs."""
        if self._thread is None or not self._thread.is_alive():
            raise ValueError("the engine is not running")
        prof = StepProfile(num_steps, trace_path)
        started = threading.Event()
        busy: list[bool] = []

        failed: list[BaseException] = []

        def begin() -> None:  # on the engine thread: it must not raise (the loop would stop)
            try:
                if self._profile is not None:
                    busy.append(True)
                else:
                    prof.start(self.device)
                    self._profile = prof
            except Exception as e:  # noqa: BLE001 - the profiler's failure, the caller's error
                failed.append(e)
            finally:
                started.set()

        self._submit_call(begin)
        if not started.wait(timeout_s) or busy or failed:
            if busy:
                raise ValueError("a profile is already running")
            if failed:
                raise RuntimeError(f"the profiler did not start: {failed[0]}") from failed[0]
            raise TimeoutError("the engine thread did not start the profile")
        if not prof.wait(timeout_s):

            def give_up() -> None:
                if self._profile is prof:
                    self._profile = None
                    prof.stop(timed_out=True)

            self._submit_call(give_up)
            prof.wait(60.0)
        if not prof.wait(0):
            raise TimeoutError("the profile did not finish")
        try:  # here, not on the engine thread: parsing the events takes seconds
            return prof.summarize()
        except Exception as e:
            raise RuntimeError(f"profiling failed: {e}") from e

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting; let queued and running requests finish within `grace_s`; abort the
        rest (FINISHED_ABORTED outputs); join the thread."""
        with self._lock:
            self._accepting = False
            self._stop_deadline_s = time.monotonic() + max(0.0, grace_s)
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._abort_everything()
        self._gc.uninstall()

    # ---- validation -------------------------------------------------------------------------
    def validate(self, req: Request) -> str | None:
        """A clear error message for a request the engine cannot run, else None."""
        vocab = self.model_config.vocab_size
        n = req.num_prompt_tokens
        if n == 0:
            return "the prompt is empty"
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
        if req.kind == RequestKind.SCORE:
            if not req.label_token_ids:
                return "label_token_ids must not be empty"
            bad = next((t for t in req.label_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                return f"label token id {bad} is outside the vocabulary [0, {vocab})"
            if n > self._max_model_len:
                return (
                    f"the prompt has {n} tokens; the maximum context length is "
                    f"{self._max_model_len}"
                )
            if n > self._max_score_tokens:
                return (
                    f"the scoring prompt has {n} tokens; this server reserved memory for at "
                    f"most {self._max_score_tokens} (--max-score-tokens)"
                )
            return None
        max_tokens = req.sampling.max_tokens
        if max_tokens < 0:
            return f"max_tokens must be >= 0, got {max_tokens}"
        if req.sampling.min_tokens > max_tokens:
            return f"min_tokens ({req.sampling.min_tokens}) exceeds max_tokens ({max_tokens})"
        if req.sampling.grammar is not None:
            why = grammar_conflict(req.sampling)
            if why is not None:
                return why
        if n + max_tokens > self._max_model_len:
            return (
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                f"exceeds the maximum context length {self._max_model_len}"
            )
        if n + max_tokens > self.kv_pool_tokens:
            return (
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs more KV cache than "
                f"the pool holds ({self.kv_pool_tokens} tokens)"
            )
        return None

    # ---- engine thread ------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return self.scheduler.has_work() or self.executor.num_in_flight > 0

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while (
                        not self._inbox and not self._has_work() and self._stop_deadline_s is None
                    ):
                        self._publish_stats_locked()  # idle: the snapshot is exact
                        self._wakeup.wait(timeout=STATS_INTERVAL_S)
                    items = list(self._inbox)
                    self._inbox.clear()
                    deadline = self._stop_deadline_s
                outputs: list[EngineOutput] = []
                for kind, payload in items:
                    outputs += self._handle(kind, payload)
                if deadline is not None and (time.monotonic() >= deadline or not self._has_work()):
                    self._deliver(outputs + self._abort_everything())
                    self._publish_stats()
                    return
                if self._has_work():
                    # What the inbox gave is out first: a step's launch can hold this thread
                    # for the whole step (a gated long prefill, `_step`).
                    self._deliver(outputs)
                    outputs = self._step()
                self._deliver(outputs)
                if time.monotonic() >= self._next_stats_s:
                    self._publish_stats()
        except BaseException as e:  # a bug outside step containment: say so, stop serving
            self._crashed = e
            log.exception("engine loop crashed")
            raise

    def _handle(self, kind: str, payload: Any) -> list[EngineOutput]:
        if kind == "add":
            req: Request = payload
            if self.scheduler.get(req.request_id) is not None:
                return [_failed_output(req, f"duplicate request id {req.request_id!r}")]
            self.scheduler.add(req)
        elif kind == "fail":
            req, error = payload
            return [_failed_output(req, error)]
        elif kind == "abort":
            outs = []
            for rid in payload:
                out = self.scheduler.abort(rid)
                if out is not None:
                    outs.append(out)
            with self._lock:
                self._aborting.difference_update(payload)
            for rid in self.scheduler.take_released():  # (waiting ones: not after a step)
                self.runner.release(rid)
            return outs
        elif kind == "policy":
            self.policy = payload
            self.scheduler.set_policy(payload)
        elif kind == "prefill_limits":
            budget, tbt_ms, mixed, share = payload
            self._tbt_s = None if tbt_ms is None else tbt_ms / 1e3
            self._chunk_fixed_share = share
            self.serial.set_prefill_token_budget(budget)
            self.serial.set_mixed_step_token_budget(mixed)
            if self.split is not None:
                self.split.set_prefill_token_budget(budget)
            log.info(
                "prefill limits: budget %d tokens (%s with decodes%s), TBT target %s ms",
                budget,
                "the same" if mixed is None else mixed,
                "" if share is None else f"; auto's chunks to a fixed-part share of {share:g}",
                tbt_ms,
            )
        elif kind == "call":
            payload()
        elif kind == "reset_prefix_cache":
            num_dropped = self.block_manager.drop_cached_blocks()
            log.info("prefix cache reset: %d idle blocks dropped", num_dropped)
        return []

    def _pick_executor(self) -> list[EngineOutput]:
        """The split executor while partitioning is on (or its work is still in flight), else
        the serial one; a switch drains the old executor first."""
        split = self.split
        want: SerialExecutor | SplitExecutor = self.serial
        if split is not None and (self._green.mode != "off" or split.busy):
            want = split
        if want is self.executor:
            return []
        outputs = self._drain()
        main = self.stream_device.current_stream()
        if want is self.serial and split is not None:
            split.fence(main)
        elif split is not None:
            split.enter(main)
        self.executor = want
        return outputs

    def _step(self) -> list[EngineOutput]:
        """One iteration of the step loop: schedule -> launch -> apply what came back."""
        outputs = self._pick_executor()
        ex = self.executor
        sched = self.scheduler
        planned = False
        if sched.has_work():
            plan_started_s = time.perf_counter()
            capacity = ex.capacity()
            if ex is self.split:
                # Read by the split controller only, and only for a step that may plan a
                # prefill: not on the decode steps between a sliced prompt's slices (budget
                # 0), where counting that prompt's thousands of blocks would buy nothing.
                if capacity.prefill_token_budget > 0:
                    self._kv_usage_before_plan = self._kv_usage()
                capacity = self._auto_capacity(capacity)
            elif self._tbt_s is not None and ex.name == "serial":
                look = self.scheduler.outlook(self.config.chunk_scoring_prefill)
                capacity = self._timed(capacity, look, self._tbt_s / self._tbt_tail.factor)
            try:
                plan = sched.schedule(capacity)
            except Exception as e:  # noqa: BLE001 - bookkeeping bug: fail everything queued
                log.exception("scheduling failed")
                ids = [r.request_id for r in sched.running + sched.waiting]
                return outputs + sched.fail(ids, f"internal scheduler error: {e!r}")
            outputs += sched.take_pending_outputs()
            if not plan.is_empty:
                # A gated long prefill (`ModelRunner.holds_host`) holds this thread until near
                # its end: answer the steps in flight first, but keep the overlap after it (its
                # launch returns with two layers still to run, time enough to plan the next
                # step). On the H200 (issue 17, 0.5x pool, 16,384-token chunk) the step before
                # such a prompt was answered ~450 ms late; answering it first costs the device
                # the update of that step and the build of this one, a few ms.
                held = self._launch_holds_host(ex, plan)
                if held and ex.num_in_flight:
                    # Launched behind them, it would hold this thread until near its end, and
                    # the steps in flight would be answered only then.
                    self._num_drains_before_held_launch += 1
                    failed_before = self._num_failed_steps
                    outputs += self._drain()
                    if self._num_failed_steps > failed_before:
                        # Planned while a failing step ran: it shares their fate, as a step
                        # launched behind them would (`_recover`); a chunk of a prompt whose
                        # previous chunk failed must not run.
                        sched.retire(plan)
                        self._num_failed_requests += len(plan.seqs)
                        ids = [seq.request.request_id for seq in plan.seqs]
                        msg = "internal error while running the model: a step before it failed"
                        return outputs + sched.fail(ids, msg)
                if held:
                    # Delivered now, not when `_step` returns: the launch below holds this
                    # thread until near the step's end. (Drained but held back, the answers of
                    # the steps before a gated 32k prompt reached their clients with it, the
                    # forty-fourth session's GPU test: 0.58 s against the long one's 0.62 s.)
                    self._deliver(outputs)
                    outputs = []
                self._step_started_s = time.monotonic()
                if plan.prefill:
                    self._publish_counts()
                launch_started_s = time.perf_counter()
                waited_s = self.runner.device_wait_s
                try:
                    ex.launch(plan)
                    planned = True
                    if len(self._host_ms) > 64:
                        self._host_ms.clear()  # steps that failed never came back
                    self._host_ms[plan.step_id] = (
                        (launch_started_s - plan_started_s) * 1e3,
                        (time.perf_counter() - launch_started_s) * 1e3,
                        ex.launch_parts_ms,
                        ex.launch_detail,
                        (self.runner.device_wait_s - waited_s) * 1e3,
                    )
                except StepInterrupted as e:
                    outputs += self._interrupted(e)
                except StepFailed as e:
                    return outputs + self._recover(e)
        in_flight = ex.num_in_flight
        max_in_flight = self._max_in_flight
        block = in_flight > 0 and (in_flight > max_in_flight or not planned)
        while True:
            try:
                results = ex.results(block)
            except StepFailed as e:
                return outputs + self._recover(e)
            for r in results:
                outputs += self._apply(r)
            # Until no more than max_in_flight remain (a blocking call returns at least one
            # step). Each call's steps are applied first: a later step's failure must not lose
            # them.
            if not (block and ex.num_in_flight > max_in_flight):
                break
        if not planned and not results and not outputs and ex.num_in_flight == 0:
            time.sleep(0.001)  # nothing runnable now (e.g. waiting for KV): do not spin hot
        if ex.num_in_flight == 0:
            self._step_started_s = None
        return outputs

    def _launch_holds_host(self, ex: Any, plan: StepPlan) -> bool:
        """Whether `plan`'s launch on the serial executor, overlapped, would hold this thread
        until near the step's end (`ModelRunner.holds_host`)."""
        return ex is self.serial and bool(self._max_in_flight) and self.runner.holds_host(plan)

    def _apply(self, result: StepResult) -> list[EngineOutput]:
        outputs = self.scheduler.update(result.plan, result.output)
        self._observe(result)
        if self._profile is not None:
            plan = result.plan
            kind = (
                "mixed" if plan.prefill and plan.decode else "decode" if plan.decode else "prefill"
            )
            if self._profile.on_step(kind):
                self._profile.stop()
                self._profile = None
        for rid in self.scheduler.take_released():
            self.runner.release(rid)
        return outputs

    def _observe(self, result: StepResult) -> None:
        """Online JCT refinement from prefill-only steps (device time from events) and the
        decode step / idle counters. Steps that ran on a split's partition teach neither the
        JCT model nor the decode step average: both model the whole GPU (they size auto's and
        the scheduler's chunks), and a split's partition is slower."""
        plan = result.plan
        whole = not result.on_split
        chunked_ms, head_ms = self._chunked_predicted_ms.pop(plan.step_id, (None, None))
        if chunked_ms is not None and result.device_s is not None:
            self._green.score("chunked/step", chunked_ms, result.device_s * 1e3)
        if result.device_s is not None and result.is_prefill_only and whole:
            # Whatever the policy and executor: SRJF reads this model, and so does the
            # prefill-backlog estimate replicas report for routing.
            self.jct_model.observe_batch(
                [(s.num_new_tokens, s.num_context_tokens) for s in plan.prefill],
                result.device_s,
            )
        # Mixed whole-GPU steps: what the step took beyond its decode part (`_decode_base_s`),
        # against the JCT model's terms for its prefill parts, corrects the TBT cut
        # (`CorrectedCost`: offset, a scale per term, the cached prefix's read).
        base = (
            self._decode_base_s(len(plan.decode), sum(s.num_context_tokens for s in plan.decode))
            if plan.decode and plan.prefill and whole
            else 0.0
        )
        predicted_step_s: float | None = None
        if plan.decode and plan.prefill and result.device_s is not None and base > 0.0 and whole:
            cost = self._prefill_cost
            prefill = cost.prefill((s.num_new_tokens, s.num_context_tokens) for s in plan.prefill)
            step_s = base + cost.extra_s(prefill)  # as the cut saw it
            predicted_step_s = step_s
            self._mixed_step_ratios.append(result.device_s / step_s)
            self._num_mixed_steps += 1
            target_s = self._cut_target_s()
            if target_s is not None:
                if result.device_s > target_s:
                    self._num_mixed_steps_over_tbt += 1
                # What the step's decodes waited: the host's gap before it, then the step.
                waited_s = result.device_s + (result.idle_before_s or 0.0)
                self._tbt_tail.observe(step_s, waited_s, target_s)
            cost.observe(prefill, result.device_s - base)
        if (
            result.slice_promised_s is not None
            and result.decode_gap_s is not None
            and result.device_s is not None
        ):
            target_s = self._cut_target_s()
            if target_s is not None:
                # What the decodes waited behind the slice: the device gap since their
                # previous step (the slice, and the host if it lagged), then their own step.
                waited_s = result.decode_gap_s + result.device_s
                self._slice_tail.observe(result.slice_promised_s, waited_s, target_s)
        self._trace(
            result, predicted_step_s, chunked_ms, base if predicted_step_s else None, head_ms
        )
        # Decode-only steps: a step with prefill work is not a decode step's time.
        decode_only = bool(plan.decode) and not plan.prefill
        if decode_only and result.device_s is not None:
            self._decode_device_s += result.device_s
            self._num_decode_steps += 1
            if whole:
                self._decode_step_avg_s = decode_avg_s(self._decode_step_avg_s, result.device_s)
            if (
                whole
                and self._tbt_s is not None
                and self._green is not None
                and self.executor is self.serial
            ):
                # In off the split executor does not run, so nothing else teaches the cost
                # model this device's decode: the decode base of the TBT cut reads it (plain
                # off, without a target, reads nothing of it: not taught, no hot-path cost).
                shape = DecodeShape(
                    len(plan.decode),
                    sum(s.num_context_tokens for s in plan.decode),
                    self.model_config.num_layers,
                )
                self._green.observe_whole_decode(shape, result.device_s * 1e3)
            if self._prev_had_decode and result.idle_before_s is not None:
                self._decode_idle_s += result.idle_before_s
        self._prev_had_decode = decode_only

    def _trace(
        self,
        result: StepResult,
        predicted_s: float | None,
        chunked_ms: float | None,
        decode_base_s: float | None,
        chunked_head_ms: float | None = None,
    ) -> None:
        plan = result.plan
        plan_ms, launch_ms, launch_parts_ms, launch_detail, launch_wait_ms = self._host_ms.pop(
            plan.step_id, (None, None, None, None, None)
        )
        self._step_trace.append(
            (
                time.monotonic(),
                result.on_split,
                len(plan.decode),
                sum(s.num_context_tokens for s in plan.decode),
                len(plan.prefill),
                sum(s.num_new_tokens for s in plan.prefill),
                sum(s.num_context_tokens for s in plan.prefill),
                sum(
                    s.num_new_tokens * (s.num_context_tokens + s.num_new_tokens / 2)
                    for s in plan.prefill
                ),
                None if result.device_s is None else result.device_s * 1e3,
                None if result.idle_before_s is None else result.idle_before_s * 1e3,
                None if predicted_s is None else predicted_s * 1e3,
                self._gc.take_pause_ms(),
                result.sms,
                result.other_sms,
                chunked_ms,
                None if result.decode_gap_s is None else result.decode_gap_s * 1e3,
                _ms(result.layer_sliced_span_s),
                _ms(result.layer_sliced_predicted_s),
                _ms(decode_base_s),
                plan_ms,
                launch_ms,
                sum(
                    s.num_context_tokens + s.num_new_tokens - s.num_kept_tokens
                    for s in plan.prefill
                    if s.num_kept_tokens < s.num_context_tokens + s.num_new_tokens
                ),
                _ms(result.split_predicted_s),
                chunked_head_ms,
                _ms(result.slice_promised_s),
                launch_parts_ms,
                launch_detail,
                launch_wait_ms,
            )
        )

    def step_trace(self, limit: int = STEP_TRACE_LEN) -> list[dict[str, Any]]:
        """The most recent `limit` applied steps, oldest first, as dicts of STEP_TRACE_FIELDS
        with `end_s` made relative to now (`age_s`, seconds ago). Any thread: the copy of the
        deque is one C call under the GIL, and the engine thread only appends."""
        rows = list(self._step_trace)[-max(0, limit) :] if limit > 0 else []
        now = time.monotonic()
        out = []
        for row in rows:
            d = dict(zip(STEP_TRACE_FIELDS, row, strict=True))
            d["age_s"] = now - d.pop("end_s")
            out.append(d)
        return out

    def _drain(self) -> list[EngineOutput]:
        """Collect everything the current executor has in flight (a failure behind collected
        steps comes with the next call: those are applied first)."""
        outputs: list[EngineOutput] = []
        while self.executor.num_in_flight:
            try:
                results = self.executor.drain()
            except StepFailed as e:
                return outputs + self._recover(e)
            for r in results:
                outputs += self._apply(r)
        return outputs

    def _recover(self, failure: StepFailed) -> list[EngineOutput]:
        """A step failed. A failed launch: collect the steps before it, then re-run its
        requests one at a time so only the culprit(s) fail. A device error found when
        collecting: every step in flight is suspect (later steps read its samples), so their
        requests fail."""
        self._num_failed_steps += 1
        plan = failure.plan
        log.error("step failed (%d requests): %s", len(plan.seqs), failure, exc_info=failure.cause)
        sched = self.scheduler
        outputs: list[EngineOutput] = []
        if not failure.rerun_ok:
            lost = [plan]
            while self.executor.num_in_flight:
                try:
                    lost += [r.plan for r in self.executor.drain()]
                except StepFailed as e:
                    lost.append(e.plan)
            msg = f"internal error while running the model: {failure}"
            for p in lost:
                sched.retire(p)
                self._num_failed_requests += len(p.seqs)
                outputs += sched.fail([s.request.request_id for s in p.seqs], msg)
            return outputs
        outputs += self._drain()
        merged = self.runner.merges(plan)  # before the re-runs change what the runner does
        if len(plan.seqs) == 1 and not failure.prefill_sms:
            return outputs + self._fail_seq(plan.seqs[0], failure.cause)  # the culprit
        failed_before = self._num_failed_requests
        for seq in plan.seqs:
            sub = (
                StepPlan(plan.step_id, prefill=[seq])
                if seq in plan.prefill
                else StepPlan(plan.step_id, decode=[seq])
            )
            try:
                outputs += sched.update(sub, self.executor.run_alone(sub))
            except Exception as e:  # noqa: BLE001 - this request is (one of) the culprits
                log.exception("request %s failed when run alone", seq.request.request_id)
                outputs += self._fail_seq(seq, e)
        for rid in sched.take_released():
            self.runner.release(rid)
        if self._num_failed_requests == failed_before and not failure.prefill_sms and merged:
            # Every request ran fine alone: merging them broke the step (seen on the H200: a
            # FlashInfer workspace too small for FA2's plans of some merged batches, 77 steps
            # re-run one request at a time in a chat run). A few such failures could be bad
            # luck; more mean every merged step risks it: run them as separate forwards.
            self._num_failed_merged_steps += 1
            if self._num_failed_merged_steps >= MERGED_STEP_FAILURES_BEFORE_FALLBACK:
                self.runner.stop_merging(
                    f"{self._num_failed_merged_steps} merged steps failed while their requests "
                    f"then ran fine alone; the last: {failure}"
                )
        if (
            self._num_failed_requests == failed_before
            and failure.prefill_sms
            and self._green is not None
        ):
            # Every request ran fine on the whole GPU: the split itself is broken (seen on the
            # H200: cuBLAS failing on a 12-SM decode remainder). Never use it again rather
            # than fail-and-re-run every step.
            self._green.disable_split(
                failure.prefill_sms, f"work on it failed, then ran fine on the whole GPU: {failure}"
            )
        return outputs

    def _should_interrupt(self, plan: StepPlan) -> bool:
        """Asked (on the engine thread) between layers of an interruptible launch: stop it when
        every request in it is being aborted or shutdown's grace is over. O(requests)."""
        deadline = self._stop_deadline_s
        if deadline is not None and time.monotonic() >= deadline:
            return True
        aborting = self._aborting  # read without the lock: membership tests only
        return bool(aborting) and all(s.request.request_id in aborting for s in plan.seqs)

    def _interrupted(self, stop: StepInterrupted) -> list[EngineOutput]:
        """A launch stopped part-way: nothing of it is in flight. Its requests are aborted now
        (their abort, or shutdown's, is in the inbox: applying it again is a no-op)."""
        plan = stop.plan
        self._num_interrupted_steps += 1
        log.info(
            "step %d stopped before layer %d (%d prefill tokens, %d requests): aborted",
            plan.step_id,
            stop.layer,
            plan.num_prefill_tokens,
            len(plan.seqs),
        )
        sched = self.scheduler
        sched.retire(plan)
        outputs = []
        for seq in plan.seqs:
            out = sched.abort(seq.request.request_id)
            if out is not None:
                outputs.append(out)
        for rid in sched.take_released():
            self.runner.release(rid)
        return outputs

    def _fail_seq(self, seq: ScheduledSeq, e: BaseException) -> list[EngineOutput]:
        self._num_failed_requests += 1
        self.scheduler.retire(StepPlan(-1, prefill=[seq]))
        msg = f"internal error while running the model: {type(e).__name__}: {e}"
        return self.scheduler.fail([seq.request.request_id], msg)

    def _abort_everything(self) -> list[EngineOutput]:
        outputs = self._drain()
        sched = self.scheduler
        for rid in [r.request_id for r in sched.running + sched.waiting]:
            out = sched.abort(rid)
            if out is not None:
                outputs.append(out)
        for rid in sched.take_released():
            self.runner.release(rid)
        with self._lock:  # anything that arrived meanwhile
            items = list(self._inbox)
            self._inbox.clear()
        for kind, payload in items:
            if kind in ("add", "fail"):
                req = payload if kind == "add" else payload[0]
                outputs.append(
                    _failed_output(
                        req, "the engine is shutting down", RequestStatus.FINISHED_ABORTED
                    )
                )
        return outputs

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        if not outputs:
            return
        try:
            self._sink(outputs)
        except Exception:  # noqa: BLE001 - a broken sink must not kill the engine
            log.exception("output sink raised for %d outputs", len(outputs))

    # ---- stats ----------------------------------------------------------------------------------
    def _partition_stats(self) -> dict[str, Any]:
        st = self.partition.state()
        g, sp = self._green, self.split
        return {
            "partition": st.mode,
            "partition_available": st.available,
            "prefill_sms": st.prefill_sms,
            "decode_sms": st.decode_sms,
            "cost_model_mape": None if g is None else g.cost_model_mape(),
            # per kind: mape_prefill/decode_concurrent (splits), mape_chunked_step, ...
            "cost_model_errors": None if g is None else g.cost_model_errors(),
            "partition_disabled_splits": len(st.disabled_splits),
            "pd_split_prefills": 0 if sp is None else sp.num_split_prefills,
            "pd_layer_sliced_prefills": 0 if sp is None else sp.num_layer_sliced_prefills,
            "pd_sub_layer_sliced_prefills": 0 if sp is None else sp.num_sub_layer_sliced_prefills,
            "pd_overlapped_decode_steps": 0 if sp is None else sp.num_overlapped_decode_steps,
        }

    def prefill_backlog_s(self) -> float:
        """Predicted seconds of prefill work queued now (JCT model over the waiting requests
        and unfinished prefills): a routing signal for replicas."""
        return sum(self.jct_model.predict_s(u, c) for u, c in self.scheduler.prefill_backlog())

    def _publish_stats(self) -> None:
        with self._lock:
            self._publish_stats_locked()

    def _publish_counts(self) -> None:
        """Refresh the snapshot's queue and KV counts before a launch with prefill, the rest
        left as last rebuilt (a rebuild costs up to milliseconds with a long queue; this, a
        few microseconds): such a step may run for seconds (a long prompt on the H200, a
        minute on a CPU), and a snapshot from before it would show neither its requests
        running nor their KV for that long."""
        s, snap = self.scheduler, self._stats
        num_used = self.block_manager.num_used_blocks
        if (s.num_running, s.num_waiting, num_used) == (
            snap.get("num_running"),
            snap.get("num_waiting"),
            snap.get("kv_blocks_used"),
        ):
            return
        with self._lock:
            snap.update(
                num_running=s.num_running, num_waiting=s.num_waiting, kv_blocks_used=num_used
            )

    def _publish_stats_locked(self) -> None:
        """Rebuild the snapshot (caller holds the lock or is the engine thread before it
        starts). Not per step: at most every STATS_INTERVAL_S, and when going idle."""
        bm = self.block_manager
        cache = bm.prefix_cache
        s = self.scheduler
        step_s = self._step_started_s
        snap = {
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "num_held": s.num_held,
            "num_steps_in_flight": self.executor.num_in_flight,
            "step_running_s": None if step_s is None else time.monotonic() - step_s,
            "executor": self.executor.name,
            "overlap_scheduling": self._max_in_flight > 0,
            # Steps in flight answered before a gated long prefill's launch (the host trails it).
            "num_drains_before_held_launch": self._num_drains_before_held_launch,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_block_size": bm.block_size,
            "prefix_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_query_tokens": cache.query_tokens if cache else 0,
            "prefix_cached_blocks": len(cache) if cache else 0,
            "policy": self.policy.name,
            # SRJF's offset (s/s; with --ttft-slo-ms the one it derived) and the SLO behind it.
            "fairness_lambda": getattr(self.policy, "fairness_lambda", None),
            "ttft_slo_ms": self.config.ttft_slo_ms,
            "prefill_token_budget": self.serial.prefill_token_budget,
            "mixed_step_token_budget": self.serial.mixed_step_token_budget,
            "chunk_fixed_share": self._chunk_fixed_share,
            "prefill_chunk_tokens": self.config.chunk_tokens(),
            "tbt_slo_ms": None if self._tbt_s is None else self._tbt_s * 1e3,
            # the JCT model's per-token and per-pair terms as mixed steps correct them
            "tbt_cost_token_scale": self._prefill_cost.token_scale,
            "tbt_cost_pair_scale": self._prefill_cost.pair_scale,
            "tbt_cost_offset_ms": self._prefill_cost.offset_s * 1e3,
            # per 1,000 cached tokens of the prefill parts (held near 0 while the fit cannot
            # tell it)
            "tbt_cost_context_ms_per_1k": self._prefill_cost.context_s_per_token * 1e6,
            "tbt_tail_factor": self._tbt_tail.factor,
            # auto's layer slices' own tail (None until measured: they use the chunks' aim)
            "slice_tail_factor": self._slice_tail.factor if self._slice_tail.measured else None,
            **self._gc.take_window(),
            "kernels_compiled_while_serving": self._compiles.compiled_since_mark(),
            "prefill_graphs": self._prefill_graphs_summary,
            "prefill_warm_up_s": self.prefill_warm_up_s,
            "num_mixed_steps": self._num_mixed_steps,
            "num_mixed_steps_over_tbt": self._num_mixed_steps_over_tbt,
            **_quantiles("mixed_step_ratio", self._mixed_step_ratios, (50, 90, 99)),
            **self._partition_stats(),
            "num_steps": s.num_steps,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "num_preemptions": s.num_preemptions,
            "num_shared_prefix_waits": s.num_shared_prefix_waits,
            "num_chunked_scoring": s.num_chunked_scoring,
            "num_failed_steps": self._num_failed_steps,
            "num_failed_requests": self._num_failed_requests,
            # Steps stopped part-way because their requests were all aborted (or shutdown's
            # grace ran out), a split's prefills abandoned in flight included.
            "num_interrupted_steps": self._num_interrupted_steps
            + (self.split.num_abandoned_prefills if self.split is not None else 0),
            "fallbacks": fallbacks.taken(),
            "decode_device_s": self._decode_device_s,
            "decode_idle_s": self._decode_idle_s,
            "num_decode_steps": self._num_decode_steps,
            "prefill_backlog_s": self.prefill_backlog_s(),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "model": self.config.model,
            "max_model_len": self._max_model_len,
            "jct_mape": self.jct_model.mape(),  # None until prefill steps were observed
            "jct_num_observed": self.jct_model.num_observed,
            "jct_source": self.jct_model.source,
            "alive": self._crashed is None,
        }
        pending = {k: self._stats.get(k) for k in ("policy", *PREFILL_LIMITS)}
        self._stats = snap
        # A change still in the inbox: show what was asked for, not what it replaces.
        if any(k == "policy" for k, _ in self._inbox) and pending["policy"] is not None:
            self._stats["policy"] = pending["policy"]
        if any(k == "prefill_limits" for k, _ in self._inbox):
            for k in PREFILL_LIMITS:
                self._stats[k] = pending[k]
        self._next_stats_s = time.monotonic() + STATS_INTERVAL_S


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _quantiles(name: str, values: deque[float], percents: tuple[int, ...]) -> dict[str, Any]:
    """`{name}_p{q}` for each percent (nearest rank; None while empty). Sorts a bounded
    window: called at the stats rate, not per step."""
    xs = sorted(values)
    return {
        f"{name}_p{q}": xs[min(len(xs) - 1, (q * len(xs)) // 100)] if xs else None for q in percents
    }


def _failed_output(
    req: Request, error: str, status: RequestStatus = RequestStatus.FINISHED_ERROR
) -> EngineOutput:
    req.status = status
    req.error = error
    req.finish_s = time.monotonic()
    return EngineOutput(
        request_id=req.request_id,
        finished=True,
        finish_reason=FINISH_REASONS[status],
        error=error,
        num_prompt_tokens=req.num_prompt_tokens,
        e2e_s=req.finish_s - req.arrival_s,
    )
