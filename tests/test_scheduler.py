"""Scheduler with a fake runner: policy order, token budget, chunking, suffix-KV discard,
preemption, abort, stop handling, and KV invariants throughout."""

from __future__ import annotations

import random

from policies import make_policy
from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.prefix_cache import PrefixCache
from runtime.request import Request, RequestKind, SamplingParams
from runtime.scheduler import RunnerOutput, Scheduler, StepPlan

BS = 4
EOS = 99


class CharTokenizer:
    """Token id t decodes to chr(ord('a') + t % 26); EOS decodes to nothing (special)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if t == EOS else chr(ord("a") + t % 26) for t in ids)


class FakeRunner:
    """Samples a scripted token per request (default: token 1) and scores labels."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}
        self.plans: list[StepPlan] = []

    def run(self, plan: StepPlan) -> RunnerOutput:
        self.plans.append(plan)
        out = RunnerOutput()
        for s in plan.seqs:
            # Every step must only touch KV the request owns, within its block table.
            assert s.num_kept_tokens <= len(s.block_ids) * BS
            assert len(s.input_ids) == s.num_new_tokens
            if not s.needs_output:
                continue
            r = s.request
            if r.kind == RequestKind.SCORE:
                out.label_probs[r.request_id] = [0.25, 0.75]
            else:
                seq = self.script.get(r.request_id, [])
                i = r.num_output_tokens
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
    return Scheduler(cfg, bm, make_policy(policy), CharTokenizer(), [EOS], **kwargs)


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


def drive(s: Scheduler, runner: FakeRunner, max_steps: int = 200) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        plan = s.schedule()
        for o in s.update(plan, runner.run(plan)):
            outs.setdefault(o.request_id, []).append(o)
        s.bm.check_integrity()
    assert not s.has_work()
    return outs


def test_generate_runs_to_max_tokens_and_frees_kv() -> None:
    s = make()
    s.add(gen("a", 6, max_tokens=5))
    outs = drive(s, FakeRunner())
    toks = [t for o in outs["a"] for t in o.new_token_ids]
    assert toks == [1] * 5 and outs["a"][-1].finish_reason == "length"
    assert "".join(o.new_text for o in outs["a"]) == "bbbbb"
    # Only cached-idle blocks remain, none referenced.
    assert s.bm.num_used_blocks == 0


def test_eos_and_stop_token_and_ignore_eos() -> None:
    s = make()
    s.add(gen("eos", 3, max_tokens=10))
    s.add(gen("ign", 3, max_tokens=4, ignore_eos=True))
    s.add(gen("stop", 3, max_tokens=10, stop_token_ids=[7]))
    outs = drive(s, FakeRunner({"eos": [2, EOS, 3], "ign": [2, EOS, 3, 4], "stop": [2, 7, 3]}))
    assert outs["eos"][-1].finish_reason == "stop"
    assert [t for o in outs["eos"] for t in o.new_token_ids] == [2, EOS]
    assert "".join(o.new_text for o in outs["eos"]) == "c"
    assert outs["ign"][-1].finish_reason == "length"
    assert "".join(o.new_text for o in outs["stop"]) == "c"  # the stop token's text is hidden


def test_stop_string_is_cut_and_partial_matches_are_held_back() -> None:
    s = make()
    # tokens 2,3,4,5,6 -> "c d e f g"; stop "ef" appears after "cd"; "e" alone is held back.
    s.add(gen("a", 3, max_tokens=10, stop=["ef", "xyz"]))
    outs = drive(s, FakeRunner({"a": [2, 3, 4, 5, 6]}))
    texts = [o.new_text for o in outs["a"]]
    assert "".join(texts) == "cd"
    assert texts[2] == ""  # "e" could start "ef": not sent yet
    assert outs["a"][-1].finish_reason == "stop"


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
    plan = s.schedule()
    s.update(plan, FakeRunner().run(plan))
    s.add(b)
    assert s.view(b).num_cached_tokens_now == 32  # the profile blocks a left behind
    plan = s.schedule()
    seq = plan.prefill[0]
    assert seq.num_context_tokens == 32 and seq.num_new_tokens == 1
    s.update(plan, FakeRunner().run(plan))
    assert s.bm.prefix_cache.hit_tokens == 32
    s.bm.check_integrity()


def test_score_keeps_only_full_prompt_blocks_in_cache() -> None:
    s = make(num_blocks=64)
    s.add(score("a", list(range(10, 31))))  # 21 tokens: 5 full blocks + 1 partial
    plan = s.schedule()
    seq = plan.prefill[0]
    assert seq.num_kept_tokens == 20 and len(seq.block_ids) == 5
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0
    assert s.bm.prefix_cache.num_evictable == 5 == len(s.bm.prefix_cache)


def test_score_discards_what_the_pool_cannot_hold() -> None:
    s = make(num_blocks=3)
    s.add(score("a", list(range(10, 31))))  # would keep 5 blocks; the pool has 3
    plan = s.schedule()
    assert plan.prefill[0].num_kept_tokens == 12
    s.update(plan, FakeRunner().run(plan))
    s.bm.check_integrity()
    s2 = make(cache=False)
    s2.add(score("b", list(range(10, 31))))
    plan = s2.schedule()
    assert plan.prefill[0].num_kept_tokens == 0 and plan.prefill[0].block_ids == []


