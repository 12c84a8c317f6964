"""`Engine`: the background thread that owns all model work.

The app calls `add`, `abort`, `set_policy`, `stats` from any thread; they only touch a locked
inbox (or a published stats snapshot). The engine thread loops:
    drain inbox (add / abort / policy / failures) -> wait if idle ->
    plan = scheduler.schedule() -> out = runner.run(plan) -> outputs = scheduler.update(plan, out)
    -> sink(output) for each output
The sink is called on the engine thread; it must not block (the app hops to its event loop).

Partitioning: `engine.partition` is a `runtime.partition.PartitionManager`. On CUDA with green
contexts it is a `GreenContextPartition` (pairs pre-created at start-up, whatever the initial
mode, so the admin page can switch at run time); elsewhere an `UnavailablePartition` that says
why. While its mode is not `off` the loop runs `runtime.pd_loop.PDLoop` (prefill and decode
concurrently on a pair of SM partitions, or time-sliced when the controller predicts that is
faster); `off` is the monolithic step below. Mode changes from other threads reach the engine
thread through the inbox.

Failure containment: when a batched step raises, its requests are re-run one by one; only those
that fail alone finish with FINISHED_ERROR (their KV is freed), and the loop keeps serving the
others. Invalid requests
(empty prompt, ids outside the vocabulary, too long) are failed one by one at `add`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from policies import make_policy
from policies.jct import JCTModel
from runtime.attention.base import AttentionBackend
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.blas_sm_target import shared_blas_sm_target
from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.kv_pool import (
    CUDA_SAFETY_BYTES,
    NUM_RESERVED_BLOCKS,
    KVPool,
    bytes_per_block,
    compute_num_blocks,
    cuda_memory_budget_bytes,
)
from runtime.loader import load_model
from runtime.partition import PartitionManager
from runtime.partition_setup import capture_split_graphs, make_partition, profile_at_startup
from runtime.pd_loop import CudaStreamDevice, PDLoop, SplitChoice, StepFailed
from runtime.prefix_cache import PrefixCache
from runtime.request import FINISH_REASONS, Request, RequestKind, RequestOutput, RequestStatus
from runtime.runner import ModelRunner, profile_activation_peak
from runtime.scheduler import ScheduledSeq, Scheduler, StepPlan

log = logging.getLogger("greenlane.engine")

Sink = Callable[[RequestOutput], None]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
    if want == "torch" or (want == "auto" and pool.device.type != "cuda"):
        return TorchAttentionBackend(pool)
    if pool.device.type != "cuda":
        log.warning("attention backend flashinfer needs CUDA; falling back to torch SDPA")
        return TorchAttentionBackend(pool)
    try:  # the GPU runtime provides this module; absent or broken -> the torch fallback
        from runtime.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend.from_pool(pool, num_q_heads)
    except Exception as e:  # noqa: BLE001 - any import/init failure means "cannot use it"
        log.warning("FlashInfer attention unavailable (%s); falling back to torch SDPA", e)
        return TorchAttentionBackend(pool)


class Engine:
    def __init__(self, config: EngineConfig, sink: Sink) -> None:
        self.config = config
        self._sink = sink
        self.device, self.dtype = resolve_device_dtype(config)
        # What this process's allocator held before this engine: --max-gpu-memory-gb caps
        # this engine alone, also beside another engine in the same process (benchmarks).
        self._reserved_at_start = (
            torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        )
        torch.manual_seed(config.seed)
        model, model_config, tokenizer = load_model(
            config.model, self.dtype, self.device, seed=config.seed
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
        activation_bytes = None
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            try:
                activation_bytes = self._measure_activation_reserve()
            except Exception as e:  # noqa: BLE001 - fall back to the estimate, and say so
                log.warning(
                    "could not measure the activation peak (%s: %s); FALLBACK: sizing the KV "
                    "pool with the estimated activation reserve",
                    type(e).__name__,
                    e,
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
        self.backend = make_attention_backend(config, self.kv_pool, model_config.num_q_heads)
        cache = PrefixCache(config.block_size) if config.enable_prefix_cache else None
        self.block_manager = BlockManager(num_blocks, config.block_size, cache)
        # One JCT model for the engine's life: switching policies keeps what it learned.
        self.jct_model = (
            JCTModel.load(config.jct_calibration) if config.jct_calibration else JCTModel()
        )
        self.policy = self._make_policy(config.prefill_policy)
        self.scheduler = Scheduler(
            config, self.block_manager, self.policy, tokenizer, model_config.eos_token_ids
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
        )
        self.pd: PDLoop | None = None
        self._pd_active = False  # the last step ran in the PD loop (stream fencing on switch)
        if self._green is not None and self._partition_choice.action == "profile":
            self._profile_partition()
        if self._green is not None:
            capture_split_graphs(
                self.runner, self._green, shared_blas_sm_target(config.split_gemm_sm_target)
            )
            self.pd = PDLoop(
                self.scheduler,
                self.runner,
                CudaStreamDevice(shared_blas_sm_target(config.split_gemm_sm_target)),
                self._choose_split,
                self._green.observe,
                slice_tokens=config.pd_slice_tokens,
                max_queued_slices=config.pd_max_queued_slices,
                chunk_tokens=config.prefill_chunk_tokens if config.hybrid_prefill else None,
                split_usable=lambda sms: sms not in self._green.disabled,
            )

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._accepting = True
        self._stop_deadline_s: float | None = None  # set by shutdown
        self._thread: threading.Thread | None = None
        self._crashed: BaseException | None = None
        self._num_failed_steps = 0
        self._num_failed_requests = 0  # requests failed by a model error (not by input)
        self._stats: dict[str, Any] = {}
        if self._green is not None:
            self._green.submit = self._submit_call
        self._publish_stats()

    # ---- partition ------------------------------------------------------------------------
    def _make_partition(self) -> PartitionManager:
        """GreenContextPartition on CUDA with green contexts (any mode), else an
        UnavailablePartition that says why (runtime/partition_setup.py)."""
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

    def _choose_split(self, pplan: StepPlan | None, dplan: StepPlan | None) -> SplitChoice:
        """The controller's split for the next prefill batch (or decode-only step)."""
        from runtime.cost_model import DecodeShape, PrefillShape

        g = self._green
        num_layers = self.model_config.num_layers
        p = (
            None
            if pplan is None
            else PrefillShape.from_seqs(
                [(s.num_context_tokens, s.num_new_tokens) for s in pplan.prefill], num_layers
            )
        )
        d = (
            None
            if dplan is None
            else DecodeShape(
                len(dplan.decode), sum(s.num_context_tokens for s in dplan.decode), num_layers
            )
        )
        bm = self.block_manager
        g.decide(p, d, bm.num_used_blocks / max(bm.num_blocks, 1))
        sc = g.streams()
        total = g.layout.total_sms
        decode_sms = total - sc.prefill_sms if sc.prefill_sms else total
        layers = g.layers_per_slice if not sc.prefill_sms and pplan is not None else None
        return SplitChoice(
            sc.prefill_sms, decode_sms, sc.prefill_stream, sc.decode_stream, layers_per_slice=layers
        )

    def _measure_activation_reserve(self) -> int:
        """Activation bytes to keep free beside the KV pool, measured, not guessed: two
        dry-run prefills (the step budget and twice it) give a fixed part and a per-token
        slope; the reserve covers the larger of one budget-sized step and the longest
        scoring prompt (`max_score_tokens`, which runs alone with hybrid prefill)."""
        cfg, mc = self.config, self.model_config

        def backend_for(pool: KVPool) -> AttentionBackend:
            return make_attention_backend(cfg, pool, mc.num_q_heads)

        n1 = max(1, min(cfg.prefill_token_budget, self._max_model_len))
        n2 = max(n1 + 1, min(2 * n1, self._max_model_len))
        p1 = profile_activation_peak(cfg, self.model, mc, n1, backend_for)
        p2 = profile_activation_peak(cfg, self.model, mc, n2, backend_for)
        slope = max(0.0, (p2 - p1) / (n2 - n1))  # bytes per extra prompt token
        fixed = max(0.0, p1 - slope * n1)
        if cfg.max_score_tokens is None and slope > 0:
            self._fit_max_score_tokens(fixed, slope, n1)
        reserve = int(max(p1, fixed + slope * self._max_score_tokens))
        log.info(
            "activation peak measured: %.2f GiB at %d tokens, %.1f KiB/token; reserving "
            "%.2f GiB (scoring prompts up to %d tokens)",
            p1 / 2**30,
            n1,
            slope / 1024,
            reserve / 2**30,
            self._max_score_tokens,
        )
        return reserve

    def _fit_max_score_tokens(self, fixed: float, slope: float, floor_tokens: int) -> None:
        """Without --max-score-tokens the longest scoring prompt defaults to max_model_len; if
        reserving its activations would leave the KV pool unable to hold one max_model_len
        sequence, lower it to what fits (never below one step's budget) and say so, rather
        than refusing to start."""
        mc, bs = self.model_config, self.config.block_size
        min_pool = (-(-self._max_model_len // bs) + NUM_RESERVED_BLOCKS) * bytes_per_block(
            mc, bs, self.dtype
        )
        budget = cuda_memory_budget_bytes(self.config, self.device, self._reserved_at_start)
        room = budget - min_pool - CUDA_SAFETY_BYTES
        fits = int((room - fixed) // slope) // bs * bs
        if fits >= self._max_score_tokens:
            return
        new = max(floor_tokens, fits)
        log.warning(
            "scoring prompts limited to %d tokens (not %d): the activations of a longer one "
            "would leave too little memory for the KV cache; set --max-score-tokens to choose",
            new,
            self._max_score_tokens,
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

    # ---- thread-safe API ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="greenlane-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._crashed is None

    def add(self, req: Request) -> None:
        """Queue a request. Invalid or late requests get a final error/abort output."""
        try:
            error = self.validate(req)
        except Exception as e:  # noqa: BLE001 - malformed input must fail only this request
            error = f"invalid request: {type(e).__name__}: {e}"
        with self._lock:
            if error is None and not self._accepting:
                error = "the engine is shutting down"
            started = self._thread is not None
            if not self._accepting or (started and not self._thread.is_alive()):  # type: ignore[union-attr]
                deliver_now = True  # shutting down, or the loop has exited (crash)
            else:
                deliver_now = False
                self._inbox.append(("add", req) if error is None else ("fail", (req, error)))
                self._wakeup.notify()
        if deliver_now:
            self._emit(self._failed_output(req, error or "the engine is not running"))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wakeup.notify()

    def set_policy(self, name: str) -> None:
        """Switch the prefill policy (ValueError for an unknown name, raised here)."""
        policy = self._make_policy(name)
        with self._lock:
            self._inbox.append(("policy", policy))
            self._stats["policy"] = policy.name
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
        )

    @property
    def device_name(self) -> str:
        """Human-readable device name (keys calibration files)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

    def measure_prefill(self, uncached_tokens: int, cached_tokens: int) -> float:
        """Seconds of one real prefill of `uncached_tokens` new tokens after `cached_tokens`
        of context already in the pool (runtime.calibrate's `measure`). Call before `start()`
        (the engine thread must not be running). The new tokens' KV is discarded (as for a
        scoring request), so only the context needs pool blocks; the context's KV values are
        whatever the pool holds, which does not change the timing."""
        if self._thread is not None:
            raise RuntimeError("measure_prefill must run before the engine thread starts")
        rid = "__measure_prefill__"
        blocks = self.block_manager.allocate(rid, self.block_manager.num_blocks_for(cached_tokens))
        try:
            req = Request(
                rid, RequestKind.SCORE, [0] * (cached_tokens + uncached_tokens), label_token_ids=[0]
            )
            seq = ScheduledSeq(
                request=req,
                num_context_tokens=cached_tokens,
                num_new_tokens=uncached_tokens,
                num_kept_tokens=cached_tokens,
                block_ids=list(blocks),
                input_ids=[0] * uncached_tokens,
                needs_output=True,
            )
            plan = StepPlan(step_id=-1, prefill=[seq])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.runner.run(plan)  # ends in .tolist(): synchronised
            return time.perf_counter() - t0
        finally:
            self.block_manager.free(rid)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

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
        if max_tokens < 1:
            return f"max_tokens must be >= 1, got {max_tokens}"
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
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while (
                        not self._inbox
                        and not self.scheduler.has_work()
                        and self._stop_deadline_s is None
                    ):
                        self._wakeup.wait()
                    items = list(self._inbox)
                    self._inbox.clear()
                    deadline = self._stop_deadline_s
                for kind, payload in items:
                    self._handle(kind, payload)
                if deadline is not None and (
                    time.monotonic() >= deadline or not self.scheduler.has_work()
                ):
                    self._abort_everything()
                    self._publish_stats()
                    return
                outputs = self._step() if self.scheduler.has_work() else []
                # Publish before emitting: whoever sees a final output then sees stats that
                # already reflect it (blocks freed, counters updated).
                self._publish_stats()
                self._emit_all(outputs)
        except BaseException as e:  # a bug outside step containment: say so, stop serving
            self._crashed = e
            log.exception("engine loop crashed")
            raise

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            req: Request = payload
            if self.scheduler.get(req.request_id) is not None:
                self._emit(self._failed_output(req, f"duplicate request id {req.request_id!r}"))
                return
            self.scheduler.add(req)
        elif kind == "fail":
            req, error = payload
            self._emit(self._failed_output(req, error))
        elif kind == "abort":
            out = self.scheduler.abort(payload)
            if out is not None:
                self.runner.release(payload)
                self._emit(out)
        elif kind == "policy":
            self.policy = payload
            self.scheduler.set_policy(payload)
        elif kind == "call":
            payload()
        elif kind == "reset_prefix_cache":
            num_dropped = self.block_manager.drop_cached_blocks()
            log.info("prefix cache reset: %d idle blocks dropped", num_dropped)

    def _step(self) -> list[RequestOutput]:
        """One loop iteration: the PD loop while partitioning is on (or a prefill of it is
        still in flight), else the monolithic step."""
        pd = self.pd
        if pd is not None and (self._green.mode != "off" or pd.busy):
            if not self._pd_active:
                pd.enter(self._main_stream())
            self._pd_active = True
            try:
                return pd.step()
            except StepFailed as e:
                self._num_failed_steps += 1
                log.exception("split-mode step failed (%d requests)", len(e.plan.seqs))
                pd.fence(self._main_stream())
                self._pd_active = False  # the re-run below is monolithic
                failed_before = self._num_failed_requests
                outputs = self._rerun_one_by_one(e.plan)
                if self._num_failed_requests == failed_before and e.prefill_sms:
                    # Every request ran fine on the whole GPU: the split itself is broken
                    # (seen on the H200: cuBLAS failing on a 12-SM decode remainder). Never
                    # use it again rather than fail-and-re-run every step.
                    self._green.disable_split(
                        e.prefill_sms, f"work on it failed, then ran fine on the whole GPU: {e}"
                    )
                return outputs
        if pd is not None and self._pd_active:
            pd.fence(self._main_stream())
            self._pd_active = False
        return self._monolithic_step()

    def _main_stream(self) -> Any:
        """The stream monolithic steps run on: the engine thread's current CUDA stream (the
        PD loop's host stand-in on CPU, where tests drive split mode)."""
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device)
        assert self.pd is not None
        return self.pd.device.current_stream()

    def _monolithic_step(self) -> list[RequestOutput]:
        """One schedule -> run -> update; returns the outputs to emit."""
        plan: StepPlan | None = None
        try:
            plan = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - bookkeeping bug: fail everything queued
            log.exception("scheduling failed")
            ids = [r.request_id for r in self.scheduler.running + self.scheduler.waiting]
            return self.scheduler.fail(ids, f"internal scheduler error: {e!r}")
        outputs = self.scheduler.take_pending_outputs()
        if plan.is_empty:
            if not outputs:
                time.sleep(0.001)  # nothing runnable (should not happen): do not spin hot
            return outputs
        try:
            t0 = time.perf_counter()
            result = self.runner.run(plan)
            self._observe_prefill(plan, time.perf_counter() - t0)
            outputs += self.scheduler.update(plan, result)
        except Exception as e:  # noqa: BLE001 - contain it to the request at fault
            self._num_failed_steps += 1
            log.exception("model step failed (%d requests in the step)", len(plan.seqs))
            if len(plan.seqs) == 1:
                outputs += self._fail_seq(plan.seqs[0], e)
            else:
                outputs += self._rerun_one_by_one(plan)
        return outputs

    def _rerun_one_by_one(self, plan: StepPlan) -> list[RequestOutput]:
        """A batched step raised: run each of its requests alone, so only the one(s) at
        fault fail and their batch mates carry on. Re-running is safe: the failed step's
        partial KV writes go to the same slots and are overwritten."""
        outputs: list[RequestOutput] = []
        for seq in plan.seqs:
            is_prefill = seq in plan.prefill
            sub = StepPlan(
                step_id=plan.step_id,
                prefill=[seq] if is_prefill else [],
                decode=[] if is_prefill else [seq],
            )
            try:
                outputs += self.scheduler.update(sub, self.runner.run(sub))
            except Exception as e:  # noqa: BLE001 - this request is (one of) the culprits
                log.exception("request %s failed when run alone", seq.request.request_id)
                outputs += self._fail_seq(seq, e)
        return outputs

    def _fail_seq(self, seq: ScheduledSeq, e: Exception) -> list[RequestOutput]:
        self._num_failed_requests += 1
        msg = f"internal error while running the model: {type(e).__name__}: {e}"
        return self.scheduler.fail([seq.request.request_id], msg)

    def _observe_prefill(self, plan: StepPlan, measured_s: float) -> None:
        """Online JCT refinement: feed prefill-only steps to the policy's JCT model, if it
        has one (srjf). Mixed steps are skipped: their time includes decode work.
        Hazard: on CUDA the step time is only right if the runner synchronised (it does,
        through `.tolist()`, whenever the step produced outputs)."""
        jct = getattr(self.policy, "jct_model", None)
        if jct is None or plan.decode or not plan.prefill:
            return
        if not all(s.needs_output for s in plan.prefill):
            return  # a chunk that produced nothing was not synchronised on
        items = [(s.num_new_tokens, s.num_context_tokens) for s in plan.prefill]
        jct.observe_batch(items, measured_s)

    def _abort_everything(self) -> None:
        if self.pd is not None and self.pd.busy:
            try:  # let the device finish writing the in-flight prefill's KV first
                self._emit_all(self.pd.drain())
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("draining the in-flight prefill failed")
        ids = [r.request_id for r in self.scheduler.running + self.scheduler.waiting]
        for rid in ids:
            out = self.scheduler.abort(rid)
            if out is not None:
                self._emit(out)
        with self._lock:  # anything that arrived meanwhile
            items = list(self._inbox)
            self._inbox.clear()
        for kind, payload in items:
            if kind in ("add", "fail"):
                req = payload if kind == "add" else payload[0]
                self._emit(
                    self._failed_output(
                        req, "the engine is shutting down", RequestStatus.FINISHED_ABORTED
                    )
                )

    def _emit_all(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self._emit(o)

    def _emit(self, out: RequestOutput) -> None:
        if out.finished:
            self.runner.release(out.request_id)
        try:
            self._sink(out)
        except Exception:  # noqa: BLE001 - a broken sink must not kill the engine
            log.exception("output sink raised for request %s", out.request_id)

    @staticmethod
    def _failed_output(
        req: Request, error: str, status: RequestStatus = RequestStatus.FINISHED_ERROR
    ) -> RequestOutput:
        req.status = status
        req.error = error
        req.finish_s = time.monotonic()
        return RequestOutput(
            request_id=req.request_id,
            finished=True,
            finish_reason=FINISH_REASONS[status],
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
            e2e_s=req.finish_s - req.arrival_s,
        )

    def _partition_stats(self) -> dict[str, Any]:
        st = self.partition.state()
        g = self._green
        return {
            "partition": st.mode,
            "partition_available": st.available,
            "prefill_sms": st.prefill_sms,
            "decode_sms": st.decode_sms,
            "cost_model_mape": None if g is None else g.cost_model_mape(),
            "partition_disabled_splits": len(st.disabled_splits),
            "pd_split_prefills": 0 if self.pd is None else self.pd.num_split_prefills,
            "pd_layer_sliced_prefills": 0 if self.pd is None else self.pd.num_layer_sliced_prefills,
            "pd_overlapped_decode_steps": (
                0 if self.pd is None else self.pd.num_overlapped_decode_steps
            ),
        }

    def _publish_stats(self) -> None:
        bm = self.block_manager
        cache = bm.prefix_cache
        s = self.scheduler
        snap = {
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_block_size": bm.block_size,
            "prefix_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_query_tokens": cache.query_tokens if cache else 0,
            "prefix_cached_blocks": len(cache) if cache else 0,
            "policy": self.policy.name,
            **self._partition_stats(),
            "num_steps": s.num_steps,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "num_preemptions": s.num_preemptions,
            "num_shared_prefix_waits": s.num_shared_prefix_waits,
            "num_failed_steps": self._num_failed_steps,
            "num_failed_requests": self._num_failed_requests,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            "model": self.config.model,
            "max_model_len": self._max_model_len,
            "jct_mape": self.jct_model.mape(),  # None until prefill steps were observed
            "jct_num_observed": self.jct_model.num_observed,
            "jct_source": self.jct_model.source,
        }
        with self._lock:
            policy_pending = self._stats.get("policy")
            self._stats = snap
            if policy_pending is not None and any(k == "policy" for k, _ in self._inbox):
                self._stats["policy"] = policy_pending
