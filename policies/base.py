"""The policy interface. Policies only order the prefill queue; they are pure Python."""

from __future__ import annotations

from typing import Protocol


class WaitingView(Protocol):
    """What a policy may see of a waiting request (read-only)."""

    @property
    def arrival_s(self) -> float: ...  # monotonic seconds

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens_now(self) -> int: ...  # prefix-cache hit looked up at this decision

    @property
    def remaining_prompt_tokens(self) -> int: ...  # prompt tokens still to compute (chunked prefill)


class Policy(Protocol):
    name: str

    def score(self, req: WaitingView, now_s: float) -> float:
        """Lower runs first. Ties are broken by arrival time by the caller."""
        ...
