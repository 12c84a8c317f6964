"""One mixed whole-GPU step (a prefill chunk after a long cached context beside k decodes),
built by the real scheduler and run in isolation through the serving executor, swept over
the chunk size: an engine-level diagnostic, not a served figure.

Why: on an H100 (Llama-3.1-8B shape, FlashInfer, CUDA prefill graphs) served mixed steps
showed a cliff at 38-44k tokens of prefill context: one chunk beside 9-10 decodes took
41.5-43.7 ms at 310-354 chunk tokens and 70-82 ms from 355; beside six decodes 414 tokens
took 46.9 ms and 433 tokens 74.7 ms; beside one decode 373-457 tokens took 32-37 ms, no cliff
(decodes with 1-2.5k tokens of context each). Those readings are in the same prefill-graph
bucket, so the bucket alone does not explain them. This reproduces one such step at a time, so
that one GPU call can sweep the chunk across the cliff and show which path and which attention
plan change with it.

    python -m bench.mixed_step --model random:llama-3.1-8b --device cuda \\
        --context 41000 --chunks 330:460:5 --decodes 1,6,10 --decode-context 2000 \\
        --repeats 5 --variants served,fa3,unmerged,unmerged-fa2 --out $OUT/mixed-step.json
    python -m bench.mixed_step --model random:tiny --device cpu --context 256 \\
        --chunks 16:48:16 --decodes 0,2 --decode-context 32 --repeats 2 --out /tmp/m.json

`--chunks` and `--decodes` take comma lists whose items are a number or start:stop:step (stop
included).

What the H100 sweep showed: FlashInfer's FA2 paged-prefill plan (where the backend's
`prefill_on_fa2` sends a merged step of mostly one-token rows) stops splitting the KV once the
batch's work tiles pass (2 x SMs) // KV heads (`fa2_split_plan` in
runtime/attention/flashinfer_backend.py): at 41k context beside 10 decodes,
350 tokens took 42.6 ms (split_kv True) and 355 tokens 72.4 ms (split_kv False). `--variants`
(a comma list, default `served`) runs every point's one staged step several ways, each with its
own untimed warm-up launch before its timed repeats, in the order given:

- `served`: as the engine serves it (no patch).
- `fa2`: the paged-prefill kernel forced onto FA2 (`prefill_on_fa2` returns True): every
  merged step, as the backend chose before its work rule (`FA3_WORK_RATIO_*`). Not
  applicable off FlashInfer, as `fa3`.
- `fa3`: the backend's paged-prefill kernel choice forced off FA2 (the module global
  `runtime.attention.flashinfer_backend.prefill_on_fa2` returns False during the variant's
  launches), i.e. FlashInfer's default wrapper, FA3 on Hopper. FA3 never splits the KV but
  runs 128-row tiles per query head, which one-token decode rows leave mostly empty; beside one
  decode (served on FA3 already) the step took no cliff. Not applicable where the prefill
  backend is not FlashInfer (CPU: the torch backend): recorded as `skipped`.
- `unmerged`: the prefill chunk and the decodes as two forwards (the runner instance's
  `_mergeable` returns False during the variant): without the decode rows the chunk's FA2 plan
  would keep its KV split (fewer tiles), at the cost of a second forward (the decode graph)
  for the decodes. Caveat: the chunk alone is planned by `prefill_on_fa2` on its own shape,
  which sends it to FA2 only while its FA3 work items (query heads x 128-row tiles) fill at
  most half the SMs: on the 8B shape on an H100 (32 heads, 132 SMs) up to 256 tokens, so a
  330-460-token chunk alone runs on FA3; each entry's `attention.mode` says which.
- `unmerged-fa2`: as `unmerged`, with the chunk's kernel forced onto FA2 (`prefill_on_fa2`
  returns True), whose plan then splits its KV: the chunk alone as the cliff's fix would run
  it. Not applicable off FlashInfer, as `fa3`.
- `merged`: the chunk and the decodes as one forward whatever its rows (`_mergeable` returns
  True): served, a step whose rows pass the prefill graphs' largest bucket (1,024 tokens by
  default) runs its chunk eagerly and its decodes in their graph, two forwards that each read
  the weights. Merged, the decode rows ride in the chunk's eager forward. Not applicable where
  the engine does not merge mixed steps.
- `side-stream`: as `served`, launched on a stream created for the variant
  (`torch.cuda.Stream()`) instead of the current one: how `auto`'s time-sliced steps run
  (on `GreenContextPartition._whole`). The fifty-eighth session's hostprof read +0.67 ms of
  host time a short launch under `auto-2k` against off-2k, with `CUDAGraph.replay`'s own
  time 3-5x off's; this times the stream alone. Not applicable off CUDA.
- `all-buckets`: the prefill graphs' buckets dropped at start-up as slower than a larger one
  (`PrefillGraphs.drop_dominated`; their graphs are kept) served again during the variant:
  the step as it ran before the drop. Not applicable without prefill graphs.

Method: one engine, not started (as bench/prefill_profile.py and bench/batch_cost.py). For each
point (u chunk tokens, k decodes) the step is planned by a `runtime.scheduler.Scheduler` of its
own over the engine's block manager, with real `Request`s, in two scheduler steps:

1. a fill step: k generation requests (prompts of `--decode-context` random tokens) and the
   long request (a prompt of `--context` + u random tokens, one more unless `--last-chunk`)
   admitted in arrival order (a first-come policy) with a budget of exactly their prompts and
   the long one's context, so the long one's first chunk is its `--context` tokens (with
   `--context 0` it is admitted by the timed step instead, a cold first chunk). This step is
   planned and applied (`Scheduler.update`, one sampled token per generation, also written to
   its device token slot, where its next decode reads it) but never run: the pool holds
   whatever it held (zeros, or earlier steps' KV), which does not change the timing (as
   `Engine.measure_prefill_batch`'s contexts). Every block of the long prompt is allocated at
   admission, as served.
2. the timed step: `Scheduler.schedule` with the serial executor's capacity
   (`engine.serial.capacity()`, its mixed-step cap included) whose prefill budget is u + k (the
   decodes share it, as served): the k decodes (context `--decode-context` tokens, + 1 being
   written) and the long request's next chunk of u tokens after its context, its KV kept, as
   served. Here the budget forces the chunk size; served, the token budget or the TBT cut's
   time accounting chooses it. The plan is checked against that shape (a point whose plan
   differs is recorded as an error: so is u below the block size unless `--last-chunk`, since
   a step's first chunk is at least a block or the rest of the prompt).

Why the scheduler rather than a hand-built `ScheduledSeq`/`StepPlan` (as
`Engine.measure_prefill_batch` builds scoring prefills): what the runner reads of a step (block
tables covering the kept tokens and a decode's next token, `needs_output`, `samples`, token
slots) is then the served step's by construction, not a copy of the scheduler's rules.

The plan then runs, once per variant, as the serving loop runs a step:
`engine.serial.launch(plan)` (the engine's `SerialExecutor`: CUDA events around
`ModelRunner.launch(plan, interruptible=True)`, which merges prefill and decodes into one
forward when `ModelRunner._mergeable` says so) and `engine.serial.results(block=True)`, whose
`device_s` is the step's device span as a served step's `device_ms` is read (on CPU the same
events read the wall clock). Per variant one untimed launch first, then `--repeats` timed ones,
back to back, each waited for before the next. The same plan is launched every time, by every
variant: each launch writes the same KV slots and re-reads its context; the decodes read the
token the previous launch sampled. Then the plan is retired and its requests aborted (their
blocks and slots freed).

Per point the record has u, k, the planned shape (`planned`: the prefill's new, context and kept
tokens, the decodes' contexts) and `variants`: one entry per variant run, keyed by its name,
each either `{"skipped": why}` (not applicable here), `{"error": ...}` (it failed; the next
variant still runs) or the fields below. The `served` entry's fields are also copied to the
point's top level (the layout before `--variants`), and a point that could not be staged has a
top-level `error` and no variants. A variant's fields, read while its patch is on (so `unmerged`
has `merged` and `mergeable` False by construction): `merged` (`ModelRunner.merges(plan)`: what
launch did), `mergeable` (`ModelRunner._mergeable`; with k = 0 only whether the chunk could
merge), the prefill-graph bucket of the forward that carried the prefill rows (u + k rows
merged, u alone; None: eager or no graphs), device ms (all readings, median, min, max), host
launch and wall ms medians (both forwards where unmerged), and `attention`: what the FlashInfer
prefill backend planned for the step's prefill forward (its mode, e.g. "paged_fa2" or "paged"
(FA3), and the kernel wrapper's plan: FA2's work tiles, query tile, whether and at what chunk it
split the KV; None on CPU), beside `fa2_predicted`: the same FA2 split computed here from the
step's shape (the backend's `fa2_split_plan`, a transcription of FlashInfer 0.5.3's
`PrefillSplitQOKVIndptr`; CUDA only, it needs the SM count; meaningful where the mode is an
FA2 one).

`--kernels N` (0: off) adds one more launch a variant, after the timed ones and not among
them, under the torch profiler: `kernels` is the summary the server's profiler gives
(`runtime.diagnostics.profiling.summarize_trace`: the step's kernels by device time, the top N,
their categories, launches, and the device-busy share of the span from the first kernel to the
last). It says where a step's fixed part goes (on the 3B's mixed chat a step beside ~48
decodes fitted 8.2 ms + 10.8 µs a token where a decode-only step took 3.5 ms, H100,
`edc1adc`). On a CPU the trace holds no device kernels: the summary is empty.
`--mixed-step-token-budget` sets the engine's cap on a step with decodes (the CUDA default,
2,048, would refuse to stage a larger chunk beside decodes; `none`: no cap).

Assumptions: the long request is a generation (a chat's long prompt; a scoring prompt chunked
next to decodes plans the same shape); sampling is the defaults (temperature 1) with EOS
ignored; the scheduler of the point has the prefix cache off (the context is there by the fill,
not by a hit: the runner sees block tables either way).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

LONG_ID = "mixed-step-prefill"
NOTE = (
    "engine-level diagnostic: one mixed step planned by the scheduler and run in isolation "
    "(engine not started, nothing else in flight); not a served figure"
)


def parse_grid(text: str) -> list[int]:
    """A comma list of numbers or start:stop:step ranges (stop included), in order, no
    repeats."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        parts = [int(x) for x in item.split(":")]
        if len(parts) == 1:
            values = parts
        elif len(parts) == 3 and parts[2] > 0:
            values = list(range(parts[0], parts[1] + 1, parts[2]))
        else:
            raise ValueError(f"{item!r}: a number or start:stop:step (step > 0)")
        out += [v for v in values if v not in out]
    return out