def test_generate_prompt_is_chunked() -> None:
    s = make(budget=8)
    s.add(gen("a", 21, max_tokens=2))
    runner = FakeRunner()
    outs = drive(s, runner)
    chunks = [p.prefill[0].num_new_tokens for p in runner.plans if p.prefill]
    assert chunks == [8, 8, 5]
    assert [p.prefill[0].needs_output for p in runner.plans[:3]] == [False, False, True]
    assert len([t for o in outs["a"] for t in o.new_token_ids]) == 2


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    # 6 blocks; two requests of 8 tokens (2 blocks each) growing to 16 (4 blocks each).
    s = make(num_blocks=6, budget=64, cache=False)
    s.add(gen("a", 8, max_tokens=8, arrival=0.0))
    s.add(gen("b", 8, max_tokens=8, arrival=1.0))
    outs = drive(s, FakeRunner())
    assert s.num_preemptions >= 1
    for rid in "ab":
        assert len([t for o in outs[rid] for t in o.new_token_ids]) == 8
        assert outs[rid][-1].finish_reason == "length"
    assert s.bm.num_free_blocks == 6


def test_abort_frees_kv_waiting_and_running() -> None:
    s = make()
    s.add(gen("a", 10, max_tokens=50))
    s.add(gen("w", 10, max_tokens=50))
    plan = s.schedule()
    s.update(plan, FakeRunner().run(plan))
    out = s.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert s.abort("a") is None
    out = s.abort("w")
    assert out is not None and out.finish_reason == "abort"
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0 and not s.has_work()


def test_a_prompt_that_never_fits_fails_clearly() -> None:
    s = make(num_blocks=2, cache=False)
    s.add(gen("huge", 20, max_tokens=2))
    plan = s.schedule()
    assert plan.is_empty
    outs = s.take_pending_outputs()
    assert outs[0].finish_reason == "error" and "KV blocks" in (outs[0].error or "")


def test_max_num_seqs_bounds_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(gen(f"r{i}", 4, max_tokens=3, arrival=float(i)))
    runner = FakeRunner()
    for _ in range(3):
        plan = s.schedule()
        assert s.num_running <= 2
        s.update(plan, runner.run(plan))


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    s = make(num_blocks=20, budget=24, max_num_seqs=6)
    runner = FakeRunner()
    profiles = [[rng.randrange(1, 90) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    n_added = 0
    finished: set[str] = set()
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
        plan = s.schedule()
        for o in s.take_pending_outputs() + s.update(plan, runner.run(plan)):
            if o.finished:
                assert o.request_id not in finished
                finished.add(o.request_id)
        s.bm.check_integrity()
        for r in s.waiting:  # the memoized cached-prefix lengths equal a fresh lookup
            _, fresh = s.bm.prefix_cache.match_prefix(r.all_token_ids)
            assert s.view(r).num_cached_tokens_now == min(fresh, (r.num_tokens - 1) // BS * BS)
    drive(s, runner, max_steps=2000)
    assert s.bm.num_used_blocks == 0
    assert s.num_preemptions > 0  # the pool is small enough that preemption happened


def test_cached_prefix_memo_follows_insertions_and_evictions() -> None:
    s = make(num_blocks=4)
    prefix = [7, 7, 7, 7, 8, 8, 8, 8]
    w = score("w", prefix + [1])
    s.add(w)
    assert s.view(w).num_cached_tokens_now == 0
    s.add(score("a", prefix + [2]))
    # Run "a" alone: it caches the two prefix blocks.
    s.waiting.remove(w)
    plan = s.schedule()
    s.update(plan, FakeRunner().run(plan))
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
    plan = s.schedule()
    ids = [q.request.request_id for q in plan.prefill]
    assert ids == ["u0-0", "other"]  # the follower waits; the next in order still runs
    s.update(plan, FakeRunner().run(plan))
    plan = s.schedule()
    (seq,) = plan.prefill
    assert seq.request.request_id == "u0-1" and seq.num_context_tokens == 32  # a hit


def test_a_waiting_follower_runs_once_the_prefilling_leader_is_aborted() -> None:
    s = make(num_blocks=128, budget=16, wait_tokens=16)
    lead = gen("lead", 40, max_tokens=2)  # chunked: 16 tokens per step
    s.add(lead)
    plan = s.schedule()  # lead's first chunk
    s.update(plan, FakeRunner().run(plan))
    follower = gen("follow", 40, max_tokens=2)  # the same 40 prompt tokens
    s.add(follower)
    plan = s.schedule()
    assert [q.request.request_id for q in plan.prefill] == ["lead"]  # follower waits
    s.update(plan, FakeRunner().run(plan))
    s.abort("lead")
    plan = s.schedule()
    (seq,) = plan.prefill
    assert seq.request.request_id == "follow" and seq.num_context_tokens == 32  # lead's chunks
    outs = drive(s, FakeRunner())
    assert outs["follow"][-1].finished
