"""Shortest prompt first with aging (Nexus Eq. 10)."""

from __future__ import annotations

from policies.base import WaitingView

DEFAULT_GAMMA_TOKENS_PER_S = 15.0  # Nexus's value


class SPF:
    """score = remaining_prompt_tokens - gamma * wait_s   (units: tokens).

    `gamma` is in tokens per second of waiting: each second in the queue counts as `gamma`
    fewer prompt tokens. With gamma = 15, a request is overtaken by a newcomer only if the
    newcomer is shorter by more than 15 tokens per second the older one has waited, so a
    request of R tokens can be overtaken only by requests that arrive within
    (R - R_min) / gamma seconds after it (docs/scheduling.md, "Starvation bound").
    """

    name = "spf"

    def __init__(self, gamma: float | None = None) -> None:
        self.gamma = DEFAULT_GAMMA_TOKENS_PER_S if gamma is None else float(gamma)
        if self.gamma < 0:
            raise ValueError("spf gamma must be >= 0 (tokens per second of wait)")

    def score(self, req: WaitingView, now_s: float) -> float:
        return req.remaining_prompt_tokens - self.gamma * (now_s - req.arrival_s)
