"""The scheduler: which tokens of which requests run in the next step, and what came of them.

It deals in token ids only: text, stop strings and output objects with text belong to the
front end's output processor (runtime/core/output_processor.py).

Queues
  - waiting: requests without KV (new, or preempted). Ordered at every decision by the prefill
    policy (`policy.score(view, now_s)`, lowest first, ties by arrival), where each view
    carries the cached-prefix length looked up *now* (continuous calibration; memoized per
    request and invalidated by the prefix cache's generation counter).
  - running: requests holding KV blocks, in admission order: prefills in progress and decodes.
    Decode admission is FCFS (admission order).

One step (`schedule(capacity)`), as in vLLM v1 there are no phases: every running request has
tokens computed and tokens wanted, and a step gives tokens to the first to catch up:
  1. every running request with one pending token decodes (1 token each, FCFS). If it needs a
     new block and none is left, the most recently admitted running request is preempted
     (recompute style: it goes back to waiting with its output so far; it re-prefills prompt
     + output later, mostly from the prefix cache), unless a launched step answers that
     request: then the decode waits a step for the blocks its finish frees;
  2. prefills in progress continue, then waiting requests are admitted in policy order while
     the budget (`capacity.prefill_token_budget`, which decode tokens share when
     `capacity.decodes_share_budget`; in a step with decodes at most
     `capacity.mixed_step_token_budget`), `max_num_seqs` and the KV pool allow. The first
     prefill of a step always runs (at least one block) so prefill never starves behind
     decode. A GENERATE prompt is chunked to the remaining budget. A SCORE prompt runs whole
     (hybrid prefill bounds its memory, suffix KV is discarded) unless decodes are running,
     it does not fit the budget and the pool can hold its whole KV until it finishes: then it
     is chunked like a GENERATE prompt, so a long scoring prompt never stalls decode for more
     than a budget's worth of compute (`capacity.chunk_scoring`).
KV admission
  - GENERATE (and chunked SCORE): blocks for every token to prefill at admission (minus
    prefix-cache hits), one more block whenever decode crosses a block boundary.
  - whole SCORE: only the full prompt blocks that the pool can hold right now, less what the
    decodes beside it will need (`_decode_reserve_blocks`), are allocated (suffix-KV
    discard: `num_kept_tokens`), and the last partial block too when they all fit and one
    more block is free (then nothing in the step is discarded, so attention reads every
    context from the pool rather than a per-layer copy of it, and the step may merge with
    decodes). After the answer everything is released; the kept full blocks stay in the
    prefix cache (cached-idle).
  - A prefix hit never covers the whole prompt: the last prompt token is always computed
    (its logits are the answer).

Overlapped execution. `schedule()` advances the counters of what it plans at once
(`num_computed_tokens`, and one output placeholder per token to be sampled), so the next
step can be planned before this one's results reach the host: a decode's input token is read
on the device from the request's token slot (`Lease.slot`), where the previous step's sampler
wrote it. `update(plan, out)` later applies the results in launch order: placeholders become
tokens, stop tokens / EOS / max_tokens finish requests (one step late: a step already launched
may have computed one surplus token for a request that has finished, and that token is
dropped). Every admission of a request is a `Lease` (its KV blocks and token slot); a lease
is released (blocks freed, slot returned) only once no launched step uses it any more, so a
step in flight never writes into blocks another request already holds.
With `capacity.hold_prefills` (the split executor runs a prefill asynchronously on its own SM
partition), the requests of a launched prefill are *held*: not scheduled and never chosen as
preemption victims until its results are applied.
The scheduler runs on the engine thread only; it is not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.config import EngineConfig
from runtime.diagnostics.gc_watch import untrack_int_list
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import append_block_hashes, salt_digest
from runtime.request import (
    FINISH_REASONS,
    EngineOutput,
    Request,
    RequestKind,
    RequestStatus,
    TokenLogprob,
)


class PolicyLike(Protocol):
    name: str

    def score(self, req: Any, now_s: float) -> float: ...


class WaitingView:
    """What a policy sees of a waiting request (policies.base.WaitingView). Its cached prefix
    is looked up only if the policy reads it: FCFS and SPF never do, and under a pool smaller
    than the working set each lookup re-checks the request's whole cached prefix after the
    step's evictions (~900 blocks for a 14k-token profile, for every waiting request)."""

    __slots__ = (
        "request_id",
        "arrival_s",
        "num_prompt_tokens",
        "remaining_prompt_tokens",
        "_cached",
        "_lookup",
    )

    def __init__(
        self,
        request_id: str,
        arrival_s: float,
        num_prompt_tokens: int,  # tokens to prefill (prompt, plus output after preemption)
        remaining_prompt_tokens: int,
        num_cached_tokens_now: int | Callable[[], int],  # or how to look it up
    ) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.remaining_prompt_tokens = remaining_prompt_tokens
        if callable(num_cached_tokens_now):
            self._cached: int | None = None
            self._lookup: Callable[[], int] | None = num_cached_tokens_now
        else:
            self._cached, self._lookup = num_cached_tokens_now, None

    @property
    def num_cached_tokens_now(self) -> int:
        if self._cached is None:
            assert self._lookup is not None
            self._cached = self._lookup()
        return self._cached


class PrefillCost(Protocol):
    """Marginal prefill time (the JCT model, `policies.jct.JCTModel`)."""

    def marginal_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float: ...
    def max_tokens_within(self, seconds: float, cached_tokens: int = 0) -> int: ...


# With a TBT target, the first prefill chunk of a step gets at least this many tokens: prefill
# must progress even when the decodes alone take longer than the target.
MIN_TBT_CHUNK_TOKENS = 256

# A whole scoring prompt held on a split or in layer slices runs beside decode steps for its
# whole length; it leaves each decoding request the blocks for this many more tokens (at most
# to its max_tokens). On an H100 (8B in 24 GB, 40-60k-token scoring prompts beside 2-QPS chat
# under auto) such prompts ran 2.5-5 s, a decode step every ~8 ms; keeping every free block
# for the prompt's prefix left the decodes none, and a run counted 9-17 preemptions (a held
# request is never the victim: they fell on the chats).
HELD_DECODE_RESERVE_TOKENS = 512

