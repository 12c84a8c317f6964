"""Engine configuration: plain frozen dataclasses. `app/settings.py` builds these from CLI/env."""

from __future__ import annotations

from dataclasses import dataclass

# `prefill_warm_up_tokens` when left to auto on CUDA: the 16k-token prompt it was measured with.
PREFILL_WARM_UP_TOKENS = 16384
# `prefill_chunk_tokens` when left to auto and not sized by the engine from the GPU's memory
# (`runtime.kv.kv_pool.auto_prefill_chunk_tokens`): on the CPU, and in parts built without an
# engine.
PREFILL_CHUNK_TOKENS_UNSIZED = 2048

# Hybrid prefill's chunk when left to auto on CUDA (`runtime.kv.kv_pool.auto_prefill_chunk_tokens`): the largest
# of these whose MLP temporaries take at most CHUNK_MEMORY_SHARE of the memory the KV pool and
# the activations share. A larger chunk launches fewer kernels a layer (at 2,048 a cold 12-16k
# prompt filled the launch queue and held the engine thread for ~0.9 of the step) and runs
# fewer, larger GEMMs; what it costs is those temporaries, reserved at start-up, so KV. The
# share keeps the chunk small under a tight cap, where memory decides the longest prompt (an
# 8B shape in 24 GB: ~9 GiB shared, 4,096 takes 0.4 of it where 16,384 would take 1.6), and
# gives 16,384 wherever the pool is tens of GB (an 8B shape on an 80 GB GPU: ~3 % of it).
PREFILL_CHUNK_CHOICES = (16384, 8192, 4096, 2048)
CHUNK_MEMORY_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = (
        "default"  # "default" (SmolLM2-135M-Instruct), a HF-format folder, or "random:<preset>"
    )
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda if available else cpu
    seed: int = 0

    attention_backend: str = "auto"  # auto | torch | flashinfer
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = size from memory
    gpu_memory_utilization: float = 0.90
    max_gpu_memory_gb: float | None = None  # cap for the whole engine (weights + KV + activations)
    cpu_kv_cache_gb: float = 1.0  # KV pool size on CPU
    max_model_len: int | None = None  # None = the model's position limit
    # Longest scoring prompt to reserve activation memory for (CUDA). None = max_model_len.
    # A larger value leaves fewer KV blocks; prompts beyond it are refused with a 400.
    max_score_tokens: int | None = None

    max_num_seqs: int = 256  # running requests (decode batch) cap
    prefill_token_budget: int = 8192  # tokens per prefill step (short prompts batched up to this)
    # Tokens a step that carries decodes may take, decodes included; a TBT target (tbt_slo_ms,
    # or auto's) can only cut such a step shorter, and auto's chunks keep to it too: "auto"
    # (2048 on CUDA, none on CPU), "none" (prefill_token_budget alone) or a count
    # (`mixed_step_tokens`). Steps without decodes keep the whole budget (batching short
    # prompts; the activation reserve and hybrid prefill's forms follow that budget).
    # Why 2,048 on CUDA: `off`'s budget swept through HTTP on the H200 (1k / 2k / 4k / 8k,
    # 2026-12-04, docs/benchmarks.md "The fixed-budget baseline swept") read 8B long prompts
    # next to chat 9 / 12 / 5.25 / 4.5 max QPS and chat's P99 gap next to scoring 52 / 87 /
    # 155 / 261 ms (3B: 32 / 51 / 73 / 124) at the same scoring rate from 2k up: 8,192 beside
    # decodes was the worst of the four; 2,048 the best or next to it on every part (4k led
    # the 3B's long prompts with 8-s probes, tied with 16-s ones). Why none on CPU: there a
    # 2k-token step of SmolLM2-135M takes ~10 s, so a token cap sized for the H200 stalls more
    # streams, more often (an A/B on this 2-core CPU, docs/benchmarks-cpu.md: P99 gap 10.6x,
    # TTFT 0.62x); a TBT target (tbt_slo_ms) sizes steps by time on any device.
    mixed_step_token_budget: str = "auto"
    # Time-between-tokens target (ms) for every mode: in a step with decodes, the prefill
    # work (chunks, admissions) is cut so that its predicted time (the JCT model's marginal
    # cost) plus the recent decode step time stays within it. prefill_token_budget still caps
    # it; a prefill always gets at least MIN_TBT_CHUNK_TOKENS (progress even when the decodes
    # alone exceed the target). None: the token budget alone sizes prefill work.
    tbt_slo_ms: float | None = None
    # srjf-cold-fcfs: SRJF among mostly cached requests, cold ones in arrival order; it
    # sustained 1.69x / 1.14x FCFS's max QPS on the GPU against plain SRJF's 1.38x / 1.14x,
    # with a lower P99 in both repeats (docs/scheduling.md, "`srjf-cold-fcfs` on the GPU").
    prefill_policy: str = "srjf-cold-fcfs"  # policies.POLICY_NAMES
    fairness_lambda: float | None = None  # SRJF fairness offset (None = policy default)
    # The latency (queueing + prefill: a score's latency, a chat's time to first token) SRJF
    # should keep requests within; given, its fairness offset follows it (lambda = cold JCT /
    # (SLO - cold JCT), policies/srjf.py) instead of a fixed one. Exclusive with
    # fairness_lambda. None: the fixed offset.
    ttft_slo_ms: float | None = None
    spf_gamma: float | None = None  # SPF aging weight (None = policy default)
    # The JCT model's calibration: a calibration-<device>--<model>.json (its `jct` section) or
    # an old greenlane-jct/1 file (runtime/calibrate.py).
    jct_calibration: str | None = None

    hybrid_prefill: bool = True
    # C: token-wise ops of a prompt longer than C run in chunks of C tokens (memory: the
    # start-up dry runs reserve the peak at this C). Each chunk adds its own launches: a cold
    # 12-16k-token prompt at 2,048 enqueues more kernels than the launch queue holds, so the
    # engine thread waits on the device for ~0.9 of the step; at 16,384 it returns at once, a
    # token costs 6 % less device time and FCFS's mean latency fell 22-30 % at equal load
    # (H200 and H100, FCFS and SRJF, three repeats: docs/scheduling.md, "The prefill chunk
    # follows the memory"). None = auto: on CUDA the largest chunk whose MLP temporaries take
    # a small share of the memory (`auto_prefill_chunk_tokens`), so a tight cap keeps a small
    # one and its longest prompts; PREFILL_CHUNK_TOKENS_UNSIZED on the CPU.
    prefill_chunk_tokens: int | None = None
    enable_prefix_cache: bool = True
    # A waiting request whose next >= this many prompt tokens are being prefilled right now by
    # a running request (same per-user prefix, not cached yet) waits for them to be cached
    # instead of computing them a second time in the same batch. 0 = off.
    wait_for_shared_prefix_tokens: int = 256
    cuda_graphs: bool = True
    # Prefill parts of up to this many tokens on the whole GPU replay piecewise CUDA graphs
    # (runtime/graphs/prefill.py: the dense work per token bucket, attention eager between);
    # longer ones run eagerly. Needs cuda_graphs and FlashInfer. 0 = off. 1024: on the H200
    # (3B) a part of 16-512 tokens took 0.41-0.79x the eager wall time, 1024 a tie in
    # isolation (GPU-bound; in a busy server the eager host work is longer), 2048 1.07x.
    prefill_graph_max_tokens: int = 1024
    # From 256 tokens a part is padded to its bucket by at most this fraction (the buckets'
    # granule; runtime/graphs/prefill.py). Smaller: less padded compute in steps that mix a
    # short prompt with decodes, more graphs to capture at start-up. On the H200 (8B, 48 chat
    # streams through HTTP) 0.125 against 0.5 (the first ladder): merged steps 3.5 % cheaper,
    # tokens/s +2.2 % over 4 vs 6 runs, capture ~1 s instead of ~0.5 s.
    prefill_graph_padding: float = 0.125
    # RoPE on q and k and the K/V pool write in one Triton launch per layer
    # (runtime/attention/rope_kv_write.py) instead of three. auto: with the FlashInfer
    # backend; true: also with torch SDPA (without CUDA under Triton's interpreter: tests
    # only); false: never. On the H200 through HTTP it cut the decode ITL 7 % (Llama-3.1-8B
    # shape, 16 streams) and 8-9 % (Qwen2.5-3B shape, 48 streams), tied at batch 1.
    fused_rope_kv_write: str = "auto"
    # With the fused RoPE + K/V write, the prefill graphs run it inside their replays (from a
    # static slot buffer) and attention alone runs between them: one Python launch a layer
    # fewer in a graph-path step, which the host paced (py-spy, H100, 2026-12-05). Measured
    # on the H100 through HTTP (docs/benchmarks.md, "The prefill graphs write the KV"): a
    # prefill-only step's launch 4.7-4.9 ms against 7.3-9.4 at the same device time, scoring
    # latency P50 51-57 ms against 70 next to chat. auto: wherever the graphs and the fused
    # write run (CUDA, FlashInfer, a float32 RoPE cache); true: the same, saying so where it
    # cannot; false: the write between replays, as before.
    prefill_graphs_write_kv: str = "auto"
    # A step with prefill parts and decodes runs them as one forward (the weights read once)
    # instead of the prefill forward then the decode graph, when the merged rows fit a prefill
    # graph's bucket (on CUDA; the decode rows then ride in that graph) and no prefill part
    # discards its suffix KV. A first version that also merged steps too large for a bucket
    # ran those eagerly and lost (plan z, docs/benchmarks.md); this one won: 48 chat streams
    # on the Llama-3.1-8B shape through HTTP, 4771 / 4923 output tokens/s against 4583 for
    # separate forwards, against the same vLLM run (H200, 2026-12-02, docs/benchmarks.md).
    merge_mixed_steps: bool = True
    # Plan and launch step N+1 while the device runs step N (sampled tokens feed the next
    # step on the device; the host sees them one step later). False: one step at a time.
    # Even so, a prefill of at least INTERRUPT_GATE_MIN_TOKENS (runtime/runner.py) is launched
    # with nothing in flight: the abort gate holds the host within two layers of its end
    # (`ModelRunner.holds_host`). (`overlap_max_step_ms`, which launched any long prefill-only
    # step that way and collected it before planning the next, won nothing in two GPU
    # measurements and was removed in the forty-fifth session: docs/scheduling.md.)
    overlap_scheduling: bool = True
    # A long scoring prompt next to running decodes is prefilled in budget-sized chunks when
    # the KV pool can hold its whole prompt until it finishes (else whole, hybrid prefill).
    chunk_scoring_prefill: bool = True
    # Decode graphs of batches up to this size run the fused Triton decode kernels
    # (runtime/model/fused_decode.py; at most 64) instead of FlashInfer + cuBLAS. 0 = never.
    # Measured through HTTP on the H200 (docs/benchmarks.md): 0.82-0.89x the gap between
    # tokens at 4..64 streams (8B) and 48 (3B) against fused at batch 1 only. At most
    # runtime.model.decode_kernels.MAX_ROWS (not imported here: it needs triton).
    fused_decode_max_batch: int = 64
    # Decode attention's KV split in the FlashInfer decode graphs (batch sizes above
    # fused_decode_max_batch; runtime/attention/flashinfer_backend.py,
    # `prefer_one_chunk`): FlashInfer plans every graph's decode as split KV + a merge kernel a
    # layer. auto: one chunk a request (no merge) for the batch sizes where its split gives one
    # chunk anyway; always: its split everywhere; never: one chunk everywhere (tensor-core
    # decode only; diagnostics).
    decode_kv_split: str = "auto"
    # One discarded prefill of this many tokens at start-up, through the serving model runner
    # (`startup.warm_up_prefill`), so the first long prompt a user sends does not pay the
    # first-use costs of its shapes. Measured on the H200 (8B shape): a fresh server's first
    # 16k-token prompt took 0.57-0.61 s against 0.50 s after it, the extra time on the host
    # inside the step (cuBLAS's first GEMMs of that size, first elementwise kernels), and a
    # 16k warm-up (0.5 s at start-up) removed it. None = auto: PREFILL_WARM_UP_TOKENS on CUDA,
    # off on the CPU (where a long prefill takes minutes); 0 = off.
    prefill_warm_up_tokens: int | None = None
    partition: str = "off"  # off | static:<prefill_sms> | auto
    # Split controller (Nexus Alg. 1) and the split executor (runtime/executor/split.py).
    partition_kv_switch: float = 0.70  # KV usage where the favoured phase flips prefill -> decode
    partition_alpha: float = 1.3  # prefill slack when decode is favoured
    partition_beta: float = 1.1  # decode slack when prefill is favoured
    partition_hysteresis_sms: int = 8  # ignore split moves smaller than this
    partition_min_gain: float = 0.05  # a change must improve the objective by this fraction
    # Split only if predicted this much faster than time-slicing: the cost model's error
    # while serving was 9.3 % MAPE on the H200 (3B, plan s), so a split predicted 3 % faster
    # (what auto took for 98 scoring prompts there, at 0.44x the scoring rate) is a coin toss.
    partition_min_split_speedup: float = 1.1
    partition_allow_time_slice: bool = True  # auto may give every SM to one phase at a time
    partition_min_decode_sms: int | None = None  # None = the device's minimum partition
    # TBT target (ms) for auto: replaces beta while prefill is favoured (see ControllerConfig).
    partition_tbt_slo_ms: float | None = None
    # auto with a TBT target (partition_tbt_slo_ms, else tbt_slo_ms): may time-slice by slices
    # of layers (see ControllerConfig).
    partition_layer_slicing: bool = False
    # auto's chunks beside decodes may pass the cap on a step with decodes
    # (mixed_step_token_budget) until the step's fixed part (its decode part, the mixed step's
    # offset and its cached prefix's read, as the TBT cut reads them) is at most this share
    # of the step; never past prefill_token_budget or the TBT target's room. None: the cap
    # alone. Changeable while serving (Engine.set_prefill_limits). Why: on the 3B beside ~48
    # decodes a mixed step took 8.2 ms + 10.8 us a token (plan cap's traces at edc1adc, H100),
    # so a 2,048-token chunk spends 27 % of its step on the fixed part and off-4k's 4k steps
    # 16 %; held to 2,048, auto's TTFT P50 on that mixed chat read 1.46x off-4k's at 24 QPS.
    # Beside a few decodes the fixed part is small and the cap stays.
    chunk_fixed_share: float | None = None
    # Cost-model calibration (runtime/partition/calibrate.py), the `partition` section of the
    # calibration file: an explicit file wins (that file, or an old greenlane-partition/1 one);
    # else the cached file for this GPU and model in partition_calibration_dir (None = the
    # default calibration folder); else `auto` profiles at start-up (when
    # partition_startup_profile) and writes its section; else the built-in H200 fallback if it
    # matches, else uncalibrated.
    partition_calibration: str | None = None
    partition_calibration_dir: str | None = None
    partition_startup_profile: bool = True
    pd_slice_tokens: int = 32768  # prefill layers per launch = max(1, this // batch tokens)
    pd_max_queued_slices: int = 2  # prefill slices queued ahead on the prefill stream

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if (
            self.partition_layer_slicing
            and self.partition_tbt_slo_ms is None
            and self.tbt_slo_ms is None
        ):
            raise ValueError(
                "partition_layer_slicing needs partition_tbt_slo_ms or tbt_slo_ms (a TBT "
                "target: the slices are sized to it)"
            )
        if self.wait_for_shared_prefix_tokens < 0:
            raise ValueError("wait_for_shared_prefix_tokens must be >= 0")
        if self.prefill_token_budget < 1:
            raise ValueError("prefill_token_budget must be >= 1")
        m = self.mixed_step_token_budget
        if m not in ("auto", "none") and not (m.isdigit() and int(m) >= 1):
            raise ValueError(f"mixed_step_token_budget must be auto, none or >= 1, got {m!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1 (or unset: auto)")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError("prefill_graph_max_tokens must be >= 0 (0 = off)")
        if not 0.0625 <= self.prefill_graph_padding <= 1.0:
            raise ValueError(
                "prefill_graph_padding must be in [0.0625, 1] (a fraction of the bucket)"
            )
        if self.prefill_warm_up_tokens is not None and self.prefill_warm_up_tokens < 0:
            raise ValueError("prefill_warm_up_tokens must be >= 0 (0 = off)")
        if not 0 <= self.fused_decode_max_batch <= 64:
            raise ValueError("fused_decode_max_batch must be in 0..64")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError("ttft_slo_ms must be > 0 (ms)")
        if self.ttft_slo_ms is not None and self.fairness_lambda is not None:
            raise ValueError(
                "ttft_slo_ms sets SRJF's fairness offset from the SLO; give it or "
                "fairness_lambda, not both"
            )
        if self.decode_kv_split not in ("auto", "always", "never"):
            raise ValueError(
                f"decode_kv_split must be auto, always or never, got {self.decode_kv_split!r}"
            )
        if self.prefill_graphs_write_kv not in ("auto", "true", "false"):
            raise ValueError(
                "prefill_graphs_write_kv must be auto, true or false, got "
                f"{self.prefill_graphs_write_kv!r}"
            )
        if self.fused_rope_kv_write not in ("auto", "true", "false"):
            raise ValueError(
                f"fused_rope_kv_write must be auto, true or false, got {self.fused_rope_kv_write!r}"
            )
        if not (
            self.partition in ("off", "auto")
            or (self.partition.startswith("static:") and self.partition[7:].isdigit())
        ):
            raise ValueError(
                f"partition must be off, auto or static:<prefill_sms>, got {self.partition!r}"
            )
        if not 0.0 <= self.partition_kv_switch <= 1.0:
            raise ValueError("partition_kv_switch must be in [0, 1]")
        if self.partition_alpha < 1.0 or self.partition_beta < 1.0:
            raise ValueError("partition_alpha and partition_beta must be >= 1")
        if self.tbt_slo_ms is not None and not self.tbt_slo_ms > 0:
            raise ValueError("tbt_slo_ms must be > 0")
        if self.partition_tbt_slo_ms is not None and not self.partition_tbt_slo_ms > 0:
            raise ValueError("partition_tbt_slo_ms must be > 0")
        check_chunk_fixed_share(self.chunk_fixed_share)
        if self.pd_slice_tokens < 1 or self.pd_max_queued_slices < 1:
            raise ValueError("pd_slice_tokens and pd_max_queued_slices must be >= 1")

    def mixed_step_tokens(self, on_cuda: bool) -> int | None:
        """`mixed_step_token_budget` resolved for the device: a token count, or None for the
        prefill token budget alone."""
        m = self.mixed_step_token_budget
        if m == "auto":
            return 2048 if on_cuda else None
        return None if m == "none" else int(m)

    def hybrid_form(self) -> tuple[int | None, int]:
        """Hybrid prefill as every forward of a prefill runs it (`LlamaForCausalLM.forward`'s
        `chunk_tokens`, `stream_rows_above`): the chunk (None: hybrid prefill off), and the
        prefill budget, within which one prompt attends all rows at once (the faster form; the
        start-up dry run reserves a budget step's peak on it) and past which it streams rows."""
        return (
            self.chunk_tokens() if self.hybrid_prefill else None,
            self.prefill_token_budget,
        )

    def chunk_tokens(self) -> int:
        """Hybrid prefill's chunk: `prefill_chunk_tokens`, or while it is still auto (the engine
        sizes it on CUDA before anything reads it) PREFILL_CHUNK_TOKENS_UNSIZED."""
        return self.prefill_chunk_tokens or PREFILL_CHUNK_TOKENS_UNSIZED


