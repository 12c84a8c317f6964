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
cut the queue's head prefill into chunks sized to the target; its chunk is then the step's
prefill token cap. How much prefill a step takes beside the decodes, and where it runs, is the
pacer's (`engine.pacer`, runtime/partition/pacing.py: the TBT cut and auto's controller, fed
every applied step). Switching executors drains the old one first. `engine.partition` is a
`runtime.partition.PartitionManager` (`UnavailablePartition` off CUDA, saying why).

Start-up (runtime/startup.py): the hybrid chunk, the activation reserve and the longest scoring
prompt are sized before the KV pool; the warm-ups run last, through `measure_prefill`.

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
from runtime import startup
from runtime.attention.base import AttentionBackend
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.config import PREFILL_WARM_UP_TOKENS, EngineConfig, check_prefill_limits
from runtime.diagnostics import fallbacks
from runtime.diagnostics.compile_watch import CompileWatch, triton_kernels
from runtime.diagnostics.gc_watch import GcWatch, untrack_int_list
from runtime.diagnostics.profiling import StepProfile
from runtime.executor.base import StepFailed, StepInterrupted, StepResult
from runtime.executor.serial import SerialExecutor
from runtime.executor.split import SplitExecutor
from runtime.executor.streams import stream_device_for
from runtime.kv.block_manager import BlockManager
from runtime.kv.kv_pool import KVPool, bytes_per_block, compute_num_blocks
from runtime.kv.prefix_cache import PrefixCache
from runtime.model.loader import load_model
from runtime.partition import PartitionManager
from runtime.partition.pacing import StepPacer
from runtime.partition.setup import capture_split_graphs, make_partition, profile_at_startup
from runtime.request import FINISH_REASONS, EngineOutput, Request, RequestKind, RequestStatus
from runtime.runner import ModelRunner
from runtime.sampling.structured import GrammarMasks, grammar_conflict
from runtime.scheduler import ScheduledSeq, Scheduler, StepPlan

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
    # used (`StepPacer.decode_base_s`: the cost model's decode for the batch when calibrated,
    # else the decode-only average), else None. What a replay of the correction needs to be
    # the engine's (`bench.step_fit`).
    "decode_base_ms",
    # Host time (ms, the engine thread's wall clock) that planned this step (capacity,
    # `StepPacer.auto_capacity`'s decision, `schedule`) and that enqueued it
    # (`executor.launch`). A step whose device_ms is near its launch_ms ran at the pace its
    # host launched it, not at the device's; None for a result that is not its launch's first
    # (a split launch returns its prefill and decode parts separately).
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
    # what the slices' tail factor reads (`StepPacer.slice_tail`).
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
        fallbacks.clear()  # this engine's own (runtime/diagnostics/fallbacks.py)
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

        # Start-up memory sizing (runtime/startup.py).
        self._max_score_tokens = min(config.max_score_tokens or limit, limit)
        if config.prefill_chunk_tokens is None and self.device.type == "cuda":
            # Sized before anything reads it: the dry runs below reserve its peak, the runner
            # and the executors chunk with it.
            chunk = startup.size_prefill_chunk(
                config, model_config, self.device, self.dtype, self._reserved_at_start
            )
            self.config = config = dataclasses.replace(config, prefill_chunk_tokens=chunk)
        activation_bytes = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            sizing = startup.MemorySizing(
                config,
                model_config,
                self.device,
                self.dtype,
                self._reserved_at_start,
                self._max_model_len,
                self._max_score_tokens,
            )

            def backend_for(pool: KVPool) -> AttentionBackend:
                return make_attention_backend(config, pool, model_config.num_q_heads)

            try:
                activation_bytes = sizing.activation_reserve(model, backend_for)
            except Exception as e:  # noqa: BLE001 - fall back to the estimate, and say so
                fallbacks.take(
                    "activation peak",
                    e,
                    "sizing the KV pool with the estimated activation reserve",
                    log,
                    failed="could not measure the activation peak",
                )
                torch.cuda.empty_cache()
            # Lowered to what the reserve leaves room for (`fit_max_score_tokens`), if it was.
            self._max_score_tokens = sizing.max_score_tokens
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
        # How much prefill each step takes beside the decodes and where it runs (the TBT cut,
        # auto's controller), and what it learns from the steps that ran.
        self.pacer = StepPacer(
            config,
            self.scheduler,
            self.block_manager,
            self.serial,
            self.runner,
            self._green,
            self.jct_model,
            model_config.num_layers,
            self._max_score_tokens,
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
                self.pacer.choose_split,
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
        # step_id -> host ms (planning, launching), the launch's parts and detail
        # (`Executor.launch_parts_ms`, `launch_detail`) until the step's first result is traced
        self._host_ms: dict[
            int, tuple[float, float, dict[str, float] | None, dict[str, Any] | None]
        ] = {}
        self._step_started_s: float | None = None  # engine clock at the current step's start
        self._stats: dict[str, Any] = {}
        self._next_stats_s = 0.0
        if self._green is not None:
            self._green.submit = self._submit_call
            self.pacer.share_prefill_model()
        self.prefill_warm_up_s: float | None = None
        warm_up_tokens = config.prefill_warm_up_tokens
        if warm_up_tokens is None:
            warm_up_tokens = PREFILL_WARM_UP_TOKENS if self.device.type == "cuda" else 0
        if warm_up_tokens:
            # At most the longest scoring prompt (runtime/startup.py).
            self.prefill_warm_up_s = startup.warm_up_prefill(
                min(warm_up_tokens, self._max_score_tokens),
                self.measure_prefill,
                self.measure_prefill_batch,
                lambda: startup.warm_up_forms(self.config, self.block_manager, self._max_model_len),
                self.device,
            )
        self._publish_stats()

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
                # step loop standing still (runtime/diagnostics/gc_watch.py).
                untrack_int_list(req.prompt_token_ids)
                untrack_int_list(req.block_hashes)
                if req.sampling.grammar is not None and self.runner.grammars is not None:
                    # Compiled here, not on the engine thread (runtime/sampling/structured.py).
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

    def measure_prefill(self, uncached_tokens: int, cached_tokens: int) -> float:
        """Seconds of one real prefill of `uncached_tokens` new tokens after `cached_tokens`
        of context already in the pool (runtime.calibrate's `measure`), on the attention path
        a served scoring request of that shape takes (`measure_prefill_batch`, `keep_kv=None`)."""
        return self.measure_prefill_batch([(uncached_tokens, cached_tokens)])

    def served_keeps_kv(self, items: list[tuple[int, int]], share_context: bool = False) -> bool:
        """Whether served scoring requests of these (uncached, cached) shapes would keep their
        new tokens' KV in this engine's pool as it is now (runtime/startup.py
        `served_keeps_kv`)."""
        return startup.served_keeps_kv(self.block_manager, items, share_context)

    def measure_prefill_batch(
        self,
        items: list[tuple[int, int]],
        *,
        keep_kv: bool | None = None,
        share_context: bool = False,
        device_s_out: list[float] | None = None,
    ) -> float:
        """Seconds of one real prefill step over several sequences, (uncached, cached) tokens
        each, through the serving runner (the JCT profiles: runtime/calibrate.py,
        bench/prefill_profile.py; `keep_kv`, `share_context`, `device_s_out`: runtime/startup.py
        `measure_prefill_batch`). Call before `start()` (the engine thread must not be
        running)."""
        if self._thread is not None:
            raise RuntimeError("measure_prefill must run before the engine thread starts")
        return startup.measure_prefill_batch(
            self.runner,
            self.block_manager,
            self.stream_device,
            self.device,
            items,
            keep_kv=keep_kv,
            share_context=share_context,
            device_s_out=device_s_out,
        )

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
        summary (runtime.diagnostics.profiling.summarize_kernels, plus the steps by kind); the
        chrome trace goes to `trace_path` when given. Blocks the calling thread (never the engine's)
        until the steps are done or `timeout_s` passed: then what was recorded, `timed_out` true.
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
            self.pacer.set_targets(tbt_ms, share)
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
                capacity = self.pacer.auto_capacity(capacity)
            elif self.pacer.tbt_s is not None and ex.name == "serial":
                capacity = self.pacer.tbt_cut(capacity)
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
        """Online JCT refinement from prefill-only steps (device time from events), what the
        step teaches the pacer (the TBT cut's correction and tails, a chunked step's
        prediction scored) and the decode step / idle counters. Steps that ran on a split's
        partition teach neither the JCT model nor the decode step average: both model the
        whole GPU (they size auto's and the scheduler's chunks), and a split's partition is
        slower."""
        plan = result.plan
        whole = not result.on_split
        pacer = self.pacer
        serial_running = self.executor is self.serial
        chunked_ms, head_ms = pacer.take_chunked_prediction(result)
        if result.device_s is not None and result.is_prefill_only and whole:
            # Whatever the policy and executor: SRJF reads this model, and so does the
            # prefill-backlog estimate replicas report for routing.
            self.jct_model.observe_batch(
                [(s.num_new_tokens, s.num_context_tokens) for s in plan.prefill],
                result.device_s,
            )
        predicted_step_s, base = pacer.observe_step(result, serial_running)
        self._trace(
            result, predicted_step_s, chunked_ms, base if predicted_step_s else None, head_ms
        )
        # Decode-only steps: a step with prefill work is not a decode step's time.
        decode_only = bool(plan.decode) and not plan.prefill
        if decode_only and result.device_s is not None:
            self._decode_device_s += result.device_s
            self._num_decode_steps += 1
            pacer.observe_decode_only(plan, result.device_s, whole, serial_running)
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
        pacer = self.pacer
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
            "chunk_fixed_share": pacer.chunk_fixed_share,
            "prefill_chunk_tokens": self.config.chunk_tokens(),
            "tbt_slo_ms": None if pacer.tbt_s is None else pacer.tbt_s * 1e3,
            # the JCT model's per-token and per-pair terms as mixed steps correct them
            "tbt_cost_token_scale": pacer.prefill_cost.token_scale,
            "tbt_cost_pair_scale": pacer.prefill_cost.pair_scale,
            "tbt_cost_offset_ms": pacer.prefill_cost.offset_s * 1e3,
            # per 1,000 cached tokens of the prefill parts (held near 0 while the fit cannot
            # tell it)
            "tbt_cost_context_ms_per_1k": pacer.prefill_cost.context_s_per_token * 1e6,
            "tbt_tail_factor": pacer.tbt_tail.factor,
            # auto's layer slices' own tail (None until measured: they use the chunks' aim)
            "slice_tail_factor": pacer.slice_tail.factor if pacer.slice_tail.measured else None,
            **self._gc.take_window(),
            "kernels_compiled_while_serving": self._compiles.compiled_since_mark(),
            "prefill_graphs": self._prefill_graphs_summary,
            "prefill_warm_up_s": self.prefill_warm_up_s,
            "num_mixed_steps": pacer.num_mixed_steps,
            "num_mixed_steps_over_tbt": pacer.num_mixed_steps_over_tbt,
            **_quantiles("mixed_step_ratio", pacer.mixed_step_ratios, (50, 90, 99)),
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