# Samples of a request under a grammar (structured outputs) that may be in flight when it is
# planned again: its mask needs every earlier token, and the runner waits for one in-flight
# step's token (`ModelRunner._grammar_masks`), not more. With 1 such a request decodes every
# step under overlapped scheduling (with 0 it sat out every other step beside others).
MAX_GRAMMAR_SAMPLES_AHEAD = 1


def _samples_left(req: Request) -> int:
    """Samples a generation may still have planned: max_tokens less what the host has and what
    is in flight (0: its last token is in flight, the update finishes it)."""
    return req.sampling.max_tokens - req.num_output_tokens - req.num_output_placeholders


def _decodes_after_sample(req: Request) -> bool:
    """Whether a running generation whose last step sampled (its lease's `sampled`, the
    sample in flight or on the host) has a decode to come: one token past what is computed
    (its sample) and samples left to plan. `outlook` (the next step) and `decodes_ahead`
    (the steps over a prefill's time) count decodes by this one rule; `outlook` also leaves
    out a generation under a grammar with too many samples in flight (`_grammar_waits`): it
    is not planned next step, though it decodes over a longer prefill."""
    return (
        req.status == RequestStatus.RUNNING
        and req.num_total_tokens - req.num_computed_tokens == 1
        and _samples_left(req) > 0
    )


def _grammar_waits(req: Request) -> bool:
    """Whether a request under a grammar has too many samples in flight to be planned again
    (`outlook` and `_plan_decodes` ask the same)."""
    return (
        req.sampling.grammar is not None and req.num_output_placeholders > MAX_GRAMMAR_SAMPLES_AHEAD
    )


def tbt_chunk_tokens(cost: PrefillCost, time_left_s: float, cached_tokens: int) -> int:
    """The first prefill chunk of a step under a TBT target: the most new tokens after
    `cached_tokens` whose marginal cost fits `time_left_s` (the target less the decode step),
    at least MIN_TBT_CHUNK_TOKENS. The scheduler's cut (`--tbt-slo-ms`) and auto's chunked
    option (runtime/partition/cost_model.py) both size chunks with it."""
    return max(cost.max_tokens_within(time_left_s, cached_tokens), MIN_TBT_CHUNK_TOKENS)


@dataclass(frozen=True, slots=True)
class StepOutlook:
    """What the next step would start with, before it is planned (`Scheduler.outlook`): the
    head of the prefill queue and the decode batch. For `--partition auto`, whose controller
    chooses how the step runs (chunked, split, layer slices) before the scheduler plans it."""

    prefill_tokens: int  # tokens the head prefill has left to compute (0: no prefill queued)
    prefill_context_tokens: int  # its context: prefix-cache hits or chunks computed earlier
    prefill_chunkable: bool  # it may be cut by tokens across steps
    num_decodes: int
    decode_context_tokens: int  # KV tokens the decodes read


@dataclass(frozen=True, slots=True)
class StepCapacity:
    """What the executor can take in the next step (`Executor.capacity()`)."""

    prefill_token_budget: int  # prefill tokens the step may plan (0: no prefill work now)
    decodes_share_budget: bool = True  # decode tokens count against the budget (one batch)
    hold_prefills: bool = False  # prefills run asynchronously: hold their requests
    chunk_scoring: bool = True  # long scoring prompts next to decodes may be chunked
    # A step that plans decodes takes at most this many tokens (decodes included when they
    # share the budget); None: `prefill_token_budget` alone (EngineConfig.mixed_step_tokens).
    mixed_step_token_budget: int | None = None
    # A time-between-tokens target (EngineConfig.tbt_slo_ms): in a step with decodes, the
    # prefill work planned may add at most tbt_s - decode_step_s seconds by `prefill_cost`.
    tbt_s: float | None = None
    # The step's time before its prefill work: the decode step for this batch (the engine's
    # decode base, `StepPacer.decode_base_s`) plus the fixed cost a step that mixes in prefill
    # adds (`CorrectedCost.offset_s`).
    decode_step_s: float = 0.0
    prefill_cost: PrefillCost | None = None


@dataclass(slots=True)
class Lease:
    """One admission of a request: its KV blocks (block-manager table `key`), its token slot
    (the device row its sampled tokens are written to; -1 when it samples nothing), and how
    many launched steps still use them."""

    request: Request
    key: str
    slot: int
    num_inflight: int = 0  # launched steps including it whose results are not applied yet
    held: bool = False  # an asynchronous prefill of it is in flight
    # A step that samples into the slot was planned: from now on the pending token is the
    # last sample (a decode reads it from the slot), not a prompt token the host knows.
    sampled: bool = False
    released: bool = False  # finished or preempted: free blocks and slot once num_inflight == 0


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in a step."""

    request: Request
    lease: Lease
    num_context_tokens: int  # KV already in the pool (prefix hits + earlier steps)
    num_new_tokens: int  # tokens computed this step
    num_kept_tokens: int  # KV the pool holds after this step (< context + new: discarded)
    block_ids: list[int]  # snapshot of the block table (covers [0, num_kept_tokens))
    # The new tokens, for prefill parts. Empty for a decode: its one input token is read on
    # the device from the lease's slot (the previous step's sample).
    input_ids: list[int]
    needs_output: bool  # this step reaches the last pending token: sample or score
    # Sample a token into the lease's slot (GENERATE with max_tokens > 0).
    samples: bool = False
    # The final prefill chunk of a request with penalties: (re)initialise its penalty state
    # from its prompt and the output it already has (after a preemption).
    init_penalties: bool = False
    # The token it samples comes before the request's `min_tokens`: stop tokens are masked.
    bans_stop: bool = False

    @property
    def slot(self) -> int:
        return self.lease.slot


@dataclass(slots=True)
class StepPlan:
    step_id: int
    prefill: list[ScheduledSeq] = field(default_factory=list)
    decode: list[ScheduledSeq] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefill) + len(self.decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefill)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.prefill + self.decode


@dataclass(slots=True)
class RunnerOutput:
    """What a step produced, by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    label_probs: dict[str, list[float]] = field(default_factory=dict)
    # Prompt logprobs of this step's prefill chunk: one entry per chunk token whose next token
    # is a prompt token (entry i is the logprob of token i + 1 of the chunk's positions).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(slots=True)
