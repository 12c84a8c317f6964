"""Policy orderings on hand-built queues, and the starvation bound (docs/scheduling.md)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest

from bench.sim_workloads import SPECS, SimRequestSpec, Workload
from policies import (
    DEFAULT_FAIRNESS_LAMBDA,
    DEFAULT_GAMMA_TOKENS_PER_S,
    POLICY_NAMES,
    SPF,
    SRJF,
    JCTModel,
    make_policy,
    prefill_work,
)


@dataclass
class View:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_cached_tokens_now: int = 0
    remaining_prompt_tokens: int = -1

    def __post_init__(self) -> None:
        if self.remaining_prompt_tokens < 0:
            self.remaining_prompt_tokens = self.num_prompt_tokens


def order(policy, views: list[View], now_s: float) -> list[str]:
    """The scheduler's convention: lowest score first, ties by arrival."""
    return [
        v.request_id for v in sorted(views, key=lambda v: (policy.score(v, now_s), v.arrival_s))
    ]


def test_policies_never_import_torch() -> None:
    code = "import sys, policies, policies.jct; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_make_policy_names_and_params() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown prefill policy"):
        make_policy("lifo")
    assert make_policy("spf", gamma=2.0).gamma == 2.0
    assert make_policy("spf").gamma == DEFAULT_GAMMA_TOKENS_PER_S
    srjf = make_policy("srjf", fairness_lambda=0.5, jct_model=JCTModel(1, 2, 3))
    assert srjf.fairness_lambda == 0.5 and srjf.jct_model.a_s == 1
    assert make_policy("srjf").fairness_lambda == DEFAULT_FAIRNESS_LAMBDA
    with pytest.raises(ValueError):
        SPF(gamma=-1)


def test_fcfs_orders_by_arrival() -> None:
    views = [View("late-short", 2.0, 10), View("early-long", 1.0, 50_000), View("mid", 1.5, 500)]
    assert order(make_policy("fcfs"), views, now_s=3.0) == ["early-long", "mid", "late-short"]


def test_spf_shortest_first_then_aging_wins() -> None:
    spf = SPF(gamma=15.0)
    old_long, new_short = View("old-long", 0.0, 1_000), View("new-short", 10.0, 400)
    # At t=10 the long one's 10 s of waiting is worth 150 tokens: 850 > 400, short first.
    assert order(spf, [old_long, new_short], now_s=10.0) == ["new-short", "old-long"]
    # The keys differ by (1000 - 400) - 15*10 = 450 tokens; a newcomer of 400 tokens arriving
    # after (1000-400)/15 = 40 s no longer overtakes.
    newer_short = View("newer-short", 41.0, 400)
    assert order(spf, [old_long, newer_short], now_s=41.0) == ["old-long", "newer-short"]
    # Remaining tokens (chunked prefill progress) is what counts, not the prompt length.
    half_done = View("half-done", 0.0, 1_000, remaining_prompt_tokens=100)
    assert order(spf, [half_done, View("fresh", 0.0, 400)], 0.0) == ["half-done", "fresh"]


def test_srjf_cache_hit_jumps_ahead() -> None:
    srjf = SRJF(JCTModel(), fairness_lambda=0.1)
    # Same length, the later one's 14k-token profile is cached now: it goes first.
    miss = View("miss", 0.0, 14_150)
    hit = View("hit", 1.0, 14_150, num_cached_tokens_now=14_000)
    assert order(srjf, [miss, hit], now_s=1.5) == ["hit", "miss"]
    # A long prompt with a cached prefix beats a shorter, uncached one.
    short_uncached = View("short", 1.0, 3_000)
    assert order(srjf, [short_uncached, hit], now_s=1.5) == ["hit", "short"]
    # SPF, blind to the cache, keeps the shorter prompt first.
    assert order(SPF(), [short_uncached, hit], now_s=1.5) == ["short", "hit"]


def test_srjf_continuous_recalibration_vs_oneshot() -> None:
    cont = SRJF(JCTModel(), fairness_lambda=0.1)
    once = SRJF(JCTModel(), fairness_lambda=0.1, oneshot=True)
    a = View("a", 0.0, 14_150)  # uncached at its first decision
    b = View("b", 0.5, 6_000)
    assert order(cont, [a, b], 1.0) == ["b", "a"]
    assert order(once, [a, b], 1.0) == ["b", "a"]
    a.num_cached_tokens_now = 14_000  # another request of the same user just ran
    assert order(cont, [a, b], 1.1) == ["a", "b"]
    assert order(once, [a, b], 1.1) == ["b", "a"]  # one-shot still believes the first estimate
    # The one-shot score keeps aging: only the JCT part is frozen.
    assert once.score(a, 2.0) == pytest.approx(once.score(a, 1.0) - 0.1)
    once.forget("a")
    assert once.score(a, 1.0) == pytest.approx(cont.score(a, 1.0))