class _FirstCome:
    """Admission in arrival order (the scheduler breaks equal scores by arrival)."""

    @staticmethod
    def score(_req: Any, _now_s: float) -> float:
        return 0.0


_FA2_PLAN_FIELDS = (
    "padded_batch_size",
    "total_num_rows",
    "total_num_rows_offset",
    "cta_tile_q",
    "request_indices_offset",
    "qo_tile_indices_offset",
    "kv_tile_indices_offset",
    "merge_indptr_offset",
    "o_indptr_offset",
    "kv_chunk_size_ptr_offset",
    "v_offset",
    "s_offset",
    "block_valid_mask_offset",
    "enable_cuda_graph",
    "split_kv",
)


def attention_plan(backend: Any) -> dict[str, Any] | None:
    """What the backend planned for its last batch: None for a backend that does not say
    (the torch backend, CPU); for FlashInfer its mode and, read from the wrapper that mode
    runs (private attributes of FlashInfer 0.5.3: a read that fails is recorded, not
    raised), the kernel plan: FA2's work tiles (`padded_batch_size`), query tile, split and KV
    chunk (tokens, from the plan's pinned host copy)."""
    state = getattr(backend, "debug_state", None)
    if state is None:
        return None
    import torch

    out: dict[str, Any] = dict(state())
    mode = out.get("mode")
    name = {
        "paged": "_paged",
        "paged_fa2": "_paged_fa2",
        "ragged": "_ragged",
        "gather": "_ragged_fa2" if out.get("ragged_fa2") else "_ragged",
        "decode": "_decode_wrapper",
    }.get(mode or "")
    wrapper = getattr(backend, name, None) if name else None
    if wrapper is None:
        return out
    try:
        out["kernel_backend"] = str(getattr(wrapper, "_backend", None))
        info = [int(x) for x in getattr(wrapper, "_plan_info", None) or []]
        out["plan_info"] = info
        if len(info) == len(_FA2_PLAN_FIELDS):
            fields = dict(zip(_FA2_PLAN_FIELDS, info, strict=True))
            out["fa2"] = {
                "num_work_tiles": fields["padded_batch_size"],
                "cta_tile_q": fields["cta_tile_q"],
                "split_kv": bool(fields["split_kv"]),
                "total_num_rows": fields["total_num_rows"],
            }
            pinned = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
            if pinned is not None:
                off = fields["kv_chunk_size_ptr_offset"]
                chunk = pinned[off : off + 4].view(dtype=torch.int32)
                out["fa2"]["kv_chunk_tokens"] = int(chunk[0])
    except Exception as exc:  # noqa: BLE001 - a diagnostic read must not end the point
        out["plan_read_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def new_scheduler(engine: Any) -> Any:
    """The point's own scheduler over the engine's block manager (prefix cache off: module
    docstring), admitting in arrival order."""
    from runtime.scheduler import Scheduler

    config = dataclasses.replace(engine.config, enable_prefix_cache=False)
    return Scheduler(config, engine.block_manager, _FirstCome(), engine.model_config.eos_token_ids)


def stage_step(
    engine: Any,
    sched: Any,
    in_flight: list[Any],
    u: int,
    k: int,
    context: int,
    decode_context: int,
    *,
    seed: int,
    last_chunk: bool,
) -> Any:
    """The point's step, planned by `sched` as the module docstring says. `in_flight` gets
    every plan scheduled and not applied (the caller retires them: `release_step`)."""
    import torch

    from runtime.request import Request, RequestKind, SamplingParams
    from runtime.scheduler import RunnerOutput, StepCapacity

    if decode_context < 1 or context < 0 or u < 1 or k < 0:
        raise ValueError("needs --decode-context >= 1, --context >= 0, chunks >= 1, decodes >= 0")
    if k + 1 > sched.config.max_num_seqs:
        raise ValueError(f"{k} decodes and the prefill exceed max_num_seqs")
    rng = random.Random(f"{seed}:{u}:{k}")
    vocab = engine.runner.num_sampleable_tokens
    gen = SamplingParams(max_tokens=1 << 30, ignore_eos=True)
    decodes = [
        Request(
            f"mixed-step-decode-{i}",
            RequestKind.GENERATE,
            _random_ids(rng, decode_context, vocab),
            gen,
        )
        for i in range(k)
    ]
    long_req = Request(
        LONG_ID,
        RequestKind.GENERATE,
        _random_ids(rng, context + u + (0 if last_chunk else 1), vocab),
        SamplingParams(max_tokens=1, ignore_eos=True),
    )
    for r in decodes:
        sched.add(r)
    if context:
        sched.add(long_req)  # after the decodes: its first chunk is what their prompts leave
    fill_budget = k * decode_context + context
    sampled: dict[str, int] = {}
    if fill_budget:
        fill = sched.schedule(StepCapacity(prefill_token_budget=fill_budget))
        in_flight.append(fill)
        sampled = {r.request_id: rng.randrange(vocab) for r in decodes}
        sched.update(fill, RunnerOutput(sampled_token_ids=sampled))  # as if it had run
        in_flight.remove(fill)
    if not context:
        sched.add(long_req)  # a cold first chunk: admitted by the timed step
    capacity = dataclasses.replace(engine.serial.capacity(), prefill_token_budget=u + k)
    plan = sched.schedule(capacity)
    in_flight.append(plan)
    # The fill step's samples where the decodes read their input token (their device slots).
    runner = engine.runner
    rows = [(s.lease.slot, sampled[s.request.request_id]) for s in plan.decode if s.lease.slot >= 0]
    if rows:
        slots, tokens = zip(*rows, strict=True)
        runner.token_slots.index_copy_(
            0,
            torch.tensor(slots, dtype=torch.int64, device=runner.device),
            torch.tensor(tokens, dtype=runner.token_slots.dtype, device=runner.device),
        )
    return plan


def check_plan(plan: Any, u: int, k: int, context: int, decode_context: int) -> str | None:
    """Why the plan is not the point's shape, or None."""
    pre = plan.prefill
    if len(pre) != 1 or pre[0].request.request_id != LONG_ID:
        return f"planned {len(pre)} prefill parts, not the long request's chunk"
    p = pre[0]
    if (p.num_new_tokens, p.num_context_tokens) != (u, context):
        return (
            f"planned {p.num_new_tokens} tokens after {p.num_context_tokens}, not {u} after "
            f"{context} (a first chunk is at least a block or the prompt's rest; the step's "
            "caps: prefill_token_budget, mixed_step_token_budget)"
        )
    if p.num_kept_tokens != context + u:
        return f"the chunk keeps {p.num_kept_tokens - context} of its {u} tokens' KV"
    if len(plan.decode) != k or any(d.num_context_tokens != decode_context for d in plan.decode):
        return f"planned {len(plan.decode)} decodes, not {k} after {decode_context} tokens each"
    return None


def release_step(engine: Any, sched: Any, in_flight: list[Any]) -> None:
    """Retire the plans never applied and abort the point's requests: their blocks and token
    slots go back."""
    for plan in in_flight:
        sched.retire(plan)
    in_flight.clear()
    for req in list(sched.running) + list(sched.waiting):
        sched.abort(req.request_id)
    for rid in sched.take_released():
        engine.runner.release(rid)


VARIANTS = (
    "served",
    "fa2",
    "fa3",
    "unmerged",
    "unmerged-fa2",
    "merged",
    "side-stream",
    "all-buckets",
)


def variant_unavailable(engine: Any, name: str) -> str | None:
    """Why `name` cannot run on this engine (recorded as the variant's `skipped`), or None."""
    if (
        name in ("fa2", "fa3", "unmerged-fa2")
        and getattr(engine.runner.prefill_backend, "name", None) != "flashinfer"
    ):
        backend = getattr(engine.runner.prefill_backend, "name", None)
        return (
            f"not applicable: the prefill attention backend is {backend!r}, not FlashInfer "
            "(no FA2/FA3 kernel choice to force)"
        )
    if name == "side-stream" and engine.device.type != "cuda":
        return f"not applicable: no CUDA streams on {engine.device.type}"
    pg = engine.runner.prefill_graphs
    if name == "all-buckets" and (pg is None or not pg.captured):
        return "not applicable: no captured prefill graphs"
    runner = engine.runner
    if name == "merged" and (runner.merge_off_reason or not engine.config.merge_mixed_steps):
        why = runner.merge_off_reason or "merge_mixed_steps is off"
        return f"not applicable: this engine does not merge mixed steps ({why})"
    return None


def _return_false(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _return_true(*_args: Any, **_kwargs: Any) -> bool:
    return True


@contextlib.contextmanager
def _kernel_forced(rule: Any) -> Iterator[None]:
    """The FlashInfer backend's FA2/FA3 choice replaced by `rule` (it looks `prefill_on_fa2`
    up as a module global each time it plans a batch with context), restored on the way out."""
    from runtime.attention import flashinfer_backend as fib

    original = fib.prefill_on_fa2
    fib.prefill_on_fa2 = rule
    try:
        yield
    finally:
        fib.prefill_on_fa2 = original


@contextlib.contextmanager
def variant_patch(engine: Any, name: str) -> Iterator[None]:
    """The engine as the variant runs it (module docstring), restored on the way out.
    fa3: the FlashInfer backend looks `prefill_on_fa2` up as a module global each time it
    plans a batch with context, so replacing the module attribute takes effect. unmerged: the
    runner asks its own `_mergeable` (`launch`, `merges`, `holds_host`), so an instance
    attribute shadows the method."""
    if name == "served":
        yield
    elif name == "fa3":
        with _kernel_forced(_return_false):
            yield
    elif name == "fa2":
        # A merged step on FA2 whatever its work: the rule before 2026-12-06's work rule.
        with _kernel_forced(_return_true):
            yield
    elif name == "unmerged-fa2":
        # The chunk alone on FA2 (whose plan then splits its KV), the decodes in their graph:
        # `unmerged` alone sends a chunk of over ~256 tokens to FA3 (`prefill_on_fa2`).
        with _kernel_forced(_return_true), variant_patch(engine, "unmerged"):
            yield
    elif name == "side-stream":
        import torch

        home = torch.cuda.current_stream(engine.device)
        side = torch.cuda.Stream(device=engine.device)
        side.wait_stream(home)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            home.wait_stream(side)
    elif name == "all-buckets":
        pg = engine.runner.prefill_graphs
        kept = pg.token_sizes
        pg.token_sizes = tuple(sorted(set(kept) | set(pg.dropped)))
        try:
            yield
        finally:
            pg.token_sizes = kept
    elif name in ("unmerged", "merged"):
        # merged: one forward whatever its rows, eager past the prefill graphs' largest bucket
        # (served, such a step runs its chunk eagerly and its decodes in their graph apart).
        runner = engine.runner
        shadowed = vars(runner).get("_mergeable")
        rule = _return_false if name == "unmerged" else _return_true
        setattr(runner, "_mergeable", rule)  # noqa: B010 - a method, shadowed
        try:
            yield
        finally:
            if shadowed is None:
                delattr(runner, "_mergeable")
            else:
                setattr(runner, "_mergeable", shadowed)  # noqa: B010
    else:
        raise ValueError(f"unknown variant {name!r} (one of {', '.join(VARIANTS)})")


def measure_variant(
    engine: Any, plan: Any, u: int, k: int, repeats: int, kernels: int = 0
) -> dict[str, Any]:
    """One variant's entry for the staged `plan` (run under its `variant_patch`): whether and
    how the step merged, one untimed launch, `repeats` timed ones, the attention plan read,
    and with `kernels` > 0 one profiled launch's kernel summary (module docstring)."""
    import torch

    from runtime.attention.flashinfer_backend import fa2_split_plan

    runner = engine.runner
    entry: dict[str, Any] = {}
    merged = runner.merges(plan)
    entry["merged"] = bool(merged)
    entry["mergeable"] = bool(runner._mergeable(plan.prefill, len(plan.decode)))
    rows = u + k if merged else u
    entry["forward_tokens"] = rows
    pg = runner.prefill_graphs
    entry["prefill_graph_bucket"] = pg.bucket_for(rows) if pg is not None and pg.captured else None
    device_ms: list[float] = []
    wall_ms: list[float] = []
    launch_ms: list[float] = []
    serial = engine.serial
    for i in range(repeats + 1):
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        serial.launch(plan)
        t1 = time.perf_counter()
        results = serial.results(block=True)
        t2 = time.perf_counter()
        if len(results) != 1 or results[0].device_s is None:
            raise RuntimeError(f"expected one timed step back, got {len(results)}")
        if i:  # the first launch is the variant's warm-up
            device_ms.append(results[0].device_s * 1e3)
            launch_ms.append((t1 - t0) * 1e3)
            wall_ms.append((t2 - t0) * 1e3)
    entry["device_ms"] = [round(v, 4) for v in device_ms]
    entry["device_ms_median"] = statistics.median(device_ms)
    entry["device_ms_min"] = min(device_ms)
    entry["device_ms_max"] = max(device_ms)
    entry["wall_ms_median"] = statistics.median(wall_ms)
    entry["launch_ms_median"] = statistics.median(launch_ms)
    entry["attention"] = attention_plan(runner.prefill_backend)
    if kernels > 0:
        entry["kernels"] = profile_launch(engine, plan, kernels)
    entry["fa2_predicted"] = None
    num_q, num_kv = engine.model_config.num_q_heads, engine.model_config.num_kv_heads
    if engine.device.type == "cuda":
        seqs = plan.prefill + (plan.decode if merged else [])
        entry["fa2_predicted"] = fa2_split_plan(
            [s.num_new_tokens for s in seqs],
            [s.num_context_tokens + s.num_new_tokens for s in seqs],
            num_q,
            num_kv,
            torch.cuda.get_device_properties(engine.device).multi_processor_count,
            engine.block_manager.block_size,
        )
    return entry


def profile_launch(engine: Any, plan: Any, top: int) -> dict[str, Any]:
    """One launch of `plan` through the serial executor under the torch profiler: the kernel
    summary of `runtime.diagnostics.profiling` (its top `top` kernels), plus the step's device ms as
    the executor read it (the profiler's own cost included)."""
    import os
    import tempfile

    import torch

    from runtime.diagnostics.profiling import summarize_trace

    on_cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(engine.device)
    with torch.profiler.profile(activities=activities) as prof:
        engine.serial.launch(plan)
        results = engine.serial.results(block=True)
        if on_cuda:
            torch.cuda.synchronize(engine.device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        summary = summarize_trace(path, 1, top)
    finally:
        os.unlink(path)
    device_s = results[0].device_s if len(results) == 1 else None
    summary["step_device_ms"] = None if device_s is None else round(device_s * 1e3, 4)
    return summary


def measure_point(
    engine: Any,
    u: int,
    k: int,
    context: int,
    decode_context: int,
    repeats: int,
    *,
    seed: int = 0,
    last_chunk: bool = False,
    variants: tuple[str, ...] = ("served",),
    kernels: int = 0,
) -> dict[str, Any]:
    """One point's record (module docstring): the step staged once, then run as each of
    `variants` in turn."""
    rec: dict[str, Any] = {"u": u, "k": k}
    free_before = engine.block_manager.num_free_blocks
    sched = new_scheduler(engine)
    in_flight: list[Any] = []
    entries: dict[str, dict[str, Any]] = {}
    try:
        plan = stage_step(
            engine,
            sched,
            in_flight,
            u,
            k,
            context,
            decode_context,
            seed=seed,
            last_chunk=last_chunk,
        )
        pre = plan.prefill[0] if plan.prefill else None
        rec["planned"] = {
            "prefill_new_tokens": pre.num_new_tokens if pre else 0,
            "prefill_context_tokens": pre.num_context_tokens if pre else None,
            "prefill_kept_tokens": pre.num_kept_tokens if pre else None,
            "prefill_needs_output": pre.needs_output if pre else None,
            "num_decodes": len(plan.decode),
            "decode_context_tokens": sorted({d.num_context_tokens for d in plan.decode}),
        }
        bad = check_plan(plan, u, k, context, decode_context)
        if bad:
            raise ValueError(bad)
        for name in variants:
            why_not = variant_unavailable(engine, name)
            if why_not:
                entries[name] = {"skipped": why_not}
                continue
            try:
                with variant_patch(engine, name):
                    entries[name] = measure_variant(engine, plan, u, k, repeats, kernels)
            except Exception as exc:  # noqa: BLE001 - one variant failing must not end the point
                entries[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                try:
                    engine.serial.drain()
                except Exception:  # noqa: BLE001 - the failure is recorded above
                    pass
    except Exception as exc:  # noqa: BLE001 - one point failing must not end the sweep
        rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
        try:
            engine.serial.drain()
        except Exception:  # noqa: BLE001 - the failure is recorded above
            pass
    finally:
        release_step(engine, sched, in_flight)
        if "served" in entries:  # the layout before --variants: served's fields at the top
            for key, value in entries["served"].items():
                rec.setdefault(key, value)
        rec["variants"] = entries
        leaked = free_before - engine.block_manager.num_free_blocks
        if leaked:
            rec.setdefault("error", f"{leaked} KV blocks not freed after the point")
    return rec


def parse_variants(text: str) -> tuple[str, ...]:
    """`--variants`: known names, in order, no repeats, at least one."""
    out: list[str] = []
    for name in (x.strip() for x in text.split(",")):
        if not name:
            continue
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown {name!r} (one of {', '.join(VARIANTS)})")
        if name not in out:
            out.append(name)
    if not out:
        raise SystemExit(f"--variants needs at least one of {', '.join(VARIANTS)}")
    return tuple(out)


def variant_line(entry: dict[str, Any]) -> str:
    """A variant's entry in one line (stderr)."""
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    if "error" in entry:
        return f"error: {entry['error']}"
    att = entry["attention"] or {}
    fa2 = att.get("fa2") or {}
    if not fa2 and att.get("mode") == "paged_fa2":  # the plan read failed: the transcription
        fa2 = entry.get("fa2_predicted") or {}
    return (
        f"{entry['device_ms_median']:.2f} ms (device), merged={entry['merged']} "
        f"bucket={entry['prefill_graph_bucket']} mode={att.get('mode')} "
        f"split_kv={fa2.get('split_kv')} tiles={fa2.get('num_work_tiles')}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.mixed_step",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-gpu-memory-gb", type=float)
    p.add_argument("--context", type=int, default=41000, help="the long prompt's cached tokens")
    p.add_argument("--chunks", default="330:460:5", help="chunk tokens u: list / start:stop:step")
    p.add_argument("--decodes", default="1,6,10", help="decodes k beside the chunk")
    p.add_argument("--decode-context", type=int, default=2000, help="each decode's KV tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed launches a point (+1 warm-up)")
    p.add_argument(
        "--last-chunk",
        action="store_true",
        help="the chunk ends the long prompt (samples its first token); default: more follows",
    )
    p.add_argument(
        "--variants",
        default="served",
        help=f"comma list of how each point's step runs, of {', '.join(VARIANTS)} (docstring)",
    )
    p.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="with N > 0, one more launch a variant under the torch profiler: its top N kernels",
    )
    p.add_argument(
        "--mixed-step-token-budget",
        default=None,
        help="the engine's cap on a step with decodes (auto, none or tokens; default: auto)",
    )
    p.add_argument("--seed", type=int, default=0, help="token ids")
    p.add_argument("--rev", help="git revision as the caller knows it (recorded beside git's)")
    p.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chunks, decodes = parse_grid(args.chunks), parse_grid(args.decodes)
    if not chunks or not decodes or args.repeats < 1 or args.kernels < 0:
        raise SystemExit("--chunks and --decodes need values, --repeats >= 1, --kernels >= 0")
    variants = parse_variants(args.variants)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()

    from bench.prefill_profile import git_revision, measurement_engine

    extra: dict[str, Any] = {}
    if args.mixed_step_token_budget is not None:
        extra["mixed_step_token_budget"] = args.mixed_step_token_budget
    engine = measurement_engine(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_gpu_memory_gb=args.max_gpu_memory_gb,
        **extra,
    )
    init_s = time.monotonic() - t0
    points: list[dict[str, Any]] = []
    try:
        runner = engine.runner
        pg = runner.prefill_graphs
        engine_rec = {
            "model": args.model,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "attention_backend": getattr(runner.prefill_backend, "name", None),
            "block_size": engine.block_manager.block_size,
            "kv_pool_tokens": engine.kv_pool_tokens,
            "prefill_token_budget": engine.config.prefill_token_budget,
            "mixed_step_token_budget": engine.serial.mixed_step_token_budget,
            "merge_mixed_steps": engine.config.merge_mixed_steps,
            "merge_off_reason": runner.merge_off_reason,
            "prefill_graph_buckets": list(pg.token_sizes)
            if pg is not None and pg.captured
            else None,
            # Each captured bucket's dense replay (ms) and those dropped as slower than a
            # larger one (runtime/graphs/prefill.py, `drop_dominated`).
            "prefill_graph_bucket_ms": {str(n): round(t, 3) for n, t in pg.bucket_ms.items()}
            if pg is not None
            else None,
            "prefill_graph_dropped": sorted(pg.dropped) if pg is not None else None,
            "init_s": round(init_s, 2),
        }
        device = engine.device_name
        if engine.device.type != "cuda":
            device = f"{device} ({platform.processor() or platform.machine()})"
        print(
            f"[mixed-step] {device}, {args.model}: {len(chunks)} chunks x {len(decodes)} decode "
            f"counts after {args.context} tokens (engine built in {init_s:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        for k in decodes:
            for u in chunks:
                rec = measure_point(
                    engine,
                    u,
                    k,
                    args.context,
                    args.decode_context,
                    args.repeats,
                    seed=args.seed,
                    last_chunk=args.last_chunk,
                    variants=variants,
                    kernels=args.kernels,
                )
                points.append(rec)
                if not rec["variants"]:
                    print(
                        f"[mixed-step] u={u} k={k}: error: {rec.get('error')}",
                        file=sys.stderr,
                        flush=True,
                    )
                for name, entry in rec["variants"].items():
                    print(
                        f"[mixed-step] u={u} k={k} {name}: {variant_line(entry)}",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        engine.shutdown()
    record = {
        "tool": "bench.mixed_step",
        "note": NOTE,
        "command": "python -m bench.mixed_step "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "argv": list(sys.argv) if argv is None else ["-m", "bench.mixed_step", *argv],
        "git_revision": git_revision(args.rev),
        "device": device,
        "date": started,
        "engine": engine_rec,
        "setup": {
            "context_tokens": args.context,
            "decode_context_tokens": args.decode_context,
            "last_chunk": args.last_chunk,
            "repeats": args.repeats,
            "variants": list(variants),
            "warm_up_launches": 1,  # per variant
            "seed": args.seed,
        },
        "points": points,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"[mixed-step] wrote {args.out} ({len(points)} points)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