def check_chunk_fixed_share(share: float | None) -> None:
    """`chunk_fixed_share` is None (the cap alone) or a share strictly between 0 and 1."""
    if share is not None and not 0.0 < share < 1.0:
        raise ValueError(f"chunk_fixed_share must be between 0 and 1, or null, got {share}")


def check_prefill_limits(
    prefill_token_budget: int,
    tbt_slo_ms: float | None,
    mixed_step_token_budget: int | None,
    sized_budget: int,
    chunk_fixed_share: float | None,
) -> None:
    """What a run-time change of the prefill limits must meet (`Engine.set_prefill_limits`):
    ValueError naming the field otherwise. The budget may only go down from `sized_budget`,
    the one the engine reserved activation memory for."""
    if not 1 <= prefill_token_budget <= sized_budget:
        raise ValueError(
            f"prefill_token_budget must be in [1, {sized_budget}] (the engine reserved "
            f"activation memory for {sized_budget}; restart with a larger "
            "--prefill-token-budget to go higher)"
        )
    if tbt_slo_ms is not None and not tbt_slo_ms > 0:
        raise ValueError("tbt_slo_ms must be > 0, or null for no target")
    if mixed_step_token_budget is not None and mixed_step_token_budget < 1:
        raise ValueError("mixed_step_token_budget must be >= 1, or null for the budget alone")
    check_chunk_fixed_share(chunk_fixed_share)
