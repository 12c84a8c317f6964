"""Shortest remaining job first on predicted JCT, with a fairness offset (PrefillOnly Alg. 1)."""

from __future__ import annotations

from collections import OrderedDict

from policies.base import WaitingView, prefill_work
from policies.jct import JCTModel

# Fairness offset: seconds of predicted JCT forgiven per second of waiting (dimensionless).
# 0.1 means a request can be overtaken only by jobs arriving within 10x its own predicted
# JCT after it (docs/scheduling.md derives the bound and shows the simulator sweep behind it).
DEFAULT_FAIRNESS_LAMBDA = 0.1

_ONESHOT_MEMORY = 65536  # remembered estimates; oldest forgotten first (bounded memory)

# With a latency SLO: the slack (SLO - cold JCT) is floored at this fraction of the SLO (an SLO
# under the cold JCT gives a large, finite lambda), and the cold JCT is averaged over arrivals
# with this weight on the newest (~100 arrivals of memory).
MIN_SLACK_FRACTION = 0.05
COLD_JCT_EWMA = 0.01

# `srjf-cold-fcfs`: a request is warm when its predicted JCT now is under this share of its JCT
# with nothing cached (most of its work is in the prefix cache), else cold.
WARM_SHARE = 0.5


class SRJF:
    """score = JCT(uncached_now, cached_now) - lambda * wait_s   (units: seconds).

    Continuous calibration: the JCT is re-predicted at every decision from the cached-prefix
    length the scheduler looked up *now*, so a request whose prefix was just cached moves up.
    With `oneshot=True` the JCT estimated at a request's first decision is kept for its
    lifetime (the ablation PrefillOnly's reviewers asked for); the offset still applies.

    With `cold_fcfs=True` (`srjf-cold-fcfs`) only warm requests (predicted JCT now under
    WARM_SHARE of their cold JCT) rank by JCT; every cold one ranks at the running mean cold
    JCT of arrivals, so cold requests run in arrival order among themselves, after the warm
    ones unless the offset has aged them past. Why: in post recommendation's cold profiles
    (11k-17k tokens) plain SRJF lets a short cold profile overtake a long one, and those long
    cold prompts make its P99 (docs/scheduling.md, "Why it swings"); ranking them alike keeps
    SRJF's cache affinity (warm posts first) without that starvation.
    """

    def __init__(
        self,
        jct_model: JCTModel | None = None,
        fairness_lambda: float | None = None,
        oneshot: bool = False,
        latency_slo_s: float | None = None,
        cold_fcfs: bool = False,
    ) -> None:
        """latency_slo_s: the latency (queueing + prefill) requests should stay within. Given,
        lambda follows it instead of `fairness_lambda`: lambda = J_cold / (SLO - J_cold), with
        J_cold the mean predicted cold JCT of the requests seen so far (an EWMA over arrivals).
        A request then waits at most about the SLO's slack for requests that overtake it. In
        the simulator's lambda sweeps that rule lands on the best fixed lambda at 5x, 10x and
        20x SLOs (docs/scheduling.md); a per-request slack (each request aging to reach the
        front at its own latest start) was tried and lost up to 3x max QPS at wide SLOs."""
        if fairness_lambda is not None and latency_slo_s is not None:
            raise ValueError("srjf takes fairness_lambda or latency_slo_s, not both")
        if oneshot and cold_fcfs:
            raise ValueError("srjf takes oneshot or cold_fcfs, not both")
        self.jct_model = jct_model if jct_model is not None else JCTModel()
        self.fairness_lambda = (
            DEFAULT_FAIRNESS_LAMBDA if fairness_lambda is None else float(fairness_lambda)
        )
        if self.fairness_lambda < 0:
            raise ValueError("srjf fairness_lambda must be >= 0 (s of JCT per s of wait)")
        if latency_slo_s is not None and not latency_slo_s > 0:
            raise ValueError("srjf latency_slo_s must be > 0 (seconds)")
        self.latency_slo_s = latency_slo_s
        # EWMA of arrivals' predicted cold JCT (SLO mode: lambda follows it; cold_fcfs: the
        # cold requests' rank)
        self.cold_jct_s: float | None = None
        self._seen: OrderedDict[object, None] = OrderedDict()  # requests counted in the EWMA
        self.oneshot = oneshot
        self.cold_fcfs = cold_fcfs
        self.name = "srjf-oneshot" if oneshot else "srjf-cold-fcfs" if cold_fcfs else "srjf"
        self._first_jct_s: OrderedDict[object, float] = OrderedDict()

    def jct_s(self, req: WaitingView) -> float:
        """Predicted JCT used for `req` (the first estimate when one-shot)."""
        if not self.oneshot:
            return self.jct_model.predict_s(*prefill_work(req))
        key = _request_key(req)
        jct = self._first_jct_s.get(key)
        if jct is None:
            jct = self.jct_model.predict_s(*prefill_work(req))
            self._first_jct_s[key] = jct
            if len(self._first_jct_s) > _ONESHOT_MEMORY:
                self._first_jct_s.popitem(last=False)
        return jct

    def cold_jct_of(self, req: WaitingView) -> float:
        """Predicted JCT of `req` with nothing cached (s)."""
        return self.jct_model.predict_s(max(req.num_prompt_tokens, 1), 0)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's one-shot estimate (optional; memory is bounded anyway)."""
        self._first_jct_s.pop(request_id, None)

    def score(self, req: WaitingView, now_s: float) -> float:
        if self.latency_slo_s is not None or self.cold_fcfs:
            self._observe_arrival(req)
        jct = self.jct_s(req)
        if self.cold_fcfs:
            if jct >= WARM_SHARE * self.cold_jct_of(req):
                assert self.cold_jct_s is not None  # (set by _observe_arrival)
                jct = self.cold_jct_s
        return jct - self.fairness_lambda * (now_s - req.arrival_s)

    def _observe_arrival(self, req: WaitingView) -> None:
        """Fold a request's cold JCT into the EWMA the first time it is scored and, in SLO
        mode, set lambda from it (O(1) per call: one dict lookup after the first)."""
        key = _request_key(req)
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > _ONESHOT_MEMORY:
            self._seen.popitem(last=False)
        cold = self.cold_jct_of(req)
        prev = self.cold_jct_s
        self.cold_jct_s = cold if prev is None else prev + COLD_JCT_EWMA * (cold - prev)
        slo = self.latency_slo_s
        if slo is None:
            return
        slack = max(slo - self.cold_jct_s, MIN_SLACK_FRACTION * slo)
        self.fairness_lambda = self.cold_jct_s / slack


def _request_key(req: WaitingView) -> object:
    """What identifies a request across decisions: its id, else its arrival and length."""
    return getattr(req, "request_id", None) or (req.arrival_s, req.num_prompt_tokens)