def test_srjf_cold_fcfs_runs_cold_requests_in_arrival_order_after_warm_ones() -> None:
    """`srjf-cold-fcfs`: a cold profile of 11k tokens no longer overtakes an earlier one of
    17k (SRJF's does); warm requests (most of their work cached) still go first, shortest
    first among them; the offset still ages a cold request past later warm ones."""
    model = JCTModel()
    cold_fcfs = make_policy("srjf-cold-fcfs", jct_model=model)
    srjf = make_policy("srjf", jct_model=model)
    long_cold, short_cold = View("long-cold", 0.0, 17_150), View("short-cold", 0.5, 11_150)
    warm = View("warm", 1.0, 14_150, num_cached_tokens_now=14_000)
    warmer = View("warmer", 1.0, 14_150, num_cached_tokens_now=14_100)
    views = [long_cold, short_cold, warm, warmer]
    assert order(srjf, views, 1.0) == ["warmer", "warm", "short-cold", "long-cold"]
    assert order(cold_fcfs, views, 1.0) == ["warmer", "warm", "long-cold", "short-cold"]
    # Cold ranks at the arrivals' mean cold JCT: the long one's own would keep it behind.
    assert model.predict_s(11_150, 0) < cold_fcfs.cold_jct_s < model.predict_s(17_150, 0)
    # Half its work cached is still cold (WARM_SHARE 0.5): it waits its turn in arrival order.
    half = View("half", 0.8, 14_150, num_cached_tokens_now=7_000)
    assert order(cold_fcfs, [short_cold, half], 1.0) == ["short-cold", "half"]
    # A cold request waiting long enough leads a warm one that just came.
    window = (cold_fcfs.cold_jct_s - cold_fcfs.jct_s(warm)) / DEFAULT_FAIRNESS_LAMBDA
    late_warm = View("late-warm", 1.05 * window, 14_150, num_cached_tokens_now=14_000)
    assert order(cold_fcfs, [long_cold, late_warm], 1.05 * window)[0] == "long-cold"
    with pytest.raises(ValueError, match="not both"):
        SRJF(model, oneshot=True, cold_fcfs=True)


def test_prefill_work_counts_cache_and_chunk_progress() -> None:
    assert prefill_work(View("x", 0, 1000)) == (1000, 0)
    assert prefill_work(View("x", 0, 1000, num_cached_tokens_now=600)) == (400, 600)
    assert prefill_work(View("x", 0, 1000, remaining_prompt_tokens=100)) == (100, 900)
    # A full hit still computes the last token (its logits are the answer).
    assert prefill_work(View("x", 0, 1000, num_cached_tokens_now=1000)) == (1, 999)


# --- starvation bound -------------------------------------------------------------------------


def _adversarial(long_tokens: int, short_tokens: int, gap_s: float, num_short: int) -> Workload:
    """One short at t=0 (it occupies the GPU), the long one just after it, then shorts every
    `gap_s` seconds -- faster than they can be served -- for `num_short` arrivals."""
    reqs = [SimRequestSpec("s0", 0.0, None, 0, short_tokens)]
    reqs.append(SimRequestSpec("long", 1e-6, None, 0, long_tokens))
    reqs += [SimRequestSpec(f"s{i}", i * gap_s, None, 0, short_tokens) for i in range(1, num_short)]
    return Workload(SPECS["short-scoring"], reqs, {})


def _long_wait_s(policy, wl: Workload, model: JCTModel) -> float:
    """Wait of the long request in a noiseless one-request-at-a-time, non-preemptive run."""
    pending = sorted(wl.requests, key=lambda r: r.arrival_unit_s)
    waiting: list[View] = []
    now, i, served = 0.0, 0, 0
    while served < len(pending):
        while i < len(pending) and pending[i].arrival_unit_s <= now:
            r = pending[i]
            waiting.append(View(r.request_id, r.arrival_unit_s, r.num_prompt_tokens))
            i += 1
        if not waiting:
            now = pending[i].arrival_unit_s
            continue
        nxt = min(waiting, key=lambda v: (policy.score(v, now), v.arrival_s))
        if nxt.request_id == "long":
            return now - nxt.arrival_s
        waiting.remove(nxt)
        now += model.predict_s(nxt.num_prompt_tokens, 0)
        served += 1
    raise AssertionError("the long request never ran")


