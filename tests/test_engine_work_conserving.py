"""The engine is work-conserving under KV pressure: whenever requests wait, a step is in flight
or one is planned. Issue 17's GPU searches queue longer than the simulator at the same work
(docs/scheduling.md, "Running a long step alone"); an engine that sometimes planned nothing
with work queued (an admission that gives up on a full pool, a wait for a shared prefix that
nothing is computing) would be one cause. Per-user profiles as in post recommendation, a pool
half their working set, requests arriving a few per step."""

from __future__ import annotations

from typing import Any

import pytest
from toy_tokenizer import make_tokenizer

from bench.workloads import WorkloadGenerator
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import Request, RequestKind


def _score(r: Any) -> Request:
    prompt = list(r.query_token_ids) + list(r.item_token_ids)
    return Request(r.request_id, RequestKind.SCORE, prompt, label_token_ids=[5, 6])


@pytest.mark.parametrize("policy", ["fcfs", "srjf"])
def test_nothing_waits_while_the_engine_idles(policy: str):
    gen = WorkloadGenerator("post-recommendation", make_tokenizer(), 0, 0.05, verify=False)
    priming = gen.group_requests()
    working_set = sum(len(r.query_token_ids) for r in priming)
    config = EngineConfig(
        model="random:tiny",
        prefill_policy=policy,
        block_size=16,
        num_kv_blocks=working_set // 2 // 16,  # half the users' profiles
        max_model_len=4096,
    )
    eng = Engine(config, lambda outs: None)
    for r in priming:
        eng.scheduler.add(_score(r))
    arriving = [_score(r) for r in gen.take(150)]
    planned: list[bool] = []
    schedule = eng.scheduler.schedule

    def spy(capacity: Any) -> Any:
        plan = schedule(capacity)
        planned.append(bool(plan.prefill or plan.decode))
        return plan

    eng.scheduler.schedule = spy  # type: ignore[method-assign]
    idle_with_work = 0
    finished: dict[str, str | None] = {}
    for _ in range(5000):
        for _ in range(3):
            if arriving:
                eng.scheduler.add(arriving.pop(0))
        waiting = len(eng.scheduler.waiting)
        in_flight = eng.executor.num_in_flight
        before = len(planned)
        finished.update((o.request_id, o.error) for o in eng._step() if o.finished)
        if waiting and not in_flight and not any(planned[before:]):
            idle_with_work += 1
        if not arriving and not eng.scheduler.has_work() and not eng.executor.num_in_flight:
            break
    assert not arriving
    assert len(finished) == 20 + 150 and not any(finished.values())  # all served, no errors
    assert eng.scheduler.num_shared_prefix_waits > 0  # users' requests overlapped
    assert eng.scheduler.bm.prefix_cache.num_evictions > 100  # the pool was pressed
    assert idle_with_work == 0
