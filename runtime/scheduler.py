"""The scheduler: which tokens of which requests run in the next step, and what came of them.

Queues
  - waiting: requests without KV (new, or preempted). Ordered at every decision by the prefill
    policy (`policy.score(view, now_s)`, lowest first, ties by arrival), where each view
    carries the cached-prefix length looked up *now* (continuous calibration; memoized per
    request and invalidated by the prefix cache's generation counter).
  - running: requests holding KV blocks, in admission order: chunked prefills in progress and
    decodes. Decode admission is FCFS (admission order).

One step (`schedule()`), the monolithic `partition=off` shape (as in vLLM v1): decode tokens and
prefill work share one token budget (`prefill_token_budget`):
  1. every running request with one pending token decodes (1 token each, FCFS). If it needs a
     new block and none is left, the most recently admitted running request is preempted
     (recompute style: its blocks are freed, it goes back to waiting with its output so far,
     `num_preemptions` += 1; it re-prefills prompt + output later, mostly from the cache);
  2. chunked prefills in progress continue, then waiting requests are admitted in policy
     order while the budget, `max_num_seqs` and the KV pool allow. The first prefill of a
     step always runs so that prefill never starves behind decode: a SCORE request whole
     (scoring prompts are never chunked: one forward, hybrid prefill bounds its memory), a
     GENERATE prompt as a chunk of at least one block. A later request that does not fit
     the remaining budget stops admission (strict policy order): SCORE waits for a step of
     its own, GENERATE is chunked to the remaining budget.
KV admission
  - GENERATE: blocks for all tokens to prefill at admission (minus prefix-cache hits), one
    more block whenever decode crosses a block boundary.
  - SCORE: only the full prompt blocks that the pool can hold right now are allocated
    (suffix-KV discard: `num_kept_tokens`; the last partial block never is). After the answer
    everything is released; the kept full blocks stay in the prefix cache (cached-idle).
  - A prefix hit never covers the whole prompt: the last prompt token is always computed
    (its logits are the answer).
Split mode (partition on, runtime/pd_loop.py): the two parts are scheduled separately, so a
prefill batch can be *in flight* on its own SM partition across several engine-loop iterations
while decode steps continue. `schedule_decode()` plans decodes only; `schedule_prefill()` plans
chunk continuations and admissions only and marks their requests in flight; `end_prefill(plan)`
clears the marks when the prefill's completion event has fired, then `update(plan, out)` applies
it. Requests in flight are never decoded, re-chunked or chosen as preemption victims, and a
request aborted/failed while in flight keeps its KV blocks reserved (not reusable) until
`end_prefill`, because the GPU may still be writing them.
The runner executes a `StepPlan`; `update(plan, out)` turns its results into
`RequestOutput`s (tokens, detokenized text deltas, stop handling, finish states, timings).
The scheduler runs on the engine thread only; it is not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.prefix_cache import extend_block_hashes
from runtime.request import (
    FINISH_REASONS,
    Request,
    RequestKind,
    RequestOutput,
    RequestStatus,
    TokenLogprob,
)
from runtime.tokenizer import IncrementalDetokenizer


class PolicyLike(Protocol):
    name: str

    def score(self, req: Any, now_s: float) -> float: ...


class DecodesText(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class WaitingView:
    """What a policy sees of a waiting request (policies.base.WaitingView)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int  # tokens to prefill (prompt, plus output so far after preemption)
    num_cached_tokens_now: int
    remaining_prompt_tokens: int


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in a step."""

    request: Request
    num_context_tokens: int  # KV already in the pool (prefix hits + earlier steps)
    num_new_tokens: int  # tokens computed this step
    num_kept_tokens: int  # KV the pool holds after this step (< context + new: discarded)
    block_ids: list[int]  # snapshot of the block table (covers [0, num_kept_tokens))
    input_ids: list[int]  # the new tokens
    needs_output: bool  # this step reaches the last token: sample (GENERATE) or score (SCORE)


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
    def seqs(self) -> list[ScheduledSeq]:
        return self.prefill + self.decode


@dataclass(slots=True)
class RunnerOutput:
    """What a step produced, by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    label_probs: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class _Tracking:
    """Per-request scheduler state that does not belong on `Request`."""

    block_hashes: list[int] = field(default_factory=list)  # memo of full-block chain hashes
    cached_gen: int = -1  # prefix-cache generation of the memo below
    cached_evictions: int = 0  # prefix-cache eviction count of the memo
    cached_tokens_at: int = -1  # num_tokens the memo was computed for
    cached_blocks: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""  # generated text so far, including held-back text
    num_sent_chars: int = 0  # prefix of `text` already sent


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        policy: PolicyLike,
        tokenizer: DecodesText | None,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.policy = policy
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._track: dict[str, _Tracking] = {}
        self._arrival_seq: dict[str, int] = {}
        self._next_seq = 0
        self._next_step = 0
        self._pending: list[RequestOutput] = []  # outputs produced outside update()
        self._inflight: set[str] = set()  # split mode: prefill launched, not completed
        self._deferred_free: set[str] = set()  # finished while in flight: blocks still held
        # Counters for stats().
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_preemptions = 0
        self.num_shared_prefix_waits = 0  # (request, step) pairs deferred for a shared prefix

    # ---- queue management ---------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
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
        if req.request_id in self._track or req.request_id in self._deferred_free:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.status = RequestStatus.WAITING
        self._track[req.request_id] = _Tracking()
        self._arrival_seq[req.request_id] = self._next_seq
        self._next_seq += 1
        self.waiting.append(req)

    def set_policy(self, policy: PolicyLike) -> None:
        self.policy = policy

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a waiting or running request as aborted, freeing its KV. None if unknown."""
        req = self.get(request_id)
        if req is None:
            return None
        return self._finish(req, RequestStatus.FINISHED_ABORTED)

    def fail(self, request_ids: Iterable[str], message: str) -> list[RequestOutput]:
        """Finish requests with FINISHED_ERROR (e.g. their step raised), freeing their KV."""
        outs = []
        for rid in request_ids:
            req = self.get(rid)
            if req is not None:
                outs.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=message))
        return outs

    def take_pending_outputs(self) -> list[RequestOutput]:
        outs, self._pending = self._pending, []
        return outs

    # ---- prefix lookups (continuous calibration) -------------------------------------------
    def _cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """(block ids, tokens) of the cached prefix of the tokens to prefill, capped so that at
        least one token is computed. Memoized until the cache generation or tokens change."""
        cache = self.bm.prefix_cache
        if cache is None or not self.config.enable_prefix_cache:
            return [], 0
        t = self._track[req.request_id]
        num_tokens = req.num_tokens
        if t.cached_gen != cache.generation or t.cached_tokens_at != num_tokens:
            # Cheap refresh: insertions only extend a cached prefix, so the walk resumes after
            # the memo; after evictions the memo is first cut at its first evicted block.
            tokens = req.all_token_ids if req.output_token_ids else req.prompt_token_ids
            extend_block_hashes(t.block_hashes, tokens, self.block_size)
            max_blocks = (num_tokens - 1) // self.block_size
            known = t.cached_blocks
            if t.cached_evictions != cache.num_evictions:
                n_valid = 0
                for b, h in zip(known, t.block_hashes, strict=False):
                    if not cache.still_cached(b, h):
                        break
                    n_valid += 1
                known = known[:n_valid]
            t.cached_blocks = cache.lookup(t.block_hashes[:max_blocks], tokens, known)
            t.cached_gen = cache.generation
            t.cached_evictions = cache.num_evictions
            t.cached_tokens_at = num_tokens
        return t.cached_blocks, len(t.cached_blocks) * self.block_size

    def view(self, req: Request) -> WaitingView:
        _, cached = self._cached_prefix(req)
        return WaitingView(
            request_id=req.request_id,
            arrival_s=req.arrival_s,
            num_prompt_tokens=req.num_tokens,
            num_cached_tokens_now=cached,
            remaining_prompt_tokens=req.num_tokens - req.num_computed_tokens,
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

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """One monolithic step: decodes and prefill work under one token budget."""
        plan = self._new_plan()
        budget = self.config.prefill_token_budget
        preempted_before = self.num_preemptions
        budget -= self._plan_decodes(plan)
        self._plan_prefills(plan, budget, admit=self.num_preemptions == preempted_before)
        self._count(plan)
        return plan

    def schedule_decode(self) -> StepPlan:
        """Split mode: a plan with the decode part only (requests in flight excluded)."""
        plan = self._new_plan()
        self._plan_decodes(plan)
        self._count(plan)
        return plan

    def schedule_prefill(self, budget: int | None = None) -> StepPlan:
        """Split mode: a plan with the prefill part only (chunk continuations, then admissions
        in policy order); its requests are marked in flight until `end_prefill(plan)`."""
        plan = self._new_plan()
        b = self.config.prefill_token_budget if budget is None else budget
        self._plan_prefills(plan, b, admit=True)
        for s in plan.prefill:
            self._inflight.add(s.request.request_id)
        self._count(plan)
        return plan

    def end_prefill(self, plan: StepPlan) -> None:
        """The prefill part of `plan` has completed on the device (or failed): its requests
        are no longer in flight; blocks of those finished meanwhile are freed now."""
        for s in plan.prefill:
            rid = s.request.request_id
            self._inflight.discard(rid)
            if rid in self._deferred_free:
                self._deferred_free.discard(rid)
                self.bm.free(rid)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_inflight(self, request_id: str) -> bool:
        return request_id in self._inflight

    def _new_plan(self) -> StepPlan:
        plan = StepPlan(step_id=self._next_step)
        self._next_step += 1
        return plan

    def _count(self, plan: StepPlan) -> None:
        self.num_steps += 0 if plan.is_empty else 1
        self.num_prefill_tokens += sum(s.num_new_tokens for s in plan.prefill)
        self.num_decode_tokens += len(plan.decode)

    def _victim(self, req: Request) -> Request:
        """The most recently admitted running request not in flight (else `req` itself)."""
        for r in reversed(self.running):
            if r.request_id not in self._inflight:
                return r
        return req

    def _plan_decodes(self, plan: StepPlan) -> int:
        """Decodes, FCFS; victims for preemption come from the tail (latest admitted).
        Returns the number of decode tokens planned."""
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted above as a victim
            if req.request_id in self._inflight:
                continue
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            if req.num_computed_tokens == 0:
                continue  # a 1-token prompt: a prefill, handled below
            need = self.bm.num_blocks_for(req.num_computed_tokens + 1)
            ok = True
            while len(self.bm.table(req.request_id)) < need:
                if self.bm.num_free_blocks > 0:
                    self.bm.append_blocks(req.request_id, 1)
                    continue
                victim = self._victim(req)
                self._preempt(victim)
                if victim is req:
                    ok = False
                    break
            if not ok:
                continue
            plan.decode.append(self._seq(req, 1, req.num_computed_tokens + 1, True))
        return len(plan.decode)

    def _plan_prefills(self, plan: StepPlan, budget: int, admit: bool) -> None:
        """Chunked prefills in progress, then admissions in policy order. No admissions in a
        step that had to preempt (`admit` False): the pool is short, and re-admitting the
        victim at once would only thrash."""
        now = self.clock()
        decoding = {s.request.request_id for s in plan.decode}
        for req in self.running:
            if req.request_id in decoding or req.request_id in self._inflight:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0:
                continue
            if remaining == 1 and req.num_computed_tokens > 0:
                continue  # one pending token: the decode part plans it (as `_plan_decodes`)
            n = self._chunk(remaining, budget, first=not plan.prefill)
            if n <= 0:
                break
            done = req.num_computed_tokens + n == req.num_tokens
            plan.prefill.append(self._seq(req, n, req.num_computed_tokens + n, done))
            budget -= n

        wait_tokens = self.config.wait_for_shared_prefix_tokens
        sharing = (
            wait_tokens > 0 and self.config.enable_prefix_cache and self.bm.prefix_cache is not None
        )
        being_prefilled = self._blocks_being_prefilled() if sharing and admit else set()
        for req in self.ordered_waiting(now) if admit else []:
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
            seq = self._admit(req, budget, first, nothing_running=not self.running)
            if seq is None:
                break
            plan.prefill.append(seq)
            budget -= seq.num_new_tokens
            if sharing:
                self._add_blocks_being_prefilled(req, being_prefilled)
            t = self._track[req.request_id]
            if t.first_scheduled_s is None:
                t.first_scheduled_s = now

    # ---- shared prefixes being prefilled -------------------------------------------------------
    def _blocks_being_prefilled(self) -> set[int]:
        """Chain hashes of the full blocks that running requests are prefilling now (or have
        planned) and will keep: they enter the prefix cache when that prefill completes."""
        out: set[int] = set()
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            # (One pending token after a computed prefix is a decode, as in _plan_prefills.)
            if remaining > 1 or (remaining == 1 and req.num_computed_tokens == 0):
                self._add_blocks_being_prefilled(req, out)
        return out

    def _add_blocks_being_prefilled(self, req: Request, out: set[int]) -> None:
        t = self._track[req.request_id]
        # Kept blocks: a scoring request keeps only what the pool could hold (suffix discard).
        num_kept = min(len(self.bm.table(req.request_id)), req.num_tokens // self.block_size)
        # Blocks before num_computed_tokens are in the cache already (hits or earlier chunks).
        first = req.num_computed_tokens // self.block_size
        out.update(t.block_hashes[first:num_kept])

    def _shared_tokens_being_prefilled(self, req: Request, being_prefilled: set[int]) -> int:
        """Tokens right after `req`'s cached prefix that a running request is computing now."""
        if not being_prefilled:
            return 0
        prefix_blocks, _ = self._cached_prefix(req)  # also fills the block-hash memo
        hashes = self._track[req.request_id].block_hashes
        n = 0
        for h in hashes[len(prefix_blocks) : (req.num_tokens - 1) // self.block_size]:
            if h not in being_prefilled:
                break
            n += 1
        return n * self.block_size

    def _chunk(self, remaining: int, budget: int, first: bool) -> int:
        """Tokens of a GENERATE prefill to run now."""
        if first:
            return min(remaining, max(budget, self.block_size))
        return min(remaining, budget)

    def _admit(
        self, req: Request, budget: int, first: bool, nothing_running: bool
    ) -> ScheduledSeq | None:
        """Allocate KV for a waiting request and move it to running; None to stop admitting."""
        bs = self.block_size
        prefix_blocks, cached = self._cached_prefix(req)
        num_new = req.num_tokens - cached
        if req.kind == RequestKind.SCORE:
            if num_new > budget and not first:
                return None  # runs in a step of its own, whole
            n = num_new
            num_full = req.num_tokens // bs
            keep_new = 0
            if self.config.enable_prefix_cache and self.bm.prefix_cache is not None:
                pinned = sum(1 for b in prefix_blocks if self.bm.ref_counts[b] == 0)
                keep_new = max(
                    0, min(num_full - len(prefix_blocks), self.bm.num_free_blocks - pinned)
                )
            num_blocks_new = keep_new
            num_kept = (len(prefix_blocks) + keep_new) * bs
        else:
            n = self._chunk(num_new, budget, first)
            if n <= 0:
                return None
            num_blocks_new = self.bm.num_blocks_for(req.num_tokens) - len(prefix_blocks)
            if not self.bm.can_allocate(num_blocks_new, prefix_blocks):
                if nothing_running:
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
        self.bm.allocate(req.request_id, num_blocks_new, prefix_blocks)
        first_admission = req.num_preemptions == 0
        if first_admission:
            req.num_cached_tokens = cached
            if self.bm.prefix_cache is not None:
                self.bm.prefix_cache.record_query(req.num_prompt_tokens, cached)
        req.num_computed_tokens = cached
        req.status = RequestStatus.RUNNING
        _remove(self.waiting, req)
        self.running.append(req)
        done = cached + n == req.num_tokens
        return self._seq(req, n, num_kept, done)

    def _seq(self, req: Request, n: int, num_kept: int, needs_output: bool) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(
            request=req,
            num_context_tokens=start,
            num_new_tokens=n,
            num_kept_tokens=num_kept,
            block_ids=list(self.bm.table(req.request_id)),
            input_ids=_token_slice(req, start, n),
            needs_output=needs_output,
        )

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.request_id)
        _remove(self.running, req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    # ---- update ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, out: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's results; returns outputs for requests that made visible progress."""
        outputs = self.take_pending_outputs()
        now = self.clock()
        for seq in plan.seqs:
            req = seq.request
            if req.is_finished or req.status != RequestStatus.RUNNING:
                continue  # aborted / failed / preempted meanwhile
            req.num_computed_tokens += seq.num_new_tokens
            self._cache_computed_blocks(req, seq)
            if not seq.needs_output:
                continue
            if req.kind == RequestKind.SCORE:
                req.first_token_s = now
                outputs.append(
                    self._finish(
                        req,
                        RequestStatus.FINISHED_STOPPED,
                        label_probs=out.label_probs[req.request_id],
                    )
                )
                continue
            token = out.sampled_token_ids[req.request_id]
            outputs.append(self._append_token(req, token, out.logprobs.get(req.request_id), now))
        return outputs

    def _cache_computed_blocks(self, req: Request, seq: ScheduledSeq) -> None:
        if not self.config.enable_prefix_cache or self.bm.prefix_cache is None:
            return
        t = self._track[req.request_id]
        num_full = min(req.num_computed_tokens, seq.num_kept_tokens) // self.block_size
        if num_full == 0:
            return
        tokens = req.all_token_ids
        extend_block_hashes(t.block_hashes, tokens[: num_full * self.block_size], self.block_size)
        self.bm.cache_full_blocks(req.request_id, t.block_hashes[:num_full], tokens)

    def _append_token(
        self, req: Request, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        sp = req.sampling
        t = self._track[req.request_id]
        req.output_token_ids.append(token)
        if req.first_token_s is None:
            req.first_token_s = now
        status = RequestStatus.RUNNING
        is_stop_token = token in sp.stop_token_ids or (
            not sp.ignore_eos and token in self.eos_token_ids
        )
        if is_stop_token:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= sp.max_tokens:
            status = RequestStatus.FINISHED_LENGTH

        # Text: the stop token's own text is never shown.
        if not is_stop_token:
            t.text += self._detok(req).add([token])
        if status.is_finished:
            t.text += self._detok(req).finish()
        visible_end = len(t.text)
        if sp.stop:
            hit = _find_stop(t.text, sp.stop, max(0, t.num_sent_chars - _max_len(sp.stop)))
            if hit is not None:
                visible_end = hit
                status = RequestStatus.FINISHED_STOPPED
            elif not status.is_finished:
                visible_end = len(t.text) - _held_back(t.text, sp.stop)
        visible_end = max(visible_end, t.num_sent_chars)
        new_text = t.text[t.num_sent_chars : visible_end]
        t.num_sent_chars = visible_end
        logprobs = [logprob] if logprob is not None else []
        if status.is_finished:
            return self._finish(
                req, status, new_token_ids=[token], new_text=new_text, new_logprobs=logprobs
            )
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=new_text,
            new_logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            queue_s=self._queue_s(req),
            ttft_s=req.first_token_s - req.arrival_s,
        )

    def _detok(self, req: Request) -> IncrementalDetokenizer:
        t = self._track[req.request_id]
        if t.detok is None:
            assert self.tokenizer is not None, "GENERATE requests need a tokenizer"
            # A few prompt tokens give the detokenizer its joining context.
            t.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids[-8:])  # type: ignore[arg-type]
        return t.detok

    def _queue_s(self, req: Request) -> float | None:
        t = self._track.get(req.request_id)
        if t is None or t.first_scheduled_s is None:
            return None
        return t.first_scheduled_s - req.arrival_s

    def _finish(
        self,
        req: Request,
        status: RequestStatus,
        *,
        error: str | None = None,
        label_probs: list[float] | None = None,
        new_token_ids: Sequence[int] = (),
        new_text: str = "",
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        """Move a request to a finished state, free its KV, and build its last output."""
        now = self.clock()
        req.status = status
        req.finish_s = now
        req.error = error
        if req.request_id in self._inflight:
            self._deferred_free.add(req.request_id)  # the device may still write its blocks
        else:
            self.bm.free(req.request_id)
        if not _remove(self.running, req):
            _remove(self.waiting, req)
        queue_s = self._queue_s(req)
        self._track.pop(req.request_id, None)
        self._arrival_seq.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new_token_ids),
            new_text=new_text,
            new_logprobs=new_logprobs or [],
            label_probs=label_probs,
            finished=True,
            finish_reason=FINISH_REASONS[status],
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            queue_s=queue_s,
            ttft_s=None if req.first_token_s is None else req.first_token_s - req.arrival_s,
            e2e_s=now - req.arrival_s,
        )


def _remove(requests: list[Request], req: Request) -> bool:
    """Remove `req` by identity (Request's dataclass __eq__ compares every field)."""
    for i, r in enumerate(requests):
        if r is req:
            del requests[i]
            return True
    return False


def _token_slice(req: Request, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output without concatenating them (a decode
    step must not copy the whole sequence)."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p : start - p + n]
    if start + n <= p:
        return req.prompt_token_ids[start : start + n]
    return req.prompt_token_ids[start:] + req.output_token_ids[: start + n - p]


def _max_len(stops: Sequence[str]) -> int:
    return max((len(s) for s in stops), default=0)


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest occurrence of any stop string at or after `start`."""
    best: int | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (not sent yet)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held
