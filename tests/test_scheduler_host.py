"""bench.scheduler_host on a small shape: the queue holds its length, both times are read."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("policy", ["fcfs", "srjf"])
def test_the_queue_stays_at_its_length_and_both_phases_are_timed(policy: str) -> None:
    from bench.scheduler_host import time_steps

    res = time_steps(
        policy,
        num_waiting=5,
        budget=25,
        num_steps=20,
        profile_tokens=320,
        post_tokens=20,
        num_users=3,
        seed=0,
    )
    # one arrival a step and one admission a step (25 tokens: one 20-token post)
    assert 3 <= res["waiting_at_end"] <= 8, res
    assert res["schedule_ms"] > 0 and res["update_ms"] > 0


def test_decode_steps_are_timed_after_the_prefills() -> None:
    from bench.scheduler_host import time_decode_steps

    res = time_decode_steps(num_streams=4, prompt_tokens=40, num_steps=30, seed=0)
    assert res["schedule_ms"] > 0 and res["update_ms"] > 0
