"""Scheduler with a fake runner: policy order, token budget, chunking, suffix-KV discard,
preemption, abort, stop tokens, overlapped scheduling (one step in flight), holds, and KV
invariants throughout. (Text and stop strings: tests/test_output_processor.py.)"""

from __future__ import annotations

import random

import pytest

from policies import make_policy
from runtime.config import EngineConfig
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache, extend_block_hashes
from runtime.request import Request, RequestKind, SamplingParams, TokenLogprob
from runtime.scheduler import (
    MAX_GRAMMAR_SAMPLES_AHEAD,
    RunnerOutput,
    Scheduler,
    StepCapacity,
    StepPlan,
)

BS = 4
EOS = 99


class FakeRunner:
    """Samples a scripted token per request (default: token 1) and scores labels. Call `run`
    right after `schedule` (as an executor's launch): the sample index of a request is its
    output count including the placeholder this step added."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}
        self.plans: list[StepPlan] = []

    def run(self, plan: StepPlan) -> RunnerOutput:
        self.plans.append(plan)
        out = RunnerOutput()
        for s in plan.seqs:
            # Every step must only touch KV the request owns, within its block table.
            assert s.num_kept_tokens <= len(s.block_ids) * BS
            is_decode = s in plan.decode
            assert len(s.input_ids) == (0 if is_decode else s.num_new_tokens)
            r = s.request
            if r.sampling.prompt_logprobs is not None and not is_decode:
                start = s.num_context_tokens + 1
                targets = r.prompt_token_ids[start : start + s.num_new_tokens]
                out.prompt_logprobs[r.request_id] = [TokenLogprob(t, -float(t)) for t in targets]
            if not s.needs_output:
                continue
            if r.kind == RequestKind.SCORE:
                out.label_probs[r.request_id] = [0.25, 0.75]
            elif s.samples:
                seq = self.script.get(r.request_id, [])
                i = r.num_output_tokens + r.num_output_placeholders - 1
                out.sampled_token_ids[r.request_id] = seq[i] if i < len(seq) else 1
        return out


def make(
    num_blocks: int = 64,
    budget: int = 64,
    policy: str = "fcfs",
    cache: bool = True,
    max_num_seqs: int = 16,
    clock=None,
    wait_tokens: int = 256,
) -> Scheduler:
    cfg = EngineConfig(
        block_size=BS,
        prefill_token_budget=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_cache=cache,
        prefill_policy=policy,
        wait_for_shared_prefix_tokens=wait_tokens,
    )
    bm = BlockManager(num_blocks, BS, PrefixCache(BS) if cache else None)
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(cfg, bm, make_policy(policy), [EOS], **kwargs)


def cap(s: Scheduler, **kw) -> StepCapacity:
    return StepCapacity(prefill_token_budget=s.config.prefill_token_budget, **kw)


def step(s: Scheduler, runner: FakeRunner, **kw) -> list:
    plan = s.schedule(cap(s, **kw))
    return s.take_pending_outputs() + s.update(plan, runner.run(plan))


def gen(rid: str, n: int, max_tokens: int = 4, arrival: float = 0.0, **sp) -> Request:
    return Request(
        rid,
        RequestKind.GENERATE,
        list(range(100, 100 + n)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp),
        arrival_s=arrival,
    )


def score(rid: str, tokens: list[int], arrival: float = 0.0) -> Request:
    return Request(rid, RequestKind.SCORE, tokens, label_token_ids=[1, 2], arrival_s=arrival)


def drive(
    s: Scheduler, runner: FakeRunner, max_steps: int = 400, overlap: bool = False, **kw
) -> dict:
    """Run to completion. overlap: keep one step in flight, as the engine does (step N+1 is
    planned before step N's results are applied). `kw`: StepCapacity fields for every step."""
    outs: dict[str, list] = {}
    inflight: list[tuple[StepPlan, RunnerOutput]] = []

    def apply(plan: StepPlan, result: RunnerOutput) -> None:
        for o in s.update(plan, result):
            outs.setdefault(o.request_id, []).append(o)

    for _ in range(max_steps):
        if not s.has_work() and not inflight:
            break
        plan = s.schedule(cap(s, **kw))
        for o in s.take_pending_outputs():
            outs.setdefault(o.request_id, []).append(o)
        if not plan.is_empty:
            inflight.append((plan, runner.run(plan)))
        while inflight and (len(inflight) > (1 if overlap else 0) or plan.is_empty):
            apply(*inflight.pop(0))
        s.bm.check_integrity()
    assert not s.has_work() and not inflight
    return outs


def tokens(outs: dict, rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_generate_runs_to_max_tokens_and_frees_kv(overlap: bool) -> None:
    s = make()
    s.add(gen("a", 6, max_tokens=5))
    runner = FakeRunner()
    outs = drive(s, runner, overlap=overlap)
    assert tokens(outs, "a") == [1] * 5 and outs["a"][-1].finish_reason == "length"
    # max_tokens is exact even one step ahead: no surplus step was planned.
    assert sum(len(p.decode) for p in runner.plans) == 4
    # Only cached-idle blocks remain, none referenced.
    assert s.bm.num_used_blocks == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_and_stop_token_and_ignore_eos(overlap: bool) -> None:
    s = make()
    s.add(gen("eos", 3, max_tokens=10))
    s.add(gen("ign", 3, max_tokens=4, ignore_eos=True))
    s.add(gen("stop", 3, max_tokens=10, stop_token_ids=[7]))
    script = {"eos": [2, EOS, 3], "ign": [2, EOS, 3, 4], "stop": [2, 7, 3]}
    outs = drive(s, FakeRunner(script), overlap=overlap)
    assert outs["eos"][-1].finish_reason == "stop"
    assert tokens(outs, "eos") == [2, EOS]  # a surplus token computed after EOS is dropped
    assert outs["ign"][-1].finish_reason == "length" and tokens(outs, "ign") == [2, EOS, 3, 4]
    assert outs["stop"][-1].finish_reason == "stop" and tokens(outs, "stop") == [2, 7]
    assert s.bm.num_used_blocks == 0


def test_overlap_plans_the_next_decode_before_the_last_token_is_known() -> None:
    """With a step in flight the scheduler already plans the next decode of the same request
    (its input is a placeholder, read on the device); EOS found one step late finishes it and
    the surplus step's result is dropped; its KV stays held until that step is applied."""
    s = make(cache=False)
    s.add(gen("a", 3, max_tokens=10))
    runner = FakeRunner({"a": [2, EOS, 5]})
    p0 = s.schedule(cap(s))  # prefill: samples token 0 into the slot
    r0 = runner.run(p0)
    p1 = s.schedule(cap(s))  # decode of the placeholder, before p0 is applied
    assert [q.request.request_id for q in p1.decode] == ["a"] and p1.decode[0].input_ids == []
    r1 = runner.run(p1)
    assert s.update(p0, r0)[0].new_token_ids == [2]
    p2 = s.schedule(cap(s))  # decodes the (unknown) EOS: a surplus step
    r2 = runner.run(p2)
    (last,) = s.update(p1, r1)
    assert last.finished and last.finish_reason == "stop" and last.new_token_ids == [EOS]
    assert s.bm.num_used_blocks > 0  # the surplus step p2 still writes its KV
    assert s.update(p2, r2) == []  # dropped
    assert s.bm.num_used_blocks == 0 and s.slots.num_free == s.slots.num_slots
    assert not s.has_work()


def test_a_grammar_request_runs_one_sample_ahead_of_the_host_not_two() -> None:
    """Structured outputs: a request with a grammar may be planned with one sample in flight
    (the runner waits for that token to fill its mask, MAX_GRAMMAR_SAMPLES_AHEAD), not with
    two; an unconstrained one beside it has no such limit, and the outlook counts the decodes
    `schedule` will plan. Under overlap both finish alike."""
    assert MAX_GRAMMAR_SAMPLES_AHEAD == 1
    s = make(cache=False)
    s.add(gen("json", 3, max_tokens=10, grammar="{}"))
    s.add(gen("free", 3, max_tokens=10))
    runner = FakeRunner()
    p0 = s.schedule(cap(s))  # both prompts: each samples its first token
    r0 = runner.run(p0)
    assert s.outlook().num_decodes == 2  # "json" has one token in flight: planned anyway
    p1 = s.schedule(cap(s))
    assert sorted(q.request.request_id for q in p1.decode) == ["free", "json"]
    r1 = runner.run(p1)
    assert s.outlook().num_decodes == 1  # two of "json"'s tokens would be in flight: not it
    p2 = s.schedule(cap(s))
    assert [q.request.request_id for q in p2.decode] == ["free"]
    r2 = runner.run(p2)
    s.update(p0, r0)  # "json"'s first token reaches the host: one left in flight
    assert s.outlook().num_decodes == 2
    p3 = s.schedule(cap(s))
    assert sorted(q.request.request_id for q in p3.decode) == ["free", "json"]
    s.update(p1, r1)
    s.update(p2, r2)
    s.update(p3, runner.run(p3))
    outs = drive(s, runner, overlap=True)
    assert len(tokens(outs, "json")) + 3 == 10 and len(tokens(outs, "free")) + 4 == 10


def test_fcfs_order_and_budget_batching() -> None:
    s = make(budget=20)
    for i, n in enumerate([12, 6, 6, 3]):
        s.add(score(f"s{i}", list(range(200 + 10 * i, 200 + 10 * i + n)), arrival=float(i)))
    runner = FakeRunner()
    drive(s, runner)
    steps = [[x.request.request_id for x in p.prefill] for p in runner.plans]
    # 12 + 6 = 18 fits the budget; s2 (6) would exceed it and stops admission (strict order).
    assert steps[0] == ["s0", "s1"] and steps[1] == ["s2", "s3"]


def test_long_score_runs_alone_whole() -> None:
    s = make(budget=8)
    s.add(score("long", list(range(300, 330)), arrival=0.0))
    s.add(score("short", [1, 2, 3], arrival=1.0))
    runner = FakeRunner()
    outs = drive(s, runner)
    first = runner.plans[0].prefill
    assert [x.request.request_id for x in first] == ["long"] and first[0].num_new_tokens == 30
    assert outs["long"][-1].label_probs == [0.25, 0.75]


def test_spf_orders_short_first() -> None:
    s = make(budget=16, policy="spf", clock=lambda: 0.0)
    s.add(score("big", list(range(50, 62)), arrival=0.0))
    s.add(score("small", [1, 2, 3], arrival=0.0))
    runner = FakeRunner()
    drive(s, runner)
    assert runner.plans[0].prefill[0].request.request_id == "small"


def test_continuous_calibration_sees_new_cache_entries() -> None:
    s = make(budget=1000)
    profile = list(range(500, 532))  # 8 full blocks
    a = score("a", profile + [1, 2])
    b = score("b", profile + [3])
    s.add(a)
    assert s.view(a).num_cached_tokens_now == 0
    step(s, FakeRunner())
    s.add(b)
    assert s.view(b).num_cached_tokens_now == 32  # the profile blocks a left behind
    plan = s.schedule(cap(s))
    seq = plan.prefill[0]
    assert seq.num_context_tokens == 32 and seq.num_new_tokens == 1
    s.update(plan, FakeRunner().run(plan))
    assert s.bm.prefix_cache.hit_tokens == 32
    s.bm.check_integrity()


def test_score_keeps_only_full_prompt_blocks_in_cache() -> None:
    """A cold scoring prompt with room writes all of its KV for the step (its partial block
    too: nothing discarded), and only the full blocks stay cached after it."""
    s = make(num_blocks=64)
    s.add(score("a", list(range(10, 31))))  # 21 tokens: 5 full blocks + 1 partial
    plan = s.schedule(cap(s))
    seq = plan.prefill[0]
    assert seq.num_kept_tokens == 21 and len(seq.block_ids) == 6
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0
    assert s.bm.prefix_cache.num_evictable == 5 == len(s.bm.prefix_cache)
    # With exactly the full blocks free the partial one is discarded, as before.
    tight = make(num_blocks=5)
    tight.add(score("a", list(range(10, 31))))
    assert tight.schedule(cap(tight)).prefill[0].num_kept_tokens == 20


def test_a_cold_scoring_prompt_beside_a_warm_one_leaves_nothing_discarded() -> None:
    """One discarding member sends a whole prefill batch with context down the backend's
    gathered path (every member's context copied in every layer) and keeps the step from
    merging with decodes; a cold prompt keeping its partial block avoids both."""
    s = make(num_blocks=64)
    s.add(score("a", list(range(10, 31))))
    plan = s.schedule(cap(s))
    s.update(plan, FakeRunner().run(plan))
    s.add(score("warm", list(range(10, 30)) + [99, 98, 97]))  # a 5-block hit
    s.add(score("cold", list(range(200, 219))))  # 19 tokens: 4 full blocks + 1 partial
    plan = s.schedule(cap(s))
    assert {q.request.request_id for q in plan.prefill} == {"warm", "cold"}
    assert any(q.num_context_tokens for q in plan.prefill)
    assert all(q.num_kept_tokens == q.num_context_tokens + q.num_new_tokens for q in plan.prefill)
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()


def test_score_discards_what_the_pool_cannot_hold() -> None:
    s = make(num_blocks=3)
    s.add(score("a", list(range(10, 31))))  # would keep 5 blocks; the pool has 3
    plan = s.schedule(cap(s))
    assert plan.prefill[0].num_kept_tokens == 12
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()
    s2 = make(cache=False)
    s2.add(score("b", list(range(10, 31))))
    plan = s2.schedule(cap(s2))
    assert plan.prefill[0].num_kept_tokens == 0 and plan.prefill[0].block_ids == []


def test_generate_prompt_is_chunked() -> None:
    s = make(budget=8)
    s.add(gen("a", 21, max_tokens=2))
    runner = FakeRunner()
    outs = drive(s, runner)
    chunks = [p.prefill[0].num_new_tokens for p in runner.plans if p.prefill]
    assert chunks == [8, 8, 5]
    # A last chunk of one prompt token is a prefill chunk (its input is a prompt token the
    # host knows), not a decode (whose input is read from the token slot).
    s = make(budget=8)
    s.add(gen("b", 17, max_tokens=2))
    runner = FakeRunner()
    drive(s, runner)
    assert [p.prefill[0].num_new_tokens for p in runner.plans if p.prefill] == [8, 8, 1]
    assert [p.prefill[0].input_ids for p in runner.plans if p.prefill][-1] == [116]
    assert [p.prefill[0].needs_output for p in runner.plans[:3]] == [False, False, True]
    assert len(tokens(outs, "a")) == 2


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    # 6 blocks; two requests of 8 tokens (2 blocks each) growing to 16 (4 blocks each).
    s = make(num_blocks=6, budget=64, cache=False)
    s.add(gen("a", 8, max_tokens=8, arrival=0.0))
    s.add(gen("b", 8, max_tokens=8, arrival=1.0))
    outs = drive(s, FakeRunner())
    assert s.num_preemptions >= 1
    for rid in "ab":
        assert len(tokens(outs, rid)) == 8
        assert outs[rid][-1].finish_reason == "length"
    assert s.bm.num_free_blocks == 6


def test_preemption_under_overlap_waits_for_the_victims_step_instead_of_cascading() -> None:
    """A victim whose step is in flight gives its blocks back only when that step is applied:
    the scheduler then skips the needy decode for a step rather than preempting everyone."""
    s = make(num_blocks=6, budget=64, cache=False)
    for i, rid in enumerate("abc"):
        s.add(gen(rid, 6, max_tokens=6, arrival=float(i)))
    outs = drive(s, FakeRunner(), overlap=True)
    for rid in "abc":
        assert len(tokens(outs, rid)) == 6 and outs[rid][-1].finish_reason == "length"
    assert 1 <= s.num_preemptions <= 6
    assert s.bm.num_free_blocks == 6


def test_a_whole_scoring_prompt_in_flight_is_not_preempted_by_the_decodes_beside_it() -> None:
    """A scoring prompt the pool cannot hold whole runs whole, keeping what fits. Planned one
    step ahead, the chats' next decodes crossed into new blocks while it ran and preempted it:
    its answer was thrown away and it ran again (seven times for one 50k-token prompt on the
    GPU). It now leaves a block for each decode beside it and is never preempted once its
    step is launched; it runs once and the chats still finish."""
    for num_blocks in (8, 10, 12):
        s = make(num_blocks=num_blocks, budget=16)
        s.add(gen("chat", 4, max_tokens=20, ignore_eos=True))
        s.add(gen("chat2", 3, max_tokens=20, ignore_eos=True))
        step(s, FakeRunner())  # both chats prefilled: they decode from now on
        long = score("long", list(range(200, 240)))  # 10 blocks: more than the pool has free
        s.add(long)
        runner = FakeRunner()
        outs = drive(s, runner, overlap=True)
        runs = [q for p in runner.plans for q in p.prefill if q.request.request_id == "long"]
        assert [q.num_new_tokens for q in runs] == [40], num_blocks
        assert runs[0].num_kept_tokens < 40  # whole, its suffix discarded
        assert long.num_preemptions == 0
        assert outs["long"][-1].label_probs == [0.25, 0.75]
        for rid in ("chat", "chat2"):
            assert outs[rid][-1].finish_reason == "length" and len(tokens(outs, rid)) == 19
        assert s.bm.num_used_blocks == 0


def test_a_decode_short_of_a_block_waits_for_a_request_its_launched_step_answers() -> None:
    """The newest request's last sample is in flight (max_tokens reached): applied, that
    step finishes it and frees its blocks. A decode short of a block then waits a step
    rather than preempt it (which threw the finished work away and re-ran its prompt)."""
    s = make(num_blocks=3, budget=64, cache=False)
    s.add(gen("a", 4, max_tokens=6, arrival=0.0, ignore_eos=True))  # 1 block, grows to 3
    s.add(gen("b", 8, max_tokens=1, arrival=1.0))  # 2 blocks: the pool is full
    runner = FakeRunner()
    outs = drive(s, runner, overlap=True)
    assert s.num_preemptions == 0
    assert [[q.request.request_id for q in p.prefill] for p in runner.plans if p.prefill] == [
        ["a", "b"]
    ]
    assert tokens(outs, "b") == [1] and outs["b"][-1].finish_reason == "length"
    assert len(tokens(outs, "a")) == 6 and outs["a"][-1].finish_reason == "length"
    assert s.bm.num_free_blocks == 3


def test_abort_frees_kv_waiting_and_running() -> None:
    s = make()
    s.add(gen("a", 10, max_tokens=50))
    s.add(gen("w", 10, max_tokens=50))
    step(s, FakeRunner())
    out = s.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert s.abort("a") is None
    out = s.abort("w")
    assert out is not None and out.finish_reason == "abort"
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0 and not s.has_work()


def test_finished_requests_are_released_once_nothing_launched_uses_them() -> None:
    """`take_released` names each finished request whose per-request state (a grammar's
    matcher, a penalty row, a generator) may go: with a lease once it is freed; without one
    (aborted while waiting, or preempted and waiting again) at once, unless the lease its
    preemption gave up is still in a launched step, which releases it when applied."""
    s = make(max_num_seqs=1)
    s.add(gen("run", 10, max_tokens=50))
    s.add(gen("wait", 10, max_tokens=50))
    step(s, FakeRunner())  # "run" admitted, "wait" waits (one sequence at a time)
    assert s.take_released() == []
    s.abort("wait")
    assert s.take_released() == ["wait"]  # never admitted
    s.abort("run")
    assert s.take_released() == ["run"]  # its lease freed at once: no step in flight
    s.add(gen("p", 10, max_tokens=50))
    runner = FakeRunner()
    plan = s.schedule(cap(s))
    result = runner.run(plan)
    s._preempt(s.get("p"))  # (as a decode short of blocks would) with its prefill in flight
    s.abort("p")
    assert s.take_released() == []  # the launched step still uses its lease
    s.update(plan, result)
    assert s.take_released() == ["p"]
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0 and not s.has_work()


def test_a_prompt_that_never_fits_fails_clearly() -> None:
    s = make(num_blocks=2, cache=False)
    s.add(gen("huge", 20, max_tokens=2))
    plan = s.schedule(cap(s))
    assert plan.is_empty
    outs = s.take_pending_outputs()
    assert outs[0].finish_reason == "error" and "KV blocks" in (outs[0].error or "")


def test_max_num_seqs_bounds_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(gen(f"r{i}", 4, max_tokens=3, arrival=float(i)))
    runner = FakeRunner()
    for _ in range(3):
        plan = s.schedule(cap(s))
        assert s.num_running <= 2
        s.update(plan, runner.run(plan))


@pytest.mark.parametrize("overlap", [False, True])
def test_random_workload_keeps_invariants(overlap: bool) -> None:
    rng = random.Random(0)
    s = make(num_blocks=20, budget=24, max_num_seqs=6)
    runner = FakeRunner()
    profiles = [[rng.randrange(1, 90) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    n_added = 0
    finished: set[str] = set()
    inflight: list = []
    for step in range(600):
        if rng.random() < 0.3:
            rid = f"q{n_added}"
            n_added += 1
            toks = rng.choice(profiles) + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 8))]
            if rng.random() < 0.5:
                s.add(score(rid, toks, arrival=float(step)))
            else:
                s.add(
                    Request(
                        rid,
                        RequestKind.GENERATE,
                        toks,
                        SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0),
                        arrival_s=float(step),
                    )
                )
        if rng.random() < 0.05 and (s.running or s.waiting):
            victim = rng.choice(s.running + s.waiting)
            out = s.abort(victim.request_id)
            assert out is not None
            finished.add(victim.request_id)
        plan = s.schedule(cap(s))
        outs = s.take_pending_outputs()
        if not plan.is_empty:
            inflight.append((plan, runner.run(plan)))
        while inflight and (len(inflight) > (1 if overlap else 0) or plan.is_empty):
            outs += s.update(*inflight.pop(0))
        for o in outs:
            if o.finished:
                assert o.request_id not in finished
                finished.add(o.request_id)
        s.bm.check_integrity()
        for r in s.waiting:  # the memoized cached-prefix lengths equal a fresh lookup
            _, fresh = s.bm.prefix_cache.match_prefix(r.all_token_ids)
            assert s.view(r).num_cached_tokens_now == min(fresh, (r.num_tokens - 1) // BS * BS)
    for plan, result in inflight:
        s.update(plan, result)
    drive(s, runner, max_steps=2000, overlap=overlap)
    assert s.bm.num_used_blocks == 0
    assert s.num_preemptions > 0  # the pool is small enough that preemption happened


def test_the_prompt_digests_the_api_server_sent_are_the_ones_looked_up() -> None:
    """The API server digests a prompt's blocks (off the engine thread) and the scheduler
    looks up what it was sent; a list that is not one digest a full block is ignored."""
    s = make(num_blocks=16)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    s.add(score("a", prefix + [2]))
    drive(s, FakeRunner())  # caches its two full blocks
    # Other tokens carrying "a"'s digests: a hit on both blocks, so the digests were used.
    b = score("b", [1] * 8 + [3])
    b.block_hashes = extend_block_hashes([], prefix + [2], BS)
    s.add(b)
    assert s.view(b).num_cached_tokens_now == 8
    # One digest for two full blocks: recomputed from the tokens (a hit, by its own digests).
    c = score("c", prefix + [5])
    c.block_hashes = [b"only one"]
    s.add(c)
    assert s.view(c).num_cached_tokens_now == 8
    assert s._track["c"].block_hashes == extend_block_hashes([], prefix + [5], BS)


def test_prompt_logprobs_requests_never_wait_for_a_prefix_they_will_not_read() -> None:
    """A request asking for prompt logprobs computes its whole prompt (it reads no cached
    block), so another request prefilling the same prompt must not hold it back: four such
    copies with the API server's digests start together."""
    s = make(budget=200, wait_tokens=8)
    prompt = list(range(100, 140))
    for i in range(4):
        r = gen(f"p{i}", 40, max_tokens=1, prompt_logprobs=1)
        assert r.prompt_token_ids == prompt
        r.block_hashes = extend_block_hashes([], prompt, BS)
        s.add(r)
    plan = s.schedule(cap(s))
    assert sorted(q.request.request_id for q in plan.prefill) == ["p0", "p1", "p2", "p3"]


@pytest.mark.parametrize(("policy", "lookups"), [("fcfs", 0), ("spf", 0), ("srjf", 5)])
def test_the_queue_is_ordered_without_prefix_lookups_a_policy_does_not_read(
    policy: str, lookups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After evictions a lookup re-checks a waiting request's whole cached prefix, so the
    views look it up only for a policy that reads it (SRJF's job size)."""
    s = make(policy=policy)
    for i in range(5):
        s.add(score(f"w{i}", list(range(100 * i, 100 * i + 20))))
    calls: list[str] = []
    real = s._cached_prefix
    monkeypatch.setattr(s, "_cached_prefix", lambda req: calls.append(req.request_id) or real(req))
    assert len(s.ordered_waiting(0.0)) == 5
    assert len(calls) == lookups


def test_cached_prefix_memo_follows_insertions_and_evictions() -> None:
    s = make(num_blocks=4)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    w = score("w", prefix + [1])
    s.add(w)
    assert s.view(w).num_cached_tokens_now == 0
    s.add(score("a", prefix + [2]))
    # Run "a" alone: it caches the two prefix blocks.
    s.waiting.remove(w)
    step(s, FakeRunner())
    s.waiting.append(w)
    assert s.view(w).num_cached_tokens_now == 8  # insertion seen
    s.bm.allocate("hog", 4)  # takes the 2 free blocks and evicts the 2 cached ones
    assert s.view(w).num_cached_tokens_now == 0  # eviction seen
    s.bm.free("hog")
    assert s.view(w).num_cached_tokens_now == 0
    s.bm.check_integrity()


# ---- a shared prefix that is being prefilled is not computed twice ---------------------------
def _users_burst(n_users: int, per_user: int) -> list[Request]:
    """Scoring requests of `n_users` users (a 32-token profile each) arriving together."""
    reqs = []
    for i in range(per_user):
        for u in range(n_users):
            profile = list(range(1000 * (u + 1), 1000 * (u + 1) + 32))  # 8 full blocks
            reqs.append(score(f"u{u}-{i}", profile + [7, 8, 9 + i]))
    return reqs


def test_same_user_requests_in_one_batch_wait_for_the_first_ones_prefix() -> None:
    computed = {}
    for wait in (0, 16):
        s = make(num_blocks=128, budget=1000, wait_tokens=wait)
        for r in _users_burst(n_users=3, per_user=4):
            s.add(r)
        outs = drive(s, FakeRunner())
        assert len(outs) == 12 and all(o[-1].finished for o in outs.values())
        computed[wait] = s.num_prefill_tokens
        if wait:
            # One request per user computed the profile; the other three only its tail.
            assert s.num_shared_prefix_waits >= 9
            assert s.bm.prefix_cache.hit_tokens == 3 * 3 * 32
    assert computed[0] == 12 * 35  # every request computed its whole prompt
    assert computed[16] == 3 * 35 + 9 * 3


def test_a_request_with_another_prefix_is_not_held_up_behind_a_waiting_one() -> None:
    s = make(num_blocks=128, budget=1000, wait_tokens=16)
    leader, follower = _users_burst(n_users=1, per_user=2)
    s.add(leader)
    s.add(follower)
    other = score("other", list(range(5000, 5030)))
    s.add(other)
    plan = s.schedule(cap(s))
    ids = [q.request.request_id for q in plan.prefill]
    assert ids == ["u0-0", "other"]  # the follower waits; the next in order still runs
    s.update(plan, FakeRunner().run(plan))
    plan = s.schedule(cap(s))
    (seq,) = plan.prefill
    assert seq.request.request_id == "u0-1" and seq.num_context_tokens == 32  # a hit


def test_a_waiting_follower_runs_once_the_prefilling_leader_is_aborted() -> None:
    s = make(num_blocks=128, budget=16, wait_tokens=16)
    lead = gen("lead", 40, max_tokens=2)  # chunked: 16 tokens per step
    s.add(lead)
    step(s, FakeRunner())  # lead's first chunk
    follower = gen("follow", 40, max_tokens=2)  # the same 40 prompt tokens
    s.add(follower)
    plan = s.schedule(cap(s))
    assert [q.request.request_id for q in plan.prefill] == ["lead"]  # follower waits
    s.update(plan, FakeRunner().run(plan))
    s.abort("lead")
    plan = s.schedule(cap(s))
    (seq,) = plan.prefill
    assert seq.request.request_id == "follow" and seq.num_context_tokens == 32  # lead's chunks
    s.update(plan, FakeRunner().run(plan))
    outs = drive(s, FakeRunner())
    assert outs["follow"][-1].finished


def test_a_follower_waits_while_the_leaders_prefill_is_in_flight() -> None:
    """Overlapped: the leader's whole prefill was launched (its counters advanced) but its
    blocks are not cached until its results are applied; the follower still waits for them."""
    s = make(num_blocks=128, budget=1000, wait_tokens=16)
    leader, follower = _users_burst(n_users=1, per_user=2)
    s.add(leader)
    p0 = s.schedule(cap(s))
    s.add(follower)
    p1 = s.schedule(cap(s))
    assert p1.is_empty and s.num_shared_prefix_waits == 1
    s.update(p0, FakeRunner().run(p0))
    p2 = s.schedule(cap(s))
    (seq,) = p2.prefill
    assert seq.request.request_id == "u0-1" and seq.num_context_tokens == 32


# ---- holds (split executor), chunked scoring, prompt logprobs, max_tokens 0 -------------------
def test_held_prefills_are_neither_scheduled_nor_preempted_until_applied() -> None:
    s = make(num_blocks=64, budget=64)
    s.add(gen("a", 6, max_tokens=3))
    held = StepCapacity(prefill_token_budget=64, decodes_share_budget=False, hold_prefills=True)
    p0 = s.schedule(held)
    assert p0.prefill and s.num_held == 1
    p1 = s.schedule(StepCapacity(0, hold_prefills=True))  # no decode of a held request
    assert p1.is_empty
    assert s._victim(s.running[0]) is s.running[0]  # never a victim while held
    s.update(p0, FakeRunner().run(p0))
    assert s.num_held == 0
    p2 = s.schedule(StepCapacity(0, hold_prefills=True))
    assert [q.request.request_id for q in p2.decode] == ["a"]


def test_a_held_sampled_prefill_counts_as_a_decode_ahead() -> None:
    """The split executor holds its prefills, whole-GPU ones too, until applied: a chat whose
    last prefill chunk is in flight is no decode of the next step, but it decodes from the one
    after, beside whatever prefill is launched now. `outlook` (the TBT cut's view before
    planning) and `decodes_ahead` (the controller's view at launch) count it; a held
    prefill that samples nothing yet (a long prompt's earlier chunk) and a generation on its
    last sample do not."""
    s = make(num_blocks=64, budget=64)
    s.add(gen("a", 6, max_tokens=3))
    s.add(gen("b", 5, max_tokens=1))
    held = StepCapacity(prefill_token_budget=64, decodes_share_budget=False, hold_prefills=True)
    p0 = s.schedule(held)
    assert len(p0.prefill) == 2 and s.num_held == 2
    look = s.outlook()
    assert (look.num_decodes, look.decode_context_tokens) == (1, 6)  # b's one sample: in flight
    assert s.decodes_ahead() == (1, 6)
    assert s.decodes_ahead(launching=p0.prefill) == (0, 0)  # not beside its own prefill
    s.add(gen("c", 9, max_tokens=4))
    assert s.outlook().prefill_tokens == 9  # the head: waiting, not the held ones
    s.update(p0, FakeRunner().run(p0))
    p1 = s.schedule(StepCapacity(0, hold_prefills=True))
    assert [q.request.request_id for q in p1.decode] == ["a"]
    # Planned, a's decode counts once, from the plan.
    assert s.decodes_ahead(p1.decode) == (1, 6)


def test_a_held_whole_scoring_prompt_leaves_the_decodes_beside_it_room_to_grow() -> None:
    """Held (on a split or in layer slices) a whole scoring prompt runs beside many decode
    steps. Had it kept every free block for its prefix, the decodes crossing into new blocks
    would preempt the chats (a held request is never the victim): it keeps what leaves each
    decode HELD_DECODE_RESERVE_TOKENS (here: its max_tokens) to grow, and none is preempted."""
    s = make(num_blocks=24, budget=64)
    chats = [gen(f"c{i}", 4, max_tokens=40, ignore_eos=True, arrival=float(i)) for i in range(3)]
    for c in chats:
        s.add(c)
    step(s, FakeRunner())  # the chats decode from now on
    s.add(score("long", list(range(300, 400)), arrival=10.0))  # 25 blocks: more than free
    runner = FakeRunner()
    held = StepCapacity(prefill_token_budget=128, decodes_share_budget=False, hold_prefills=True)
    p0 = s.schedule(held)
    r0 = runner.run(p0)
    ((whole,),) = [p0.prefill]
    assert whole.num_new_tokens == 100 and whole.num_kept_tokens < 100
    s.update(StepPlan(p0.step_id, decode=p0.decode), r0)  # the split applies decodes first
    for _ in range(20):  # decode steps beside the held prefill (the chats' need: 18 blocks)
        plan = s.schedule(StepCapacity(0, decodes_share_budget=False, hold_prefills=True))
        s.update(plan, runner.run(plan))
    assert s.num_preemptions == 0 and all(c.num_preemptions == 0 for c in chats)
    assert [c.num_output_tokens for c in chats] == [22] * 3
    out = s.update(StepPlan(p0.step_id, prefill=p0.prefill), r0)
    assert [o.label_probs for o in out if o.request_id == "long"] == [[0.25, 0.75]]
    s.bm.check_integrity()


def test_long_scoring_prompt_is_chunked_only_next_to_decodes_and_when_its_kv_fits() -> None:
    prompt = list(range(200, 240))  # 40 tokens, 10 blocks
    # Next to a decoding request: chunked by the budget, KV for the whole prompt held.
    s = make(num_blocks=64, budget=16)
    s.add(gen("chat", 4, max_tokens=20, ignore_eos=True))
    step(s, FakeRunner())  # chat prefilled: it decodes from now on
    s.add(score("long", prompt))
    runner = FakeRunner()
    outs = drive(s, runner)
    chunks = [
        q.num_new_tokens for p in runner.plans for q in p.prefill if q.request.request_id == "long"
    ]
    assert len(chunks) > 1 and sum(chunks) == 40 and max(chunks) <= 16
    assert outs["long"][-1].label_probs == [0.25, 0.75] and s.num_chunked_scoring == 1
    assert all(len(p.decode) == 1 for p in runner.plans if p.prefill)  # decode never waited
    assert s.bm.num_used_blocks == 0
    # Alone (no decode to protect): whole, in one step.
    s = make(num_blocks=64, budget=16)
    s.add(score("long", prompt))
    runner = FakeRunner()
    drive(s, runner)
    assert [q.num_new_tokens for q in runner.plans[0].prefill] == [40]
    # Next to decodes but the pool cannot hold its whole KV: whole, with suffix discard.
    s = make(num_blocks=8, budget=16)
    s.add(gen("chat", 4, max_tokens=20, ignore_eos=True))
    step(s, FakeRunner())
    s.add(score("long", prompt))
    runner = FakeRunner()
    drive(s, runner)
    (whole,) = [q for p in runner.plans for q in p.prefill if q.request.request_id == "long"]
    assert whole.num_new_tokens == 40 and whole.num_kept_tokens < 40
    assert s.num_chunked_scoring == 0


def test_a_step_with_decodes_is_held_to_the_mixed_cap_and_one_without_gets_the_budget() -> None:
    """`mixed_step_token_budget`: beside a decode, a long chat prompt and a long scoring
    prompt go in chunks of at most the cap (the decode's token included); alone, each takes
    the whole budget in one step."""
    prompt = list(range(200, 240))  # 40 tokens, none shared with the chat's

    def long_chat() -> Request:
        return Request("long", RequestKind.GENERATE, prompt, SamplingParams(max_tokens=1))

    makers = (long_chat, lambda: score("long", prompt))
    for make_long in makers:
        s = make(num_blocks=64, budget=64)
        s.add(gen("chat", 4, max_tokens=30, ignore_eos=True))
        step(s, FakeRunner(), mixed_step_token_budget=16)  # chat prefilled: it decodes now
        s.add(make_long())
        runner = FakeRunner()
        drive(s, runner, mixed_step_token_budget=16)
        mixed = [p for p in runner.plans if p.prefill and p.decode]
        assert mixed and all(p.num_prefill_tokens + len(p.decode) <= 16 for p in mixed)
        assert sum(q.num_new_tokens for p in runner.plans for q in p.prefill) == 40
        # Alone (no decode to protect): one step of the whole budget.
        s = make(num_blocks=64, budget=64)
        s.add(make_long())
        runner = FakeRunner()
        drive(s, runner, mixed_step_token_budget=16)
        assert [q.num_new_tokens for q in runner.plans[0].prefill] == [40]


def test_prompt_logprobs_are_gathered_over_chunks_and_never_use_the_prefix_cache() -> None:
    s = make(budget=8)
    prompt = list(range(300, 321))  # 21 tokens: three chunks of <= 8
    s.add(Request("warm", RequestKind.SCORE, prompt, label_token_ids=[1]))
    drive(s, FakeRunner())  # the prompt's full blocks are now cached
    r = Request(
        "lp",
        RequestKind.GENERATE,
        prompt,
        SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=0.0),
    )
    s.add(r)
    runner = FakeRunner()
    outs = drive(s, runner)
    assert runner.plans[0].prefill[0].num_context_tokens == 0  # no prefix hit
    (final,) = outs["lp"]
    assert final.finished and final.finish_reason == "length" and final.new_token_ids == []
    lps = final.prompt_logprobs
    assert lps[0] is None and [lp.token_id for lp in lps[1:]] == prompt[1:]
    assert all(not q.samples for p in runner.plans for q in p.prefill)  # nothing sampled
    assert s.slots.num_free == s.slots.num_slots and s.bm.num_used_blocks == 0


# ----------------------------------------------------------------------------- TBT target


class LinearCost:
    """A prefill cost of `per_token_s` per new token (the JCT model's shape without the
    attention term)."""

    def __init__(self, per_token_s: float) -> None:
        self.per_token_s = per_token_s
        self.b_s_per_token, self.k_s_per_pair = per_token_s, 0.0  # `JctTerms`

    def marginal_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        return self.per_token_s * uncached_tokens

    def max_tokens_within(self, seconds: float, cached_tokens: int = 0) -> int:
        return int(seconds / self.per_token_s + 1e-9) if seconds > 0 else 0


def _decoding(budget: int = 4096) -> Scheduler:
    """A scheduler whose one request ("chat") is decoding."""
    s = make(num_blocks=4096, budget=budget, max_num_seqs=8)
    s.add(gen("chat", 4, max_tokens=50, ignore_eos=True))
    step(s, FakeRunner())
    return s


def _prefill_sizes(plan: StepPlan) -> dict[str, int]:
    return {q.request.request_id: q.num_new_tokens for q in plan.prefill}


def test_tbt_target_cuts_a_long_prefill_next_to_decodes() -> None:
    """(tbt 50 ms - decode step 10 ms) / 0.1 ms per token = 400 tokens of prefill per step."""
    tbt = {"tbt_s": 0.05, "decode_step_s": 0.01, "prefill_cost": LinearCost(1e-4)}
    s = _decoding()
    s.add(gen("long", 3000, max_tokens=1))
    plan = s.schedule(cap(s, **tbt))
    assert len(plan.decode) == 1 and _prefill_sizes(plan) == {"long": 400}
    # The following chunks too (the request is prefilling: its context grows).
    s.update(plan, FakeRunner().run(plan))
    plan = s.schedule(cap(s, **tbt))
    assert _prefill_sizes(plan) == {"long": 400}
    # Without decodes there is nothing to protect: the token budget alone.
    s = make(num_blocks=4096, budget=4096)
    s.add(gen("long", 3000, max_tokens=1))
    assert _prefill_sizes(s.schedule(cap(s, **tbt))) == {"long": 3000}
    # Without a target: the token budget alone, decodes or not.
    s = _decoding(budget=1024)
    s.add(gen("long", 3000, max_tokens=1))
    assert _prefill_sizes(s.schedule(cap(s))) == {"long": 1023}  # the decode token shares it


def test_tbt_target_shares_its_time_between_admissions_and_keeps_prefill_moving() -> None:
    tbt = {"tbt_s": 0.05, "decode_step_s": 0.01, "prefill_cost": LinearCost(1e-4)}
    s = _decoding()
    for rid, first_token in (("a", 1000), ("b", 2000)):  # no prefix shared with anything
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        s.add(Request(rid, RequestKind.GENERATE, list(range(first_token, first_token + 300)), sp))
    assert _prefill_sizes(s.schedule(cap(s, **tbt))) == {"a": 300, "b": 100}
    # Decodes alone already past the target: the first chunk still gets the minimum.
    from runtime.scheduler import MIN_TBT_CHUNK_TOKENS

    s = _decoding()
    s.add(gen("long", 3000, max_tokens=1))
    slow = {**tbt, "decode_step_s": 0.08}
    assert _prefill_sizes(s.schedule(cap(s, **slow))) == {"long": MIN_TBT_CHUNK_TOKENS}


def test_tbt_target_chunks_a_long_scoring_prompt_next_to_decodes() -> None:
    tbt = {"tbt_s": 0.05, "decode_step_s": 0.01, "prefill_cost": LinearCost(1e-4)}
    s = _decoding()
    s.add(score("sc", list(range(200, 1200))))  # 1000 tokens; the pool holds its KV
    assert _prefill_sizes(s.schedule(cap(s, **tbt))) == {"sc": 400}


def test_corrected_cost_scales_both_ways() -> None:
    from runtime.partition.corrections import CorrectedCost

    cost = CorrectedCost(LinearCost(1e-4), token_scale=2.0)  # the model under-predicts by half
    assert cost.marginal_s(100) == pytest.approx(0.02)
    assert cost.max_tokens_within(0.04) == 200


def _parts(cost, n: int, c: int = 0):  # noqa: ANN001, ANN202
    return cost.prefill([(n, c)])


def test_corrected_cost_learns_a_mixed_steps_fixed_cost_apart_from_its_slope() -> None:
    """Mixed steps that cost 12 ms + 2x the model's marginal (a fixed cost for running without
    the decode graphs), with short scoring suffixes and long chunks interleaved as on the H200
    (plan s): the fit recovers both, so a long chunk is cut right after a run of short ones. A
    single factor (what the engine kept before) lands far off for one kind or the other."""
    from runtime.partition.corrections import CorrectedCost

    per_token_s = 1e-5
    cost = CorrectedCost(LinearCost(per_token_s))
    true = lambda tokens: 0.012 + 2.0 * per_token_s * tokens  # noqa: E731
    tokens_seq = [150, 150, 4000, 150, 2000, 150, 150, 3000] * 6
    for n in tokens_seq:
        cost.observe(_parts(cost, n), true(n))
    assert cost.offset_s == pytest.approx(0.012, rel=0.02)
    assert cost.token_scale == pytest.approx(2.0, rel=0.02)
    # The TBT cut: 80 ms target, 4 ms decode step: room for the chunk after the fixed cost.
    room_s = 0.080 - 0.004 - cost.offset_s
    assert cost.max_tokens_within(room_s) == pytest.approx(3200, rel=0.03)
    assert true(cost.max_tokens_within(room_s)) + 0.004 <= 0.080 * 1.01
    # Only short suffixes for a while (their costs too alike for a slope): what the long
    # chunks taught mostly stays (decayed to 0.95^40, it still outweighs the prior), and the
    # short steps are predicted right.
    for _ in range(40):
        cost.observe(_parts(cost, 150), true(150))
    assert cost.token_scale == pytest.approx(2.0, rel=0.1)
    assert cost.extra_s(_parts(cost, 150)) == pytest.approx(true(150), rel=0.01)
    assert cost.max_tokens_within(0.080 - 0.004 - cost.offset_s) == pytest.approx(3200, rel=0.1)
    # The single running factor the engine kept before, on the same steps, then cuts the long
    # chunk to under a third of what fits.
    factor = 1.0
    for n in tokens_seq + [150] * 40:
        factor = 0.8 * factor + 0.2 * min(10.0, max(0.1, true(n) / (per_token_s * n)))
    assert LinearCost(per_token_s).max_tokens_within(0.076 / factor) < 3200 / 3


class _JctTerms:
    def __init__(self, b_s_per_token: float, k_s_per_pair: float) -> None:
        self.b_s_per_token, self.k_s_per_pair = b_s_per_token, k_s_per_pair


def test_corrected_cost_scales_the_token_and_the_pair_terms_apart() -> None:
    """The JCT model, fitted on whole prefills of thousands of tokens, has a merged step's
    per-token cost too low and its attention too high (H100, 8B, plan whole: 1.46-1.64x and
    0.64-0.74x). Chunks of 300-2,000 tokens after 0-40k cached tokens, costing 1.5x the token
    term and 0.7x the pair term: the fit recovers both, and predicts a short chat prompt and
    a chunk deep into a long prompt alike; one scale with an offset (the correction before)
    is far off for one of them."""
    from runtime.partition.corrections import CorrectedCost, MixedPrefill

    jct = _JctTerms(1.6e-5, 1.1e-9)
    cost = CorrectedCost(jct)
    true = lambda p: 1.5 * p.token_s + 0.7 * p.pair_s  # noqa: E731
    shapes = [(2000, 0), (900, 30000), (300, 16), (1500, 8000), (600, 40000), (1200, 20000)]
    for n, c in shapes * 8:
        cost.observe(_parts(cost, n, c), true(_parts(cost, n, c)))
    # The prior pulls the terms a little along what these six shapes hardly tell apart;
    # their predictions are what must be right.
    assert cost.token_scale == pytest.approx(1.5, rel=0.05)
    assert cost.pair_scale == pytest.approx(0.7, rel=0.15)
    for n, c in [(60, 16), (1000, 38000)]:
        want = true(_parts(cost, n, c))
        assert cost.extra_s(_parts(cost, n, c)) == pytest.approx(want, rel=0.03, abs=1e-3)
    # The correction as it was: one scale on the JCT model's marginal, an offset.
    xs = [_parts(cost, n, c) for n, c in shapes * 8]
    x = [p.token_s + p.pair_s for p in xs]
    y = [true(p) for p in xs]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum(
        (a - mx) ** 2 for a in x
    )
    one = lambda p: my + slope * (p.token_s + p.pair_s - mx)  # noqa: E731
    short = MixedPrefill.of(jct, [(60, 16)])
    assert abs(one(short) - true(short)) > 0.5 * true(short)


def test_corrected_cost_learns_what_a_cached_prefix_costs_a_short_query() -> None:
    """Mixed steps as next to chunked scoring on the H200 (plan cap): 150-token scoring
    suffixes after 11-17k cached tokens, fresh chat prompts after 16, 2k chunks after 0-12k.
    Each costs 4 ms + 1.5x the model's marginal + 0.2 µs per cached token (a short query still
    reads its whole prefix; the JCT model's query-key pairs miss most of it at 150 rows). The
    fit recovers the three, and a chunk after a long prefix gets the room less that read."""
    from runtime.partition.corrections import CorrectedCost, MixedPrefill

    per_token_s = 1e-5
    cost = CorrectedCost(LinearCost(per_token_s))
    true = lambda n, c: 0.004 + 1.5 * per_token_s * n + 2e-7 * c  # noqa: E731
    shapes = [(150, 14000), (120, 16), (2048, 4096), (150, 11500), (300, 0), (150, 17000)]
    shapes += [(2048, 0), (90, 16), (150, 12800), (2048, 12000)]
    for n, c in shapes * 6:
        cost.observe(_parts(cost, n, c), true(n, c))
    assert cost.offset_s == pytest.approx(0.004, rel=0.15)
    assert cost.token_scale == pytest.approx(1.5, rel=0.05)
    assert cost.context_s_per_token == pytest.approx(2e-7, rel=0.15)
    for n, c in shapes:  # within the prior's pull (a few %, at most ~0.3 ms on short steps)
        assert cost.extra_s(_parts(cost, n, c)) == pytest.approx(true(n, c), rel=0.02, abs=4e-4)
    # A part after 16k cached tokens: its room less the 3.2 ms prefix read.
    room_s = 0.030 - cost.offset_s
    n = cost.max_tokens_within(room_s, 16000)
    assert n == pytest.approx((room_s - 2e-7 * 16000) / (1.5 * per_token_s), rel=0.05)
    assert cost.offset_s + cost.marginal_s(n, 16000) <= 0.030 * 1.001
    assert cost.max_tokens_within(0.002, 16000) == 0  # the prefix read alone overfills it
    # A run of scoring suffixes alone (one shape: nothing tells the terms apart): each fit is
    # pulled toward the one before, so the terms stay and the other shapes stay right (a
    # prior held at the first guess drew the chat prompt's step 23 % over).
    for _ in range(40):
        cost.observe(_parts(cost, 150, 14000), true(150, 14000))
    assert cost.context_s_per_token == pytest.approx(2e-7, rel=0.05)
    for n, c in [(150, 14000), (2048, 0), (2048, 12000), (120, 16)]:
        assert cost.extra_s(_parts(cost, n, c)) == pytest.approx(true(n, c), rel=0.02)
    # Without the context term (the affine fit alone) the same steps are far off for one kind:
    # a scoring suffix after 17k or a fresh chat prompt.
    affine = CorrectedCost(LinearCost(per_token_s))
    blind = lambda n: MixedPrefill(per_token_s * n, 0.0, 0)  # noqa: E731
    for n, c in shapes * 6:
        affine.observe(blind(n), true(n, c))
    errors = [abs(affine.extra_s(blind(n)) - true(n, c)) / true(n, c) for n, c in shapes]
    assert max(errors) > 0.25


def test_corrected_cost_holds_at_its_prior_what_the_steps_cannot_tell() -> None:
    """A term no step can tell stays where the prior puts it: no cached prefix in any step
    (the context term stays 0), no query-key pairs (the pair scale stays at its seed). Where
    context grows with the chunk (later chunks of one prompt), the terms may trade off, but
    what such steps take and a fresh prompt's step are both predicted right."""
    from runtime.partition.corrections import CorrectedCost

    per_token_s = 1e-5
    fresh = CorrectedCost(LinearCost(per_token_s))
    fresh.seed_scale(1.7)
    for n in [150, 4000, 2000, 300] * 10:
        fresh.observe(_parts(fresh, n), 0.005 + 2.0 * per_token_s * n)
    assert fresh.context_s_per_token == 0.0
    assert fresh.pair_scale == pytest.approx(1.7)
    given = CorrectedCost(LinearCost(per_token_s), context_s_per_token=2e-7)
    for n in [150, 4000, 2000, 300] * 10:  # no cached prefix: the term given is kept
        given.observe(_parts(given, n), 0.005 + 2.0 * per_token_s * n)
    assert given.context_s_per_token == pytest.approx(2e-7)
    assert fresh.token_scale == pytest.approx(2.0, rel=0.02)
    true = lambda n, c: 0.005 + 2.0 * per_token_s * n + 1e-7 * c  # noqa: E731
    chunks = CorrectedCost(LinearCost(per_token_s))
    for _ in range(3):
        for k in range(1, 9):  # chunk k of a prompt: context = the chunks before it
            n, c = 1000 + 250 * k, 1250 * (k - 1)
            chunks.observe(_parts(chunks, n, c), true(n, c))
    for n, c in [(1500, 1250), (2750, 8750)]:
        assert chunks.extra_s(_parts(chunks, n, c)) == pytest.approx(true(n, c), rel=0.03)


def test_corrected_cost_stays_in_bounds() -> None:
    """Absurd measurements drive the terms to their bounds, not past them; a step with no
    prefill predicted teaches nothing; a part's cost is never below 0."""
    from runtime.partition.corrections import CorrectedCost, MixedPrefill

    cost = CorrectedCost(LinearCost(1e-5))
    for _ in range(50):
        cost.observe(_parts(cost, 100), 5.0)  # 5 s for a 100-token chunk
    assert cost.offset_s <= CorrectedCost.MAX_OFFSET_S
    assert cost.token_scale <= CorrectedCost.MAX_SCALE
    before = (cost.offset_s, cost.token_scale)
    cost.observe(MixedPrefill(0.0, 0.0, 0), 1.0)  # no prefill predicted: nothing learned
    assert (cost.offset_s, cost.token_scale) == before
    cheap = CorrectedCost(LinearCost(1e-5))
    for n, c in [(150, 14000), (2000, 0), (150, 0), (2000, 12000)] * 20:
        cheap.observe(_parts(cheap, n, c), max(0.0, 0.5e-5 * n - 5e-6 * c))
    assert cheap.offset_s >= CorrectedCost.MIN_OFFSET_S
    assert cheap.context_s_per_token >= -CorrectedCost.MAX_CONTEXT_S_PER_TOKEN
    assert cheap.marginal_s(150, 14000) >= 0.0 and cheap.extra_s(_parts(cheap, 150, 14000)) >= 0.0


def test_tail_factor_aims_below_the_target_by_the_tail_of_full_steps() -> None:
    """Mixed steps cut to an 80 ms target whose mean is right but 3 % wait 25 % longer (host
    gaps, a slow step): the factor becomes that tail, so the cut's aim (target / factor) puts
    those steps back at the target. Short steps, however late in relative terms, do not count;
    the factor is never below 1 nor above its bound."""
    from runtime.partition.corrections import TailFactor

    tail = TailFactor()
    target_s = 0.080
    assert tail.factor == TailFactor.MAX_FACTOR  # no tail read yet: aim at the bound
    for _ in range(200):
        tail.observe(0.010, 0.030, target_s)  # a short step waiting 3x its prediction
    assert tail.factor == TailFactor.MAX_FACTOR  # ... and short steps do not count
    for i in range(256):
        tail.observe(0.078, 0.078 * (1.25 if i % 32 == 0 else 1.0), target_s)
    assert tail.factor == pytest.approx(1.25)
    assert 0.078 / tail.factor * 1.25 <= target_s
    early = TailFactor()
    for _ in range(TailFactor.MIN_SAMPLES - 1):
        early.observe(0.078, 0.050, target_s)
    assert early.factor == TailFactor.MAX_FACTOR  # too few steps to read a tail from
    assert not early.measured
    early.observe(0.078, 0.050, target_s)
    assert early.factor == 1.0  # enough on-time steps: the cut aims at the target itself
    assert early.measured
    floored = TailFactor(floor=1.05)  # (layer slices': the delivery after the device)
    for _ in range(TailFactor.MIN_SAMPLES):
        floored.observe(0.078, 0.050, target_s)
    assert floored.factor == 1.05
    fast, stalled = TailFactor(), TailFactor()
    for _ in range(64):
        fast.observe(0.078, 0.050, target_s)
        stalled.observe(0.078, 1.0, target_s)
    assert fast.factor == 1.0 and stalled.factor == TailFactor.MAX_FACTOR


def test_score_after_a_prefix_hit_keeps_its_partial_block_for_the_step() -> None:
    """After a hit the whole prompt is written (the backend then attends from the pool, no
    per-layer copy of the context); the partial block is freed with the request, never cached;
    without room for it the suffix is discarded as before."""
    s = make(num_blocks=64)
    s.add(score("a", list(range(10, 31))))  # 21 tokens: 5 full blocks + 1 partial
    plan = s.schedule(cap(s))
    s.update(plan, FakeRunner().run(plan))
    s.add(score("b", list(range(10, 30)) + [99, 98, 97]))  # 23 tokens: a 5-block hit
    plan = s.schedule(cap(s))
    seq = plan.prefill[0]
    assert seq.num_context_tokens == 20 and seq.num_kept_tokens == 23
    assert len(seq.block_ids) == 6
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0 and len(s.bm.prefix_cache) == 5  # partial never cached
    tight = make(num_blocks=5)
    tight.add(score("a", list(range(10, 31))))
    plan = tight.schedule(cap(tight))
    tight.update(plan, FakeRunner().run(plan))
    tight.add(score("b", list(range(10, 30)) + [99, 98, 97]))
    plan = tight.schedule(cap(tight))
    assert plan.prefill[0].num_kept_tokens == 20  # no sixth block: the suffix is discarded