class _Tracking:
    """Per-request scheduler state that does not belong on `Request`."""

    lease: Lease | None = None
    # Memo of full-block chain digests (one per 16 tokens of a long prompt; the API server
    # sends the prompt's, `Request.block_hashes`): bytes only, so out of the collector's
    # sight like the prompt's tokens (runtime/diagnostics/gc_watch.py).
    block_hashes: list[bytes] = field(default_factory=lambda: untrack_int_list([]))
    digest_seed: bytes = b""  # the first block's parent: the request's `cache_salt` digested
    cached_gen: int = -1  # prefix-cache generation of the memo below
    cached_evictions: int = 0  # prefix-cache eviction count of the memo
    cached_tokens_at: int = -1  # num_tokens the memo was computed for
    cached_blocks: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # accumulated over chunks
    prompt_logprobs_sent: bool = False
    # The lease a preemption gave up while a launched step still used it (else None): until
    # it is freed, the request's per-request device state stays (`_finish`).
    preempted_lease: Lease | None = None


class SlotPool:
    """Rows of the device token table (one per admitted request that samples)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        if slot >= 0:
            self._free.append(slot)


def num_token_slots(max_num_seqs: int) -> int:
    """Rows of the device token table: the running requests, plus as many leases released
    while a launched step still used them (each at most one step behind)."""
    return 2 * max_num_seqs + 2


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        policy: PolicyLike,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.slots = SlotPool(num_token_slots(config.max_num_seqs))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._track: dict[str, _Tracking] = {}
        self._arrival_seq: dict[str, int] = {}
        self._next_seq = 0
        self._next_step = 0
        self._time_left_s: float | None = None  # TBT seconds left for this step's prefill work
        # (step id, waiting count, policy order) computed by `outlook` for the next step
        self._order_memo: tuple[int, int, list[Request]] | None = None
        self._pending: list[EngineOutput] = []  # outputs produced outside update()
        self._num_leases = 0
        self._num_unreleased = 0  # leases released by their request but still in use by steps
        self._released: list[str] = []  # see take_released
        # Counters for stats().
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_preemptions = 0
        self.num_shared_prefix_waits = 0  # (request, step) pairs deferred for a shared prefix
        self.num_chunked_scoring = 0  # scoring prompts admitted as chunks (next to decodes)

    # ---- queue management ---------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_held(self, request_id: str) -> bool:
        """An asynchronous prefill of it is in flight (split executor)."""
        t = self._track.get(request_id)
        return t is not None and t.lease is not None and t.lease.held

    @property
    def num_held(self) -> int:
        return sum(1 for t in self._track.values() if t.lease is not None and t.lease.held)

    def has_work(self) -> bool:
        """Requests to schedule or outputs to deliver (steps in flight are the executor's)."""
        return bool(self.waiting or self.running or self._pending)

    def get(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

    def add(self, req: Request) -> None:
        if req.request_id in self._track:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.WAITING
        t = self._track[req.request_id] = _Tracking(digest_seed=salt_digest(req.cache_salt))
        # The prompt's digests as the API server computed them (the same in every process);
        # a list of any other length than one a full block of the prompt is recomputed here.
        if len(req.block_hashes) == req.num_prompt_tokens // self.block_size:
            t.block_hashes = untrack_int_list(req.block_hashes)  # taken over, not copied
        req.block_hashes = []
        self._arrival_seq[req.request_id] = self._next_seq
        self._next_seq += 1
        self.waiting.append(req)

    def set_policy(self, policy: PolicyLike) -> None:
        self.policy = policy

    def abort(self, request_id: str) -> EngineOutput | None:
        """Finish a waiting or running request as aborted, freeing its KV (once no launched
        step uses it). None if unknown or already finished."""
        req = self.get(request_id)
        if req is None:
            return None
        return self._finish(req, RequestStatus.FINISHED_ABORTED)

    def fail(self, request_ids: Iterable[str], message: str) -> list[EngineOutput]:
        """Finish requests with FINISHED_ERROR (e.g. their step raised)."""
        outs = []
        for rid in request_ids:
            req = self.get(rid)
            if req is not None:
                outs.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=message))
        return outs

    def take_pending_outputs(self) -> list[EngineOutput]:
        outs, self._pending = self._pending, []
        return outs

    def retire(self, plan: StepPlan) -> None:
        """A launched step's results will never be applied (it failed): its seqs no longer
        use their leases. Their requests are finished or re-run by the caller."""
        for seq in plan.seqs:
            self._retire_seq(seq)

    def _retire_seq(self, seq: ScheduledSeq) -> None:
        lease = seq.lease
        lease.num_inflight -= 1
        lease.held = False
        if lease.released and lease.num_inflight == 0:
            self._num_unreleased -= 1
            self._free_lease(lease)

    # ---- prefix lookups (continuous calibration) -------------------------------------------
    def _uses_prefix_cache(self, req: Request) -> bool:
        """Whether `req` may start from cached blocks: not when it asks for prompt logprobs
        (every prompt position's logits are wanted, so it computes them all)."""
        return self.config.enable_prefix_cache and req.sampling.prompt_logprobs is None

    def _cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """(block ids, tokens) of the cached prefix of the tokens to prefill, capped so that at
        least one token is computed. Memoized until the cache generation or tokens change."""
        cache = self.bm.prefix_cache
        if cache is None or not self._uses_prefix_cache(req):
            return [], 0
        t = self._track[req.request_id]
        num_tokens = req.num_tokens
        if t.cached_gen != cache.generation or t.cached_tokens_at != num_tokens:
            # Cheap refresh: insertions only extend a cached prefix, so the walk resumes after
            # the memo; after evictions the memo is first cut at its first evicted block.
            max_blocks = (num_tokens - 1) // self.block_size
            self._digests(req, t, max_blocks)
            known = t.cached_blocks
            if t.cached_evictions != cache.num_evictions:
                n_valid = cache.num_still_cached(known, t.block_hashes)
                if n_valid < len(known):
                    known = untrack_int_list(known[:n_valid])
            if len(known) > max_blocks:
                known = untrack_int_list(known[:max_blocks])
            # Only the blocks past the known prefix are looked up, and the list is rebuilt
            # only when some are found (never changed in place: `_admit` may hold it).
            more = cache.extend_match(t.block_hashes, len(known), max_blocks)
            if more:
                known = untrack_int_list([*known, *more])
            t.cached_blocks = known
            t.cached_gen = cache.generation
            t.cached_evictions = cache.num_evictions
            t.cached_tokens_at = num_tokens
        return t.cached_blocks, len(t.cached_blocks) * self.block_size

    def view(self, req: Request) -> WaitingView:
        return WaitingView(
            request_id=req.request_id,
            arrival_s=req.arrival_s,
            num_prompt_tokens=req.num_tokens,
            remaining_prompt_tokens=req.num_tokens - req.num_computed_tokens,
            num_cached_tokens_now=lambda: self._cached_prefix(req)[1],
        )

    def ordered_waiting(self, now_s: float) -> list[Request]:
        """Waiting requests in policy order (lowest score, then arrival, then add order)."""
        keyed = [
            (
                self.policy.score(self.view(r), now_s),
                r.arrival_s,
                self._arrival_seq[r.request_id],
                r,
            )
            for r in self.waiting
        ]
        keyed.sort(key=lambda k: k[:3])
        return [k[3] for k in keyed]

    def prefill_backlog(self) -> list[tuple[int, int]]:
        """(uncached tokens, cached tokens) of the prefill work queued now: waiting requests
        and the unfinished prefills of running ones (for the JCT model's backlog estimate)."""
        out = []
        for r in self.waiting:
            _, cached = self._cached_prefix(r)
            out.append((max(1, r.num_tokens - cached), cached))
        for r in self.running:
            lease = self._track[r.request_id].lease
            remaining = r.num_total_tokens - r.num_computed_tokens
            if remaining > 0 and lease is not None and not lease.sampled:
                out.append((remaining, r.num_computed_tokens))
        return out

    # ---- outlook (before a step is planned) ------------------------------------------------
    def outlook(self, chunk_scoring: bool = True) -> StepOutlook:
        """The head of the prefill queue and the decode batch the next `schedule` would start
        from (same order: a prefill in progress, else the first waiting request in policy
        order; the decodes as `_plan_decodes` picks them, before any preemption). Changes
        nothing; the policy order computed here is reused by the next `schedule` if the
        waiting queue is unchanged. `chunk_scoring`: whether the executor may chunk a long
        scoring prompt next to decodes (`StepCapacity.chunk_scoring`)."""
        num_decodes = decode_ctx = 0
        head: tuple[int, int, bool] | None = None
        for req in self.running:
            lease = self._track[req.request_id].lease
            if lease is None or req.status != RequestStatus.RUNNING:
                continue
            remaining = req.num_total_tokens - req.num_computed_tokens
            if lease.sampled:
                # A held one's sampled prefill is still in flight (the split executor holds
                # its prefills, whole-GPU ones too): it decodes as soon as that step is
                # applied, beside whatever is planned now, so it counts (`decodes_ahead`).
                if _decodes_after_sample(req) and not _grammar_waits(req):
                    num_decodes += 1
                    decode_ctx += req.num_computed_tokens
            elif remaining > 0 and head is None and not lease.held:
                # Admitted with the KV of its whole prompt: it may continue by chunks.
                head = (remaining, req.num_computed_tokens, True)
        self._order_memo = None
        if head is None and self.waiting and len(self.running) < self.config.max_num_seqs:
            ordered = self.ordered_waiting(self.clock())
            self._order_memo = (self._next_step, len(self.waiting), ordered)
            req = ordered[0]
            prefix_blocks, cached = self._cached_prefix(req)
            chunkable = req.kind != RequestKind.SCORE
            if not chunkable and chunk_scoring and num_decodes:
                # As `_admit`: a scoring prompt is chunked next to decodes when its whole KV
                # fits the pool now (else it runs whole, hybrid, its suffix KV discarded).
                need = self.bm.num_blocks_for(req.num_tokens) - len(prefix_blocks)
                chunkable = self.bm.can_allocate(need, prefix_blocks)
            head = (req.num_tokens - cached, cached, chunkable)
        tokens, context, chunkable = head if head is not None else (0, 0, False)
        return StepOutlook(tokens, context, chunkable, num_decodes, decode_ctx)

    def decodes_ahead(
        self, planned: Iterable[ScheduledSeq] = (), launching: Iterable[ScheduledSeq] = ()
    ) -> tuple[int, int]:
        """(generations, their context tokens) that decode over the steps after the one
        being launched: those `planned` as its decodes, and every running generation with a
        sample in flight or on the host and samples left to plan, held ones included (their
        sampled prefill still in flight), but not those of the prefill `launching` now (they
        decode after it, not beside it). What that prefill runs beside: counting only the
        launched step's decodes, the split executor ran 40-56k-token scoring prompts on the
        whole GPU right after a step that prefilled a burst of chats (held, so not yet
        decodes), and those chats' second tokens waited 1.6-2.6 s (8B on an H100)."""
        seen = {s.request.request_id for s in planned}
        num, ctx = len(seen), sum(s.num_context_tokens for s in planned)
        seen.update(s.request.request_id for s in launching)
        for req in self.running:
            lease = self._track[req.request_id].lease
            if (
                lease is None
                or not lease.sampled
                or req.request_id in seen
                or not _decodes_after_sample(req)
            ):
                continue
            num += 1
            ctx += req.num_computed_tokens
        return num, ctx

    def num_sole_scoring_blocks(self) -> int:
        """KV blocks that only running scoring prompts hold: they go back (the suffix
        discarded, the prefix evictable in the cache) when those prefills end. O(their
        blocks)."""
        n = 0
        for req in self.running:
            if req.kind is RequestKind.SCORE:
                lease = self._track[req.request_id].lease
                if lease is not None and self.bm.has(lease.key):
                    n += self.bm.num_sole_blocks(lease.key)
        return n

    def _waiting_in_order(self, now_s: float) -> list[Request]:
        """`ordered_waiting`, or the order `outlook` just computed for this step."""
        memo, self._order_memo = self._order_memo, None
        if memo is not None and memo[0] == self._next_step - 1 and memo[1] == len(self.waiting):
            return memo[2]
        return self.ordered_waiting(now_s)

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self, capacity: StepCapacity) -> StepPlan:
        """Plan one step within `capacity`. The counters of what is planned advance now."""
        plan = StepPlan(step_id=self._next_step)
        self._next_step += 1
        budget = capacity.prefill_token_budget
        preempted_before = self.num_preemptions
        num_decode = self._plan_decodes(plan)
        if num_decode and capacity.mixed_step_token_budget is not None:
            budget = min(budget, capacity.mixed_step_token_budget)
        if budget > 0:
            if capacity.decodes_share_budget:
                budget -= num_decode
            admit = self.num_preemptions == preempted_before
            self._time_left_s = (
                capacity.tbt_s - capacity.decode_step_s
                if capacity.tbt_s is not None and capacity.prefill_cost is not None and num_decode
                else None
            )
            self._plan_prefills(plan, budget, admit, capacity)
        for seq in plan.prefill:
            seq.lease.num_inflight += 1
            if capacity.hold_prefills:
                seq.lease.held = True
        for seq in plan.decode:
            seq.lease.num_inflight += 1
        if not plan.is_empty:
            self.num_steps += 1
            self.num_prefill_tokens += plan.num_prefill_tokens
            self.num_decode_tokens += len(plan.decode)
        return plan

    def _victim(self, req: Request) -> Request:
        """The most recently admitted running request not held (else `req` itself)."""
        for r in reversed(self.running):
            lease = self._track[r.request_id].lease
            if lease is not None and not lease.held:
                return r
        return req

    def _plan_decodes(self, plan: StepPlan) -> int:
        """Decodes, FCFS; victims for preemption come from the tail (latest admitted).
        Returns the number of decode tokens planned."""
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted above as a victim
            lease = self._track[req.request_id].lease
            assert lease is not None
            if lease.held or not lease.sampled:
                continue  # prefilling (its pending tokens are prompt tokens: planned below)
            computed = req.num_computed_tokens
            if req.num_total_tokens - computed != 1:
                continue
            if _samples_left(req) <= 0:
                continue  # its last token is in flight: the update finishes it
            if _grammar_waits(req):
                continue  # its mask needs the tokens in flight: the runner waits for one only
            need = self.bm.num_blocks_for(computed + 1)
            ok = True
            while len(self.bm.table(lease.key)) < need:
                if self.bm.num_free_blocks > 0:
                    self.bm.append_blocks(lease.key, 1)
                    continue
                victim = self._victim(req)
                if victim is not req and self._answered_in_flight(victim):
                    # A launched step answers it, and its blocks come back when that step's
                    # results are applied: preempting it would only throw the step away. On
                    # an H100 (8B in 24 GB, credit-verification scoring next to chat, `off`)
                    # a 50k-token whole prefill was preempted so by the chats' decodes, and
                    # re-run, up to 7 times (2.3 s each). This decode waits a step instead.
                    ok = False
                    break
                victim_lease = self._track[victim.request_id].lease
                frees_now = victim_lease is not None and victim_lease.num_inflight == 0
                self._preempt(victim)
                if victim is req or not frees_now:
                    # A victim with a step in flight gives its blocks back when that step's
                    # results are applied: try again next step rather than preempt more.
                    ok = False
                    break
            if not ok:
                continue
            plan.decode.append(self._seq(req, lease, 1, computed + 1, True, decode=True))
        return len(plan.decode)

    def _answered_in_flight(self, req: Request) -> bool:
        """Whether a step already planned or launched gives `req` its last output (a
        scoring prompt's final prefill, a generation's max_tokens-th sample): applied, it
        finishes the request and releases its blocks."""
        lease = self._track[req.request_id].lease
        if lease is None or lease.num_inflight == 0 or req.num_computed_tokens < req.num_tokens:
            return False  # nothing in flight, or prompt (or output) tokens still to compute
        return req.kind == RequestKind.SCORE or _samples_left(req) <= 0

    def _decode_reserve_blocks(self, plan: StepPlan, capacity: StepCapacity) -> int:
        """Blocks a whole scoring prompt admitted into `plan` leaves free for the decodes
        beside it: a block each for the next step (planned while this one runs); with held
        prefills (the split executor runs the prompt beside decode steps for its whole
        length) what each may grow in HELD_DECODE_RESERVE_TOKENS tokens, at most to its
        max_tokens."""
        if not capacity.hold_prefills:
            return len(plan.decode)
        blocks = 0
        for seq in plan.decode:
            req = seq.request
            grow = min(HELD_DECODE_RESERVE_TOKENS, max(0, _samples_left(req)))
            need = self.bm.num_blocks_for(req.num_computed_tokens + grow)
            blocks += max(0, need - len(self.bm.table(seq.lease.key)))
        return blocks

    def _plan_prefills(
        self, plan: StepPlan, budget: int, admit: bool, capacity: StepCapacity
    ) -> None:
        """Prefills in progress, then admissions in policy order. No admissions in a step that
        had to preempt (`admit` False): the pool is short, and re-admitting the victim at once
        would only thrash."""
        now = self.clock()
        for req in self.running:
            lease = self._track[req.request_id].lease
            assert lease is not None
            if lease.held or req.status != RequestStatus.RUNNING:
                continue
            remaining = req.num_total_tokens - req.num_computed_tokens
            if remaining <= 0 or lease.sampled:
                continue  # done, or decoding (planned above, or its last token in flight)
            first = not plan.prefill
            n = self._chunk(
                remaining, self._timed(budget, req.num_computed_tokens, first, capacity), first
            )
            if n <= 0:
                break
            self._spend(n, req.num_computed_tokens, capacity)
            done = req.num_computed_tokens + n == req.num_total_tokens
            plan.prefill.append(self._seq(req, lease, n, req.num_computed_tokens + n, done))
            budget -= n

        if not admit:
            return
        wait_tokens = self.config.wait_for_shared_prefix_tokens
        sharing = (
            wait_tokens > 0 and self.config.enable_prefix_cache and self.bm.prefix_cache is not None
        )
        being_prefilled = self._blocks_being_prefilled() if sharing and self.waiting else set()
        decoding = bool(plan.decode)
        reserve_blocks = self._decode_reserve_blocks(plan, capacity) if self.waiting else 0
        for req in self._waiting_in_order(now):
            if len(self.running) >= self.config.max_num_seqs:
                break
            first = not plan.prefill
            if budget <= 0 and not first:
                break
            if sharing and self._shared_tokens_being_prefilled(req, being_prefilled) >= wait_tokens:
                # Its prefix is being computed right now: once cached, it is a hit. Skipped,
                # not a stop: the requests after it in policy order may still run.
                self.num_shared_prefix_waits += 1
                continue
            chunk_ok = capacity.chunk_scoring and decoding
            seq = self._admit(
                req,
                budget,
                first,
                chunk_ok,
                nothing_running=not self.running,
                capacity=capacity,
                reserve_blocks=reserve_blocks,
            )
            if seq is None:
                break
            self._spend(seq.num_new_tokens, seq.num_context_tokens, capacity)
            plan.prefill.append(seq)
            budget -= seq.num_new_tokens
            if sharing:
                self._add_blocks_being_prefilled(req, being_prefilled)
            t = self._track[req.request_id]
            if t.first_scheduled_s is None:
                t.first_scheduled_s = now

    # ---- shared prefixes being prefilled -------------------------------------------------------
    def _blocks_being_prefilled(self) -> set[bytes]:
        """Chain digests of the full blocks that running requests are prefilling now (planned,
        or computed by a step whose results are not applied yet) and will keep: they enter the
        prefix cache when that prefill's results are applied."""
        out: set[bytes] = set()
        for req in self.running:
            self._add_blocks_being_prefilled(req, out)
        return out

    def _add_blocks_being_prefilled(self, req: Request, out: set[bytes]) -> None:
        t = self._track[req.request_id]
        if t.lease is None:
            return
        # Kept blocks: a scoring request keeps only what the pool could hold (suffix discard).
        num_kept = min(len(self.bm.table(t.lease.key)), req.num_tokens // self.block_size)
        # Blocks already offered to the prefix cache (hits, applied chunks) need no waiting.
        first = self.bm.num_offered_blocks(t.lease.key)
        if first >= num_kept:
            return
        out.update(self._digests(req, t, num_kept)[first:num_kept])

    def _shared_tokens_being_prefilled(self, req: Request, being_prefilled: set[bytes]) -> int:
        """Tokens right after `req`'s cached prefix that a running request is computing now
        (0 for a request that would not read them from the cache: it must not wait)."""
        if not being_prefilled or not self._uses_prefix_cache(req):
            return 0
        prefix_blocks, _ = self._cached_prefix(req)  # also fills the block-hash memo
        hashes = self._track[req.request_id].block_hashes
        n = 0
        for h in hashes[len(prefix_blocks) : (req.num_tokens - 1) // self.block_size]:
            if h not in being_prefilled:
                break
            n += 1
        return n * self.block_size

    def _timed(self, budget: int, cached: int, first: bool, capacity: StepCapacity) -> int:
        """`budget` cut to what the step's TBT time left allows for a prefill after `cached`
        tokens (the first chunk of a step gets at least MIN_TBT_CHUNK_TOKENS)."""
        if self._time_left_s is None or capacity.prefill_cost is None:
            return budget
        if first:
            return min(budget, tbt_chunk_tokens(capacity.prefill_cost, self._time_left_s, cached))
        return min(budget, capacity.prefill_cost.max_tokens_within(self._time_left_s, cached))

    def _spend(self, num_tokens: int, cached: int, capacity: StepCapacity) -> None:
        if self._time_left_s is not None and capacity.prefill_cost is not None:
            self._time_left_s -= capacity.prefill_cost.marginal_s(num_tokens, cached)

    def _chunk(self, remaining: int, budget: int, first: bool) -> int:
        """Tokens of a chunked prefill to run now."""
        if first:
            return min(remaining, max(budget, self.block_size))
        return min(remaining, budget)

    def _admit(
        self,
        req: Request,
        budget: int,
        first: bool,
        chunk_ok: bool,
        nothing_running: bool,
        capacity: StepCapacity,
        reserve_blocks: int = 0,
    ) -> ScheduledSeq | None:
        """Allocate KV for a waiting request and move it to running; None to stop admitting.
        `reserve_blocks`: what a whole scoring prompt leaves free for the decodes beside it
        (`_decode_reserve_blocks`)."""
        bs = self.block_size
        samples = req.kind == RequestKind.GENERATE and req.sampling.max_tokens > 0
        if samples and self.slots.num_free == 0:
            return None  # every token slot is in use by a lease in flight: wait a step
        prefix_blocks, cached = self._cached_prefix(req)
        budget = self._timed(budget, cached, first, capacity)
        num_new = req.num_tokens - cached
        chunked_score = False
        if req.kind == RequestKind.SCORE and num_new > budget and chunk_ok:
            # Long scoring prompt next to decodes: chunk it if its whole KV fits now.
            need = self.bm.num_blocks_for(req.num_tokens) - len(prefix_blocks)
            chunked_score = self.bm.can_allocate(need, prefix_blocks)
        if req.kind == RequestKind.SCORE and not chunked_score:
            if num_new > budget and not first:
                return None  # runs in a step of its own, whole
            n = num_new
            num_full = req.num_tokens // bs
            caching = self.config.enable_prefix_cache and self.bm.prefix_cache is not None
            # Blocks it may keep: what is free, less its pinned prefix hits and what the decodes
            # beside it will need (else their next blocks come from preempting someone).
            pinned = self.bm.num_pinned(prefix_blocks) if caching else 0
            room = self.bm.num_free_blocks - pinned - reserve_blocks
            keep_new = max(0, min(num_full - len(prefix_blocks), room)) if caching else 0
            num_kept = (len(prefix_blocks) + keep_new) * bs
            # Keep the last partial block too when the pool has one more block: then every new
            # token is written and nothing in the step is discarded. One discarding member is
            # enough for the backend to copy the whole context of EVERY member with context
            # (a prefix hit's, a chat chunk's) out of the pool in every layer, instead of
            # reading it in place (FlashInfer's paged prefill), and for the step not to merge
            # with decodes (runner._mergeable). So a cold prompt keeps it as well, not only one
            # after a hit (as until 2026-12-05). The block is freed with the request (a partial
            # block is never cached).
            whole_kept = keep_new == num_full - len(prefix_blocks)
            if whole_kept and req.num_tokens % bs:
                if room > keep_new:
                    keep_new += 1
                    num_kept = req.num_tokens
            num_blocks_new = keep_new
        else:
            n = self._chunk(num_new, budget, first)
            if n <= 0:
                return None
            num_blocks_new = self.bm.num_blocks_for(req.num_tokens) - len(prefix_blocks)
            if not self.bm.can_allocate(num_blocks_new, prefix_blocks):
                if nothing_running and self._num_unreleased == 0:
                    # Every block is free or evictable and it still does not fit: it never
                    # will (the engine validates lengths first; this is the backstop).
                    self._pending.append(
                        self._finish(
                            req,
                            RequestStatus.FINISHED_ERROR,
                            error=f"prompt of {req.num_tokens} tokens needs more KV blocks than "
                            f"the pool has ({self.bm.num_blocks} x {bs} tokens)",
                        )
                    )
                return None  # waits for blocks (strict policy order)
            num_kept = cached + n
            if chunked_score:
                self.num_chunked_scoring += 1
        t = self._track[req.request_id]
        lease = Lease(
            req, f"{req.request_id}#{self._num_leases}", self.slots.take() if samples else -1
        )
        self._num_leases += 1
        self.bm.allocate(lease.key, num_blocks_new, prefix_blocks)
        t.lease = lease
        first_admission = req.num_preemptions == 0
        if first_admission:
            req.num_cached_tokens = cached
            if self.bm.prefix_cache is not None:
                self.bm.prefix_cache.record_query(req.num_prompt_tokens, cached)
        req.num_computed_tokens = cached
        req.num_output_placeholders = 0
        req.status = RequestStatus.RUNNING
        _remove(self.waiting, req)
        self.running.append(req)
        done = cached + n == req.num_tokens
        return self._seq(req, lease, n, num_kept, done)

    def _seq(
        self,
        req: Request,
        lease: Lease,
        n: int,
        num_kept: int,
        needs_output: bool,
        decode: bool = False,
    ) -> ScheduledSeq:
        """The step's work for `req`; advances its counters (overlapped scheduling)."""
        start = req.num_computed_tokens
        samples = needs_output and lease.slot >= 0
        seq = ScheduledSeq(
            request=req,
            lease=lease,
            num_context_tokens=start,
            num_new_tokens=n,
            num_kept_tokens=num_kept,
            block_ids=list(self.bm.table(lease.key)),
            input_ids=[] if decode else _token_slice(req, start, n),
            needs_output=needs_output,
            samples=samples,
            init_penalties=samples and not decode and _has_penalties(req),
            # The output index of this sample: what the host has plus the samples in flight.
            bans_stop=samples
            and req.num_output_tokens + req.num_output_placeholders < req.sampling.min_tokens,
        )
        req.num_computed_tokens = start + n
        if samples:
            req.num_output_placeholders += 1
            lease.sampled = True
        return seq

    def _preempt(self, req: Request) -> None:
        t = self._track[req.request_id]
        assert t.lease is not None
        self._release(t.lease)
        t.preempted_lease = t.lease if t.lease.num_inflight else None
        t.lease = None
        _remove(self.running, req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def _release(self, lease: Lease) -> None:
        lease.released = True
        if lease.num_inflight == 0:
            self._free_lease(lease)
        else:
            self._num_unreleased += 1

    def _free_lease(self, lease: Lease) -> None:
        if lease.num_inflight < 0:
            raise AssertionError(f"lease {lease.key} retired more often than launched")
        self.bm.free(lease.key)
        self.slots.give(lease.slot)
        lease.slot = -1
        if lease.request.is_finished:
            self._released.append(lease.request.request_id)

    def take_released(self) -> list[str]:
        """Finished requests whose last lease was freed since the last call: nothing launched
        uses them any more, so per-request device state (generators, penalty rows) may go."""
        out, self._released = self._released, []
        return out

    # ---- update ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, out: RunnerOutput) -> list[EngineOutput]:
        """Apply a launched step's results (in launch order per request); returns outputs for
        requests that made visible progress."""
        outputs = self.take_pending_outputs()
        now = self.clock()
        for seq in plan.seqs:
            req = seq.request
            if not seq.lease.released and req.status == RequestStatus.RUNNING:
                self._cache_computed_blocks(req, seq)
                if req.sampling.prompt_logprobs is not None:
                    self._collect_prompt_logprobs(req, out)
                if seq.needs_output:
                    outputs.append(self._apply_output(req, seq, out, now))
            self._retire_seq(seq)
        return outputs

    def _apply_output(
        self, req: Request, seq: ScheduledSeq, out: RunnerOutput, now: float
    ) -> EngineOutput:
        if req.kind == RequestKind.SCORE:
            req.first_token_s = now
            return self._finish(
                req, RequestStatus.FINISHED_STOPPED, label_probs=out.label_probs[req.request_id]
            )
        if not seq.samples:  # max_tokens == 0: the prompt (logprobs) was all that was asked
            req.first_token_s = now
            return self._finish(req, RequestStatus.FINISHED_LENGTH)
        token = out.sampled_token_ids[req.request_id]
        return self._append_token(req, token, out.logprobs.get(req.request_id), now)

    def _collect_prompt_logprobs(self, req: Request, out: RunnerOutput) -> None:
        t = self._track[req.request_id]
        if t.prompt_logprobs is None:
            # The first prompt token has no logprob. Set before any chunk: a one-token prompt
            # predicts nothing (the runner sends no chunk), and its answer is this [None].
            t.prompt_logprobs = [None]
        chunk = out.prompt_logprobs.get(req.request_id)
        if chunk is None:
            return
        room = req.num_prompt_tokens - len(t.prompt_logprobs)
        t.prompt_logprobs.extend(chunk[:room])

    def _cache_computed_blocks(self, req: Request, seq: ScheduledSeq) -> None:
        if not self.config.enable_prefix_cache or self.bm.prefix_cache is None:
            return
        # Full blocks within what this step computed and keeps; their tokens are all known to
        # the host (a step's input tokens were sampled by steps already applied).
        num_full = (
            min(seq.num_context_tokens + seq.num_new_tokens, seq.num_kept_tokens) // self.block_size
        )
        # O(1) unless a block was completed: this runs for every decode of every step.
        if num_full <= self.bm.num_offered_blocks(seq.lease.key):
            return
        t = self._track[req.request_id]
        self.bm.cache_full_blocks(seq.lease.key, self._digests(req, t, num_full), num_full)

    def _digests(self, req: Request, t: _Tracking, num_blocks: int) -> list[bytes]:
        """The request's digest memo, extended to cover at least its first `num_blocks` full
        blocks (whose tokens the host knows). Only the missing blocks' tokens are cut: a
        decode's whole sequence is never copied."""
        have = len(t.block_hashes)
        if have < num_blocks:
            bs = self.block_size
            new_ids = _token_slice(req, have * bs, (num_blocks - have) * bs)
            append_block_hashes(t.block_hashes, new_ids, bs, t.digest_seed)
        return t.block_hashes

    def _append_token(
        self, req: Request, token: int, logprob: TokenLogprob | None, now: float
    ) -> EngineOutput:
        sp = req.sampling
        req.num_output_placeholders -= 1
        req.output_token_ids.append(token)
        if req.first_token_s is None:
            req.first_token_s = now
        status = RequestStatus.RUNNING
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= sp.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        logprobs = [logprob] if logprob is not None else []
        if status.is_finished:
            return self._finish(req, status, new_token_ids=[token], new_logprobs=logprobs)
        t = self._track[req.request_id]
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_logprobs=logprobs,
            prompt_logprobs=self._take_prompt_logprobs(t),
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            queue_s=_sub(t.first_scheduled_s, req.arrival_s),
            ttft_s=req.first_token_s - req.arrival_s,
        )

    @staticmethod
    def _take_prompt_logprobs(t: _Tracking) -> list[TokenLogprob | None] | None:
        if t.prompt_logprobs is None or t.prompt_logprobs_sent:
            return None
        t.prompt_logprobs_sent = True
        return t.prompt_logprobs

    def _finish(
        self,
        req: Request,
        status: RequestStatus,
        *,
        error: str | None = None,
        label_probs: list[float] | None = None,
        new_token_ids: list[int] | None = None,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> EngineOutput:
        """Move a request to a finished state, release its KV, and build its last output."""
        now = self.clock()
        req.status = status
        req.finish_s = now
        req.error = error
        t = self._track.pop(req.request_id, None)
        if t is not None and t.lease is not None:
            self._release(t.lease)
        elif t is None or t.preempted_lease is None or t.preempted_lease.num_inflight == 0:
            # No lease in use (still waiting, or preempted and waiting again): its per-request
            # state (a grammar's matcher, a preempted request's penalty row and generator) may
            # go now; a preempted lease still in flight releases it when freed (`_free_lease`).
            self._released.append(req.request_id)
        if not _remove(self.running, req):
            _remove(self.waiting, req)
        self._arrival_seq.pop(req.request_id, None)
        first_scheduled = None if t is None else t.first_scheduled_s
        first_token = req.first_token_s
        return EngineOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids or [],
            new_logprobs=new_logprobs or [],
            label_probs=label_probs,
            prompt_logprobs=None if t is None else self._take_prompt_logprobs(t),
            finished=True,
            finish_reason=FINISH_REASONS[status],
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            queue_s=_sub(first_scheduled, req.arrival_s),
            ttft_s=_sub(first_token, req.arrival_s),
            e2e_s=now - req.arrival_s,
            prefill_s=_sub(first_token, first_scheduled),
            decode_s=_sub(now, first_token),
        )

    # ---- checks -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Block-manager invariants plus: every running request holds a live lease."""
        self.bm.check_integrity()
        for req in self.running:
            lease = self._track[req.request_id].lease
            assert lease is not None and not lease.released, f"{req.request_id} has no lease"
            assert self.bm.has(lease.key)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _has_penalties(req: Request) -> bool:
    sp = req.sampling
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0)


def _remove(requests: list[Request], req: Request) -> bool:
    """Remove `req` by identity (Request's dataclass __eq__ compares every field)."""
    for i, r in enumerate(requests):
        if r is req:
            del requests[i]
            return True
    return False


def _token_slice(req: Request, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output without concatenating them (a step must
    not copy the whole sequence). Only known tokens: prefill chunks never reach a
    placeholder (a re-prefill after preemption starts with no placeholders)."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p : start - p + n]
    if start + n <= p:
        return req.prompt_token_ids[start : start + n]
    return req.prompt_token_ids[start:] + req.output_token_ids[: start + n - p]
