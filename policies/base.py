"""The policy interface. Policies only order the prefill queue; they are pure Python."""

from __future__ import annotations

from typing import Protocol


class WaitingView(Protocol):
    """What a policy may see of a waiting request (read-only).

    The scheduler also exposes `request_id: str` on its views; `srjf-oneshot` uses it to
    remember the JCT it estimated at a request's first decision (it falls back to
    (arrival_s, num_prompt_tokens) as the key when a view has no id).
    """

    @property
    def arrival_s(self) -> float: ...  # monotonic seconds

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens_now(self) -> int: ...  # prefix-cache hit looked up at this decision

    @property
    def remaining_prompt_tokens(
        self,
    ) -> int: ...  # prompt tokens still to compute (chunked prefill)


class Policy(Protocol):
    name: str

    def score(self, req: WaitingView, now_s: float) -> float:
        """Lower runs first. Ties are broken by arrival time by the caller."""
        ...


def prefill_work(req: WaitingView) -> tuple[int, int]:
    """(uncached tokens to compute, tokens of context already in KV) for a waiting request.

    Context is the larger of the prefix-cache hit now and what earlier chunks already
    computed (`num_prompt_tokens - remaining_prompt_tokens`). At least one token is always
    computed: the last prompt token's logits are the answer.
    """
    done = max(req.num_cached_tokens_now, req.num_prompt_tokens - req.remaining_prompt_tokens)
    done = min(max(done, 0), max(req.num_prompt_tokens - 1, 0))
    return max(req.num_prompt_tokens - done, 1), done
