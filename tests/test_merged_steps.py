"""A step's prefill parts and decodes as one forward (`merge_mixed_steps`, runtime/runner.py):
an engine with it gives the engine without it the same greedy tokens, sampled and prompt
logprobs and label scores (fp32 on CPU), with and without the prefill graphs; steps whose
prefill discards its suffix KV (scoring) keep the two forwards, and on CUDA so do steps too
large for a prefill graph's bucket."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import Collector
from test_prefill_graphs import eager_capture

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.graphs.prefill import PrefillGraphs
from runtime.request import Request, RequestKind, SamplingParams
from runtime.runner import ModelRunner


def _requests() -> list[Request]:
    rng = random.Random(11)
    profile = [rng.randrange(5, 4000) for _ in range(30)]

    def gen(rid: str, n: int, **kw) -> Request:
        sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, **kw)
        return Request(rid, RequestKind.GENERATE, [rng.randrange(5, 4000) for _ in range(n)], sp)

    reqs = [gen("a", 5), gen("b", 37), gen("c", 12, logprobs=2), gen("d", 9, prompt_logprobs=1)]
    reqs.append(Request("s", RequestKind.SCORE, profile + [3, 4, 5], label_token_ids=[7, 8]))
    reqs.append(Request("t", RequestKind.GENERATE, profile + [9], reqs[0].sampling))
    return reqs


def _run(merge: bool, graphs: bool, monkeypatch) -> tuple[dict, int]:
    merged = []
    real = ModelRunner._run_merged

    def spy(self, prefill, decode, pending):  # type: ignore[no-untyped-def]
        merged.append((len(prefill), len(decode)))
        return real(self, prefill, decode, pending)

    monkeypatch.setattr(ModelRunner, "_run_merged", spy)
    sink = Collector()
    cfg = EngineConfig(
        model="random:tiny",
        prefill_policy="fcfs",
        block_size=4,
        num_kv_blocks=128,
        prefill_token_budget=16,  # prompts chunked: their parts land next to decodes
        merge_mixed_steps=merge,
    )
    eng = Engine(cfg, sink)
    if graphs:
        pg = PrefillGraphs(eng.model, eng.kv_pool.device, torch.float32, (8, 16))
        eager_capture(pg)
        eng.runner.prefill_graphs = pg
    eng.start()
    try:
        reqs = _requests()
        for i, r in enumerate(reqs):
            eng.add(r)
            if i == 1:
                sink.wait("a")  # the rest arrive together: their chunks meet b's decodes
        sink.wait(*(r.request_id for r in reqs))
    finally:
        eng.shutdown(0)
    out: dict = {}
    for r in reqs:
        outs = sink.outs[r.request_id]
        if r.kind is RequestKind.SCORE:
            out[r.request_id] = outs[-1].label_probs
            continue
        out[r.request_id] = sink.tokens(r.request_id)
        out[r.request_id + " logprobs"] = [
            (t.token_id, round(t.logprob, 4)) for o in outs for t in o.new_logprobs
        ]
        pl = outs[0].prompt_logprobs
        out[r.request_id + " prompt"] = (
            None if pl is None else [None if t is None else round(t.logprob, 4) for t in pl]
        )
    return out, len(merged)


@pytest.mark.parametrize("graphs", [False, True])
def test_merged_steps_give_the_two_forwards_results(graphs: bool, monkeypatch) -> None:
    base, n0 = _run(False, graphs, monkeypatch)
    got, n1 = _run(True, graphs, monkeypatch)
    assert n0 == 0 and n1 > 0, "steps were merged only when asked"
    for rid, want in base.items():
        if rid == "s":
            assert got[rid] == pytest.approx(want, rel=1e-4, abs=1e-6)
        else:
            assert got[rid] == want, rid
    assert all(len(base[r]) == 8 for r in "abcdt")
    assert len(base["c logprobs"]) == 8 and base["d prompt"] is not None


def test_which_steps_merge() -> None:
    from types import SimpleNamespace

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    runner = SimpleNamespace(
        config=EngineConfig(merge_mixed_steps=True),
        device=cpu,
        prefill_graphs=None,
        merge_off_reason=None,
    )
    keep = SimpleNamespace(num_context_tokens=4, num_new_tokens=8, num_kept_tokens=12)
    discard = SimpleNamespace(num_context_tokens=4, num_new_tokens=8, num_kept_tokens=8)
    mergeable = ModelRunner._mergeable
    assert mergeable(runner, [keep], 3)  # type: ignore[arg-type]
    assert not mergeable(runner, [keep, discard], 3)  # type: ignore[arg-type]
    # CUDA: only into a captured prefill graph's bucket (16 rows here), never eagerly.
    runner.device = cuda
    assert not mergeable(runner, [keep], 3)  # type: ignore[arg-type]
    runner.prefill_graphs = SimpleNamespace(
        captured=True, bucket_for=lambda n: 16 if n <= 16 else None
    )
    assert mergeable(runner, [keep], 8)  # type: ignore[arg-type]  # 8 + 8 rows: a bucket
    assert not mergeable(runner, [keep], 9)  # type: ignore[arg-type]  # 17 rows: none
    runner.prefill_graphs.captured = False
    assert not mergeable(runner, [keep], 1)  # type: ignore[arg-type]
    runner.config = EngineConfig(merge_mixed_steps=False)
    runner.device, runner.prefill_graphs = cpu, None
    assert not mergeable(runner, [keep], 1)  # type: ignore[arg-type]  # switched off
    runner.config = EngineConfig()
    assert mergeable(runner, [keep], 1)  # type: ignore[arg-type]  # on by default
    runner.merge_off_reason = "merged steps kept failing"  # the engine's fallback
    assert not mergeable(runner, [keep], 1)  # type: ignore[arg-type]
