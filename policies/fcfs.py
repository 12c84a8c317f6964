from __future__ import annotations

from policies.base import WaitingView


class FCFS:
    """First come, first served: the score is the arrival time."""

    name = "fcfs"

    def score(self, req: WaitingView, now_s: float) -> float:
        return req.arrival_s
