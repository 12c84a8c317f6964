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


class SRJF:
    """score = JCT(uncached_now, cached_now) - lambda * wait_s   (units: seconds).

    Continuous calibration: the JCT is re-predicted at every decision from the cached-prefix
    length the scheduler looked up *now*, so a request whose prefix was just cached moves up.
    With `oneshot=True` the JCT estimated at a request's first decision is kept for its
    lifetime (the ablation PrefillOnly's reviewers asked for); the offset still applies.
    """

    def __init__(
        self,
        jct_model: JCTModel | None = None,
        fairness_lambda: float | None = None,
        oneshot: bool = False,
    ) -> None:
        self.jct_model = jct_model if jct_model is not None else JCTModel()
        self.fairness_lambda = (
            DEFAULT_FAIRNESS_LAMBDA if fairness_lambda is None else float(fairness_lambda)
        )
        if self.fairness_lambda < 0:
            raise ValueError("srjf fairness_lambda must be >= 0 (s of JCT per s of wait)")
        self.oneshot = oneshot
        self.name = "srjf-oneshot" if oneshot else "srjf"
        self._first_jct_s: OrderedDict[object, float] = OrderedDict()

    def jct_s(self, req: WaitingView) -> float:
        """Predicted JCT used for `req` (the first estimate when one-shot)."""
        if not self.oneshot:
            return self.jct_model.predict_s(*prefill_work(req))
        key = getattr(req, "request_id", None) or (req.arrival_s, req.num_prompt_tokens)
        jct = self._first_jct_s.get(key)
        if jct is None:
            jct = self.jct_model.predict_s(*prefill_work(req))
            self._first_jct_s[key] = jct
            if len(self._first_jct_s) > _ONESHOT_MEMORY:
                self._first_jct_s.popitem(last=False)
        return jct

    def forget(self, request_id: str) -> None:
        """Drop a finished request's one-shot estimate (optional; memory is bounded anyway)."""
        self._first_jct_s.pop(request_id, None)

    def score(self, req: WaitingView, now_s: float) -> float:
        return self.jct_s(req) - self.fairness_lambda * (now_s - req.arrival_s)