def _bound_s(wl: Workload, model: JCTModel, window_s: float) -> float:
    """Documented bound: residual of the job running at arrival + the work of every request
    that can overtake (those already queued -- none here -- and arrivals within the window)."""
    a_long = wl.requests[1].arrival_unit_s
    running = model.predict_s(wl.requests[0].num_prompt_tokens, 0)
    overtakers = [r for r in wl.requests[2:] if r.arrival_unit_s <= a_long + window_s]
    return running + sum(model.predict_s(r.num_prompt_tokens, 0) for r in overtakers)


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_srjf_starvation_bound_under_adversarial_shorts(lam: float) -> None:
    model = JCTModel()
    wl = _adversarial(long_tokens=16_000, short_tokens=1_000, gap_s=0.02, num_short=1500)
    assert model.predict_s(1_000, 0) > 0.02  # the short stream alone overloads the GPU
    j_long, j_min = model.predict_s(16_000, 0), model.predict_s(1, 0)
    window = (j_long - j_min) / lam
    wait = _long_wait_s(SRJF(model, fairness_lambda=lam), wl, model)
    assert wait <= _bound_s(wl, model, window) + 1e-9
    # And the bound is not vacuous: the long one does get overtaken for most of the window.
    assert wait >= _bound_s(wl, model, 0.5 * window)


def test_without_offset_the_long_request_starves() -> None:
    """The same adversarial stream with lambda = 0: the long one waits for the whole stream,
    far beyond the lambda = 0.1 bound -- the bound test above is not vacuous."""
    model = JCTModel()
    wl = _adversarial(long_tokens=16_000, short_tokens=1_000, gap_s=0.02, num_short=1500)
    j_long, j_min = model.predict_s(16_000, 0), model.predict_s(1, 0)
    wait = _long_wait_s(SRJF(model, fairness_lambda=0.0), wl, model)
    assert wait > _bound_s(wl, model, (j_long - j_min) / 0.1) * 2


def test_spf_starvation_bound_under_adversarial_shorts() -> None:
    model = JCTModel()
    gamma = 1_000.0  # a large gamma keeps the window (and the test) short; the bound is the same
    wl = _adversarial(long_tokens=16_000, short_tokens=1_000, gap_s=0.02, num_short=1200)
    window = (16_000 - 1) / gamma  # R_min = 1 token
    wait = _long_wait_s(SPF(gamma=gamma), wl, model)
    assert wait <= _bound_s(wl, model, window) + 1e-9
    assert wait >= _bound_s(wl, model, 0.5 * window)


def test_default_gamma_window_on_keys() -> None:
    """With the default gamma, a request of R tokens is never outranked by a 1-token newcomer
    arriving more than (R - 1)/gamma seconds later (the order key is R + gamma*arrival)."""
    spf = SPF()
    old = View("old", 0.0, 16_000)
    window = (16_000 - 1) / DEFAULT_GAMMA_TOKENS_PER_S
    just_inside = View("in", window - 1.0, 1)
    just_after = View("after", window + 1.0, 1)
    assert order(spf, [old, just_inside], window) == ["in", "old"]
    assert order(spf, [old, just_after], window + 1.0) == ["old", "after"]


def test_srjf_offset_from_a_latency_slo() -> None:
    """Given an SLO, lambda = J_cold / (SLO - J_cold) with J_cold the arrivals' mean predicted
    cold JCT (EWMA): a cold request is overtaken only for about the SLO's slack."""
    from policies.srjf import COLD_JCT_EWMA

    model = JCTModel()
    slo_s = 10 * model.predict_s(14_150, 0)  # 10x a cold post-recommendation prompt
    srjf = make_policy("srjf", jct_model=model, latency_slo_s=slo_s)
    cold = View("cold", 0.0, 14_150)
    srjf.score(cold, 0.0)
    j = model.predict_s(14_150, 0)
    assert srjf.cold_jct_s == pytest.approx(j)
    assert srjf.fairness_lambda == pytest.approx(j / (slo_s - j))  # 1/9
    srjf.score(cold, 1.0)  # the same request again: counted once
    assert srjf.cold_jct_s == pytest.approx(j)
    short = View("short", 0.5, 500)
    srjf.score(short, 1.0)
    js = model.predict_s(500, 0)
    want = j + COLD_JCT_EWMA * (js - j)
    assert srjf.cold_jct_s == pytest.approx(want)
    assert srjf.fairness_lambda == pytest.approx(want / (slo_s - want))
    # The overtaking window: warm requests arriving later go first until the cold one's
    # score reaches 0, after waiting j / lambda (about the SLO's slack), then it leads.
    w0 = j / srjf.fairness_lambda
    assert w0 == pytest.approx((slo_s - want) * j / want)
    for at, first in ((0.5 * w0, "warm"), (1.01 * w0, "cold")):
        warm = View("warm", at, 14_150, num_cached_tokens_now=14_000)
        assert order(srjf, [cold, warm], now_s=at)[0] == first, at
    # An SLO under the cold JCT: a large, finite offset (the slack's floor).
    tight = make_policy("srjf", jct_model=model, latency_slo_s=j / 2)
    tight.score(cold, 0.0)
    assert math.isfinite(tight.fairness_lambda) and tight.fairness_lambda > 10
    with pytest.raises(ValueError, match="not both"):
        SRJF(model, fairness_lambda=0.1, latency_slo_s=slo_s)
    with pytest.raises(ValueError, match="latency_slo_s"):
        SRJF(model, latency_slo_s=0.0)
