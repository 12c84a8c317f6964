"""The engine end to end on a tiny random model: scoring leaves only cached prefix blocks,
prefix hits / chunked prefill / preemption do not change results, validation, abort, fault
containment, seeds, shutdown."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.partition.corrections import CorrectedCost
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams


class Collector:
    def __init__(self) -> None:
        self.outs: dict[str, list[EngineOutput]] = {}
        self._cv = threading.Condition()

    def __call__(self, outs: list[EngineOutput]) -> None:  # one engine step's outputs
        with self._cv:
            for o in outs:
                self.outs.setdefault(o.request_id, []).append(o)
            self._cv.notify_all()

    def wait(self, *rids: str, timeout: float = 60.0) -> None:
        def done() -> bool:
            return all(self.outs.get(r) and self.outs[r][-1].finished for r in rids)

        with self._cv:
            assert self._cv.wait_for(done, timeout=timeout), f"timed out waiting for {rids}"

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outs[rid] for t in o.new_token_ids]

    def last(self, rid: str) -> EngineOutput:
        return self.outs[rid][-1]


def make_engine(**overrides) -> tuple[Engine, Collector]:
    sink = Collector()
    cfg = EngineConfig(
        **{
            "model": "random:tiny",
            "prefill_policy": "fcfs",
            "block_size": 4,
            "num_kv_blocks": 256,
            **overrides,
        }
    )
    engine = Engine(cfg, sink)
    engine.start()
    return engine, sink


@pytest.fixture
def engine_and_sink():
    engine, sink = make_engine()
    yield engine, sink
    engine.shutdown(0)


def gen(rid: str, tokens: list[int], max_tokens: int = 8, **sp) -> Request:
    return Request(
        rid,
        RequestKind.GENERATE,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **sp}),
    )


def score(rid: str, tokens: list[int]) -> Request:
    return Request(rid, RequestKind.SCORE, tokens, label_token_ids=[10, 20, 30])


PROFILE = list(range(1000, 1030))  # 7 full blocks of 4 + 2


def test_scoring_leaves_only_cached_full_prefix_blocks(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    engine.add(score("cold", PROFILE + [5, 6, 7]))  # 33 tokens: 8 full blocks + 1
    sink.wait("cold")
    st = engine.stats()
    bm = engine.block_manager
    assert st["kv_blocks_used"] == 0  # nothing referenced after the answer
    assert len(bm.prefix_cache) == 8 == bm.prefix_cache.num_evictable
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()
    # A second item on the same profile hits the cache and gets the same probabilities as a
    # cold run of that item (a fresh engine).
    engine.add(score("warm", PROFILE + [5, 6, 9]))
    sink.wait("warm")
    assert sink.last("warm").num_cached_tokens == 32
    other, other_sink = make_engine()
    try:
        other.add(score("warm", PROFILE + [5, 6, 9]))
        other_sink.wait("warm")
    finally:
        other.shutdown(0)
    assert other_sink.last("warm").num_cached_tokens == 0
    assert sink.last("warm").label_probs == pytest.approx(
        other_sink.last("warm").label_probs, rel=1e-4, abs=1e-6
    )
    assert sum(sink.last("cold").label_probs) == pytest.approx(1.0, abs=1e-5)


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(engine_and_sink) -> None:
    """vLLM's `cache_salt`: a salted request finds nothing another salt (or none) cached,
    and finds what its own salt cached, with the same probabilities either way."""
    engine, sink = engine_and_sink
    prompt = PROFILE + [5, 6, 7]

    def run(rid: str, salt: str | None) -> tuple[int, list[float]]:
        req = score(rid, prompt)
        req.cache_salt = salt
        engine.add(req)
        sink.wait(rid)
        out = sink.last(rid)
        return out.num_cached_tokens, out.label_probs

    _, probs = run("plain", None)
    assert run("plain-again", None)[0] == 32
    assert run("salt-a", "tenant a")[0] == 0
    cached_a, probs_a = run("salt-a-again", "tenant a")
    assert cached_a == 32 and run("salt-b", "tenant b")[0] == 0
    assert probs_a == pytest.approx(probs, rel=1e-4, abs=1e-6)
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunking_prefix_hits_and_preemption_do_not_change_greedy_tokens(device: str) -> None:
    prompts = [PROFILE + [7, 8, 9], PROFILE[:13] + [1, 2], list(range(3000, 3021)), [42]]
    results = []
    for overrides in (
        {},  # roomy pool, big budget
        # chunked prompts, preemption, hybrid prefill over 5-token chunks
        {
            "prefill_token_budget": 8,
            "num_kv_blocks": 24,
            "max_num_seqs": 3,
            "prefill_chunk_tokens": 5,
        },
    ):
        # fp32 everywhere (also on CUDA) so that batch composition cannot flip a greedy pick.
        engine, sink = make_engine(
            device=device, dtype="float32", attention_backend="torch", **overrides
        )
        try:
            for i, p in enumerate(prompts):
                engine.add(gen(f"r{i}", p, max_tokens=24))
            sink.wait(*[f"r{i}" for i in range(len(prompts))])
            st = engine.stats()
            engine.block_manager.check_integrity()
        finally:
            engine.shutdown(0)
        results.append(([sink.tokens(f"r{i}") for i in range(len(prompts))], st))
    assert results[0][0] == results[1][0]
    assert all(len(t) == 24 for t in results[0][0])
    assert results[1][1]["num_preemptions"] > 0  # the small pool really preempted


def test_validation_failures_come_back_through_the_sink(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    vocab = engine.model_config.vocab_size
    bad = {
        "empty": gen("empty", []),
        "oov": gen("oov", [1, vocab]),
        "label": Request("label", RequestKind.SCORE, [1, 2], label_token_ids=[vocab + 5]),
        "long": gen("long", [1] * 10, max_tokens=engine.max_model_len),
    }
    for r in bad.values():
        engine.add(r)
    sink.wait(*bad)
    for rid in bad:
        out = sink.last(rid)
        assert out.finish_reason == "error" and out.error, rid
    assert str(vocab) in sink.last("oov").error
    assert str(engine.max_model_len) in sink.last("long").error
    engine.add(gen("fine", [1, 2, 3], max_tokens=2))  # and it keeps serving
    sink.wait("fine")
    assert len(sink.tokens("fine")) == 2


def test_step_failure_fails_only_that_step(engine_and_sink, monkeypatch) -> None:
    engine, sink = engine_and_sink
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def flaky(plan, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_launch(plan, **kw)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    engine.add(gen("victim", [5, 6, 7], max_tokens=3))
    sink.wait("victim")
    assert sink.last("victim").finish_reason == "error" and "boom" in sink.last("victim").error
    assert engine.is_alive()
    assert engine.fresh_stats()["kv_blocks_used"] == 0
    engine.add(gen("after", [5, 6, 7], max_tokens=3))
    sink.wait("after")
    assert sink.last("after").finish_reason == "length"


POISON = 4242  # a token id whose presence makes the (patched) runner raise


def test_poisoned_request_in_a_batch_fails_alone(monkeypatch) -> None:
    """A step with several requests raises: only the request at fault fails; its batch
    mates finish normally (the engine re-runs the step one request at a time)."""
    engine, sink = make_engine()
    try:
        real_launch = engine.runner.launch
        sizes: list[int] = []

        def poisoned(plan, **kw):
            sizes.append(len(plan.seqs))
            if any(POISON in s.request.prompt_token_ids for s in plan.seqs):
                raise RuntimeError("poisoned input")
            return real_launch(plan, **kw)

        monkeypatch.setattr(engine.runner, "launch", poisoned)
        with engine._lock:  # queue all three before the loop can pick one up alone
            for rid, toks in (("ok1", [1, 2, 3]), ("bad", [1, POISON, 3]), ("ok2", [7, 8])):
                engine._inbox.append(("add", gen(rid, toks, max_tokens=3)))
            engine._wakeup.notify()
        sink.wait("ok1", "bad", "ok2")
        assert max(sizes) >= 2, "the three requests were never batched: the test proves nothing"
        assert sink.last("bad").finish_reason == "error"
        assert "poisoned input" in sink.last("bad").error
        for rid in ("ok1", "ok2"):
            assert sink.last(rid).finish_reason == "length", sink.last(rid)
            assert len(sink.tokens(rid)) == 3
        assert engine.is_alive()
        engine.block_manager.check_integrity()
    finally:
        engine.shutdown(0)


def test_scoring_prompt_beyond_max_score_tokens_is_refused_with_the_maximum() -> None:
    engine, sink = make_engine(max_score_tokens=12)
    try:
        assert engine.max_score_tokens == 12
        engine.add(score("long", list(range(1, 14))))  # 13 tokens
        engine.add(score("fits", list(range(1, 13))))  # 12 tokens
        sink.wait("long", "fits")
        assert sink.last("long").finish_reason == "error"
        assert "at most 12" in sink.last("long").error
        assert sink.last("fits").label_probs is not None
    finally:
        engine.shutdown(0)


def test_sampling_never_draws_ids_the_tokenizer_cannot_decode(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    assert engine.runner.num_sampleable_tokens == min(
        engine.tokenizer.vocab_size, engine.model_config.vocab_size
    )
    engine.runner.num_sampleable_tokens = 100  # as if the tokenizer knew only 100 ids
    engine.add(gen("r", [5, 6, 7], max_tokens=24, temperature=1.0, seed=3))
    sink.wait("r")
    toks = sink.tokens("r")
    assert len(toks) == 24 and max(toks) < 100, toks


def test_reset_prefix_cache_drops_idle_blocks(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    engine.add(score("s", PROFILE))
    sink.wait("s")
    assert engine.block_manager.prefix_cache is not None
    assert len(engine.block_manager.prefix_cache) > 0
    engine.reset_prefix_cache()
    engine.add(gen("sync", [9], max_tokens=1))  # a later step: the reset has been applied
    sink.wait("sync")
    assert engine.fresh_stats()["prefix_cached_blocks"] == 0
    engine.block_manager.check_integrity()


def test_abort_running_request_frees_kv(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    engine.add(gen("long", [1, 2, 3], max_tokens=1000))
    with sink._cv:
        assert sink._cv.wait_for(lambda: len(sink.outs.get("long", [])) >= 3, timeout=60)
    engine.abort("long")
    sink.wait("long")
    assert sink.last("long").finish_reason == "abort"
    engine.add(gen("sync", [9], max_tokens=1))  # a later step: the abort has been applied
    sink.wait("sync")
    assert engine.fresh_stats()["kv_blocks_used"] == 0
    engine.block_manager.check_integrity()


def test_seeded_sampling_repeats(engine_and_sink) -> None:
    engine, sink = engine_and_sink
    sp = {"temperature": 1.0, "seed": 1234}
    engine.add(gen("a", [3, 4, 5], max_tokens=12, **sp))
    engine.add(gen("noise", [8, 9], max_tokens=12, temperature=1.0))
    sink.wait("a", "noise")
    engine.add(gen("b", [3, 4, 5], max_tokens=12, **sp))
    sink.wait("b")
    assert sink.tokens("a") == sink.tokens("b")


def test_shutdown_aborts_what_cannot_finish() -> None:
    engine, sink = make_engine()
    engine.add(gen("long", [1, 2, 3], max_tokens=1000))
    with sink._cv:
        assert sink._cv.wait_for(lambda: "long" in sink.outs, timeout=60)
    engine.shutdown(0.05)
    assert not engine.is_alive()
    assert sink.last("long").finish_reason == "abort"
    engine.add(gen("late", [1], max_tokens=1))
    assert sink.last("late").finished and sink.last("late").error


def test_measure_prefill_for_calibration() -> None:
    sink = Collector()
    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), sink)
    t = engine.measure_prefill(40, 100)  # context of 100 tokens = 25 blocks, new KV discarded
    assert t > 0
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    engine.start()
    with pytest.raises(RuntimeError):
        engine.measure_prefill(8, 0)
    engine.add(score("s", list(range(1, 30))))
    sink.wait("s")
    st = engine.stats()
    engine.shutdown(0)
    # The default policy ranks by the JCT model, so online refinement is fed.
    assert st["policy"] == EngineConfig().prefill_policy and st["jct_num_observed"] >= 1


def _greedy_with_components(device: str, prompts: list[list[int]], **overrides) -> list[list[int]]:
    """scheduler -> runner -> update by hand (no Engine thread, no tokenizer files), so it
    also runs on a GPU machine that has no converted model."""
    import torch

    from policies import make_policy
    from runtime.attention.torch_backend import TorchAttentionBackend
    from runtime.kv.block_manager import BlockManager
    from runtime.kv.kv_pool import KVPool
    from runtime.kv.prefix_cache import PrefixCache
    from runtime.model.loader import _materialise, init_random_weights
    from runtime.model.presets import get_preset
    from runtime.runner import ModelRunner
    from runtime.scheduler import Scheduler, StepCapacity

    cfg = EngineConfig(**{"block_size": 4, "num_kv_blocks": 256, **overrides})
    mc = get_preset("tiny")
    model = _materialise(mc, torch.float32, torch.device(device))
    init_random_weights(model, 0)
    n_blocks = cfg.num_kv_blocks or 0
    pool = KVPool.for_model(mc, n_blocks, cfg.block_size, torch.float32, device)
    bm = BlockManager(n_blocks, cfg.block_size, PrefixCache(cfg.block_size))
    sched = Scheduler(cfg, bm, make_policy("fcfs"), [])
    runner = ModelRunner(
        cfg, model, mc, pool, TorchAttentionBackend(pool), num_token_slots=sched.slots.num_slots
    )
    cap = StepCapacity(prefill_token_budget=cfg.prefill_token_budget)
    for i, p in enumerate(prompts):
        sched.add(gen(f"r{i}", p, max_tokens=20))
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not sched.has_work():
            break
        plan = sched.schedule(cap)
        for o in sched.update(plan, runner.run(plan)):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        bm.check_integrity()
    assert bm.num_used_blocks == 0
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_components_give_the_same_tokens_with_chunks_and_preemption(device: str) -> None:
    prompts = [PROFILE + [7, 8, 9], PROFILE[:13] + [1, 2], list(range(3000, 3021)), [42]]
    roomy = _greedy_with_components(device, prompts)
    tight = _greedy_with_components(
        device,
        prompts,
        prefill_token_budget=8,
        num_kv_blocks=20,
        max_num_seqs=3,
        prefill_chunk_tokens=5,
    )
    assert roomy == tight and all(len(t) == 20 for t in roomy)


def test_cpu_engine_exposes_an_unavailable_partition_that_says_why() -> None:
    engine, _ = make_engine(partition="auto")  # requested, but there is no CUDA here
    try:
        st = engine.partition.state()
        assert not st.available and st.reason == "no CUDA device" and st.mode == "off"
        assert engine.split is None and engine.executor is engine.serial
        stats = engine.stats()
        assert stats["partition"] == "off" and stats["cost_model_mape"] is None
        with pytest.raises(ValueError):
            engine.partition.set_mode("static:64")
    finally:
        engine.shutdown(0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapped_scheduling_gives_the_same_greedy_tokens(device: str) -> None:
    """Overlap on and off: the same greedy tokens for chat with chunked prefill, prefix hits,
    preemption, EOS stops (surplus tokens dropped), scoring next to decodes (chunked), and
    an abort; and every block back at the end."""
    prompts = [PROFILE + [7, 8, 9], PROFILE[:13] + [1, 2], list(range(3000, 3021)), [42]]
    # A stop token the "stop" request really produces (its 5th token when nothing stops it):
    # under overlap the host learns it one step late and the step after it is surplus.
    engine, sink = make_engine(device=device, dtype="float32", attention_backend="torch")
    try:
        engine.add(gen("free", PROFILE, max_tokens=8))
        sink.wait("free")
    finally:
        engine.shutdown(0)
    free = sink.tokens("free")
    stop_id = free[4]
    results = []
    for overlap in (False, True):
        engine, sink = make_engine(
            device=device,
            dtype="float32",
            attention_backend="torch",
            overlap_scheduling=overlap,
            prefill_token_budget=8,
            num_kv_blocks=32,
            max_num_seqs=3,
        )
        try:
            for i, p in enumerate(prompts):
                engine.add(gen(f"r{i}", p, max_tokens=16))
            engine.add(gen("stop", PROFILE, max_tokens=16, stop_token_ids=[stop_id]))
            engine.add(score("s", PROFILE + list(range(500, 530))))
            engine.add(gen("gone", list(range(900, 940)), max_tokens=50))
            engine.abort("gone")
            sink.wait("r0", "r1", "r2", "r3", "stop", "s", "gone")
            engine.block_manager.check_integrity()
            st = engine.fresh_stats()
        finally:
            engine.shutdown(0)
        assert st["kv_blocks_used"] == 0
        assert sink.last("stop").finish_reason == "stop"
        assert sink.tokens("stop") == free[: free.index(stop_id) + 1]  # nothing after it
        results.append(
            (
                [sink.tokens(f"r{i}") for i in range(len(prompts))],
                sink.last("s").label_probs,
                sink.last("gone").finish_reason,
            )
        )
    (tok_off, probs_off, gone_off), *overlapped = results
    assert all(len(t) == 16 for t in tok_off)
    for tok_on, probs_on, gone_on in overlapped:
        assert tok_on == tok_off
        assert probs_on == pytest.approx(probs_off, rel=1e-5, abs=1e-7)
        assert gone_on == gone_off == "abort"


def test_tbt_target_reaches_the_scheduler_with_the_decode_step_time(monkeypatch) -> None:
    """--tbt-slo-ms: every step's capacity carries the target, the JCT model as the prefill
    cost and the running average of decode-only steps (non-zero once decodes ran)."""
    engine, sink = make_engine(tbt_slo_ms=50.0)
    seen = []
    schedule = engine.scheduler.schedule

    def recording(capacity):
        seen.append(capacity)
        return schedule(capacity)

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    try:
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add(Request("r", RequestKind.GENERATE, list(range(5, 25)), sp))
        sink.wait("r")
    finally:
        engine.shutdown()
    # A new server aims below the target by the tail factor's bound until it has read a tail.
    from runtime.partition.corrections import TailFactor

    aim = 0.05 / TailFactor.MAX_FACTOR
    assert seen and all(
        c.tbt_s == pytest.approx(aim) and c.prefill_cost.cost is engine.jct_model for c in seen
    )
    assert seen[-1].decode_step_s > 0.0


def test_tbt_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tbt_slo_ms"):
        EngineConfig(tbt_slo_ms=0.0)


def test_prefill_limits_change_at_run_time_and_never_above_the_sized_budget() -> None:
    engine, sink = make_engine(prefill_token_budget=2048)
    try:
        with pytest.raises(ValueError, match="reserved activation memory for 2048"):
            engine.set_prefill_limits(4096, None, None, None)
        with pytest.raises(ValueError, match="tbt_slo_ms"):
            engine.set_prefill_limits(1024, 0.0, None, None)
        with pytest.raises(ValueError, match="mixed_step_token_budget"):
            engine.set_prefill_limits(1024, None, 0, None)
        for share in (0.0, 1.0, float("nan")):
            with pytest.raises(ValueError, match="chunk_fixed_share"):
                engine.set_prefill_limits(1024, None, None, share)
        engine.set_prefill_limits(512, 40.0, 256, 0.2)
        assert engine.stats()["prefill_token_budget"] == 512  # shown at once (pending)
        assert engine.stats()["mixed_step_token_budget"] == 256
        assert engine.stats()["chunk_fixed_share"] == 0.2
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        engine.add(Request("r", RequestKind.GENERATE, list(range(5, 25)), sp))
        sink.wait("r")  # the engine thread has applied its inbox
        assert engine.serial.prefill_token_budget == 512 and engine.pacer.tbt_s == 0.04
        assert engine.serial.mixed_step_token_budget == 256
        assert engine.pacer.chunk_fixed_share == 0.2  # what auto's step cap reads
        stats = engine.fresh_stats()
        assert stats["prefill_token_budget"] == 512 and stats["tbt_slo_ms"] == 40.0
        assert stats["mixed_step_token_budget"] == 256 and stats["chunk_fixed_share"] == 0.2
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "overrides,beside",
    [
        ({}, "beside decodes the same"),  # auto on the CPU: no cap
        ({"mixed_step_token_budget": "512"}, "beside decodes at most 512"),
        ({"tbt_slo_ms": 50.0}, "beside decodes cut to a 50 ms TBT target"),
        (
            {"tbt_slo_ms": 50.0, "mixed_step_token_budget": "512"},
            "beside decodes at most 512 (--mixed-step-token-budget 512), cut to a 50 ms TBT",
        ),
        (
            {"mixed_step_token_budget": "512", "chunk_fixed_share": 0.15},
            "beside decodes at most 512 (--mixed-step-token-budget 512) (auto's chunks more, "
            "until the step's fixed part is at most 0.15 of it)",
        ),
    ],
)
def test_start_up_log_says_how_much_prefill_a_step_takes(
    overrides: dict, beside: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="greenlane.engine"):
        engine, _ = make_engine(prefill_token_budget=1024, **overrides)
    try:
        line = next(r.getMessage() for r in caplog.records if "prefill per step" in r.getMessage())
        assert line.startswith("prefill per step: 1024 tokens; " + beside), line
    finally:
        engine.shutdown()


def test_tbt_cut_learns_how_wrong_the_jct_model_is_in_mixed_steps() -> None:
    """A JCT model that predicts ~nothing (coefficients far too small for this CPU): steps that
    mix prefill chunks with a decode measure much more, and the correction (fixed cost and
    scale, bounded) grows to what they measure, so the TBT cut shrinks the chunks."""
    # Chunks of 256 tokens and a decode base from a dozen decode-only steps: on a loaded 2-core
    # CPU, 64-token chunks after a base of 3 steps measured no dearer than the decodes beside
    # them (1 failure in 5 with both cores busy elsewhere; once in CI), and the fit rightly
    # found no offset. A 900-token prompt (4 mixed steps, ~9 ms each beyond the decode base)
    # also once measured no dearer in CI: the base is an average of decode-only steps, and one
    # stalled step lifts it by a tenth of the stall. 2,000 tokens (8 mixed steps at growing
    # context, 17 ms beyond the base on an idle machine, 26-51 with both cores busy elsewhere)
    # failed so once more in CI, in the whole suite only (not reproduced alone, under load, with
    # a busy thread beside it, or with a 3 M-object heap). What stalls a step there is not
    # known; a full garbage collection over the suite's objects is one candidate (the engine
    # core freezes its start-up objects, runtime/diagnostics/gc_watch.py; this in-process engine
    # does not). So: the collector is off, and the base this test's correction is fitted against is
    # the median decode-only step, not their average (the base's estimator is not this test's).
    gc.collect()
    gc.disable()
    engine, sink = make_engine(tbt_slo_ms=50.0, prefill_token_budget=256, num_kv_blocks=1024)
    jct = engine.jct_model
    jct.a_s, jct.b_s_per_token, jct.k_s_per_pair = 1e-9, 1e-7, 0.0
    jct.refit_every = 10**9  # keep it wrong: this test is about the correction
    try:
        sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        engine.add(Request("chat", RequestKind.GENERATE, list(range(5, 25)), sp))
        while engine.fresh_stats()["num_decode_steps"] < 24:
            time.sleep(0.01)
        decode_ms = sorted(
            st["device_ms"]
            for st in engine.step_trace()
            if st["num_decodes"] and not st["num_prefill_tokens"]
        )
        engine.pacer.decode_step_avg_s = decode_ms[len(decode_ms) // 2] / 1e3
        long_sp = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add(Request("long", RequestKind.GENERATE, list(range(30, 30 + 2000)), long_sp))
        sink.wait("long")
        stats = engine.fresh_stats()
        cost = engine.pacer.prefill_cost
        # What the correction now predicts for a 64-token chunk next to the decode
        predicted_extra_s = cost.offset_s + cost.marginal_s(63, 500)
        trace = engine.step_trace()
    finally:
        engine.abort("chat")
        engine.shutdown()
        gc.enable()
    # Bounded; which of the scales, the offset and the cost of the prefill parts' cached
    # tokens carries the difference is not this test's: its JCT model predicts ~nothing, so
    # the scales are timing noise (below 1 when the context term takes the chunks' growing
    # context).
    for key in ("tbt_cost_token_scale", "tbt_cost_pair_scale"):
        assert CorrectedCost.MIN_SCALE <= stats[key] <= CorrectedCost.MAX_SCALE
    bound_ms_per_1k = CorrectedCost.MAX_CONTEXT_S_PER_TOKEN * 1e6
    assert -bound_ms_per_1k <= stats["tbt_cost_context_ms_per_1k"] <= bound_ms_per_1k
    # Every mixed step is counted and its measured / predicted time kept (the tail is what a
    # P99 target is judged by); quantiles are ordered.
    assert stats["num_mixed_steps"] > 0
    assert 0 <= stats["num_mixed_steps_over_tbt"] <= stats["num_mixed_steps"]
    p50, p90, p99 = (stats[f"mixed_step_ratio_p{q}"] for q in (50, 90, 99))
    assert 0.0 < p50 <= p90 <= p99
    assert 0.0 < stats["tbt_cost_offset_ms"] <= 250.0
    assert 1.0 <= stats["tbt_tail_factor"] <= 1.5  # the cut's aim: target / this
    # The step trace has the mixed steps with what the cut predicted for them.
    mixed = [st for st in trace if st["num_decodes"] and st["num_prefill_tokens"]]
    assert len(mixed) >= 1 and all(st["predicted_ms"] > 0.0 for st in mixed)
    assert all(st["device_ms"] >= 0.0 for st in trace)
    # The JCT model alone predicts ~6 us for such a chunk; the corrected cost is of the order a
    # CPU step measures (milliseconds), so the chunk cut follows the device, not the model.
    assert predicted_extra_s > 100 * jct.marginal_s(63, 500)


def test_mixed_steps_are_judged_against_the_running_executors_cut_only() -> None:
    """The target a mixed step is counted against (and teaches the tail factor with): the
    serial executor's --tbt-slo-ms, or auto's target on the split executor; an `off` side
    with only a fixed budget has none, even when auto's target is configured."""
    from types import SimpleNamespace

    engine, _ = make_engine(prefill_token_budget=64, num_kv_blocks=64)
    pacer = engine.pacer

    def cut_target_s() -> float | None:  # as the engine asks when it observes a step
        return pacer.cut_target_s(engine.executor is engine.serial)

    try:
        assert engine.executor is engine.serial
        assert cut_target_s() is None
        pacer.tbt_s = 0.05
        assert cut_target_s() == 0.05
        pacer.tbt_s = None
        controller = SimpleNamespace(config=SimpleNamespace(tbt_slo_ms=80.0))
        pacer.green = SimpleNamespace(mode="off", controller=controller)
        assert cut_target_s() is None  # serial, no --tbt-slo-ms: no cut
        engine.executor = SimpleNamespace(name="split")  # the split executor is running
        assert cut_target_s() is None  # mode off: no cut there either
        pacer.green.mode = "auto"
        pacer.tbt_tail.factor = 1.25
        assert cut_target_s() == pytest.approx(0.080)  # the target, not the aim
        assert pacer.chunk_tbt_ms() == pytest.approx(80.0 / 1.25)
    finally:
        engine.executor, pacer.green = engine.serial, None
        engine.shutdown()


def test_uncalibrated_jct_model_is_derived_for_this_model_on_cuda() -> None:
    """Without a calibration a CUDA engine's JCT model is the first-principles fallback for the
    served model's shape, not the 8B default (an uncalibrated 3B server priced its prefill as
    an 8B one); on the CPU it stays the 8B default (no GPU derivation fits a CPU)."""
    import torch

    from policies.jct import DEFAULT_B_S_PER_TOKEN, JCTModel
    from runtime.engine import _fallback_jct_model
    from runtime.model.presets import get_preset

    cfg = get_preset("qwen2.5-3b")
    jct = _fallback_jct_model(cfg, "random:qwen2.5-3b", torch.bfloat16, "cuda")
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    expected = JCTModel.for_shape(
        non_embedding_params=cfg.num_params - embeddings,
        num_layers=cfg.num_layers,
        attention_width=cfg.q_size,
        weight_bytes=cfg.num_params * 2,
        model="random:qwen2.5-3b",
    )
    assert jct.source == "fallback-shape" and not jct.calibrated
    assert jct.coefficients == pytest.approx(expected.coefficients)
    assert jct.b_s_per_token < 0.5 * DEFAULT_B_S_PER_TOKEN
    cpu = _fallback_jct_model(cfg, "random:qwen2.5-3b", torch.float32, "cpu")
    assert cpu.source == "fallback-default" and cpu.coefficients == JCTModel().coefficients
    engine = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), Collector())
    try:
        assert engine.stats()["jct_source"] == "fallback-default"  # this CPU engine
    finally:
        engine.shutdown(0)


def test_quantiles_nearest_rank() -> None:
    from collections import deque

    from runtime.engine import _quantiles

    assert _quantiles("x", deque(), (50, 99)) == {"x_p50": None, "x_p99": None}
    values = deque(float(v) for v in range(100, 0, -1))  # 1..100, unsorted
    q = _quantiles("x", values, (50, 90, 99))
    assert q == {"x_p50": 51.0, "x_p90": 91.0, "x_p99": 100.0}


def test_srjf_takes_its_offset_from_ttft_slo_ms() -> None:
    """--ttft-slo-ms reaches SRJF: its offset then follows the SLO and the arrivals' cold JCT
    (policies/srjf.py); without it the fixed offset stays."""
    sink = Collector()
    cfg = EngineConfig(
        model="random:tiny",
        prefill_policy="srjf",
        block_size=4,
        num_kv_blocks=256,
        ttft_slo_ms=2000.0,
    )
    engine = Engine(cfg, sink)
    for rid, n in (("a", 40), ("b", 60)):  # queued before the loop starts: ranked together
        engine.add(Request(rid, RequestKind.SCORE, list(range(5, 5 + n)), label_token_ids=[3, 4]))
    engine.start()
    try:
        sink.wait("a", "b")
        policy = engine.policy
        assert policy.latency_slo_s == 2.0 and policy.cold_jct_s is not None
        cold = policy.cold_jct_s
        assert policy.fairness_lambda == pytest.approx(cold / max(2.0 - cold, 0.1))
        deadline = time.monotonic() + 10  # stats are published at a fixed rate
        while engine.stats().get("fairness_lambda") != policy.fairness_lambda:
            assert time.monotonic() < deadline, engine.stats().get("fairness_lambda")
            time.sleep(0.05)
        assert engine.stats()["ttft_slo_ms"] == 2000.0
    finally:
        engine.shutdown(0)
    plain, _ = make_engine(prefill_policy="srjf")
    try:
        assert plain.policy.latency_slo_s is None and plain.policy.fairness_lambda == 0.1
    finally:
        plain.shutdown(0)


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    """A stop token the greedy output would hit at its second token: without min_tokens the
    request stops there; with min_tokens=6 it cannot be sampled before the sixth token, and
    the request runs on (vLLM / SGLang semantics; EOS is a stop token too unless ignore_eos)."""
    engine, sink = make_engine()
    try:
        prompt = [11, 22, 33, 44]
        engine.add(gen("free", prompt, max_tokens=8))
        sink.wait("free")
        free = sink.tokens("free")
        stop = free[1]
        engine.add(gen("stops", prompt, max_tokens=8, stop_token_ids=[stop]))
        engine.add(gen("held", prompt, max_tokens=8, stop_token_ids=[stop], min_tokens=6))
        sink.wait("stops", "held")
        assert sink.tokens("stops") == free[:2] and sink.last("stops").finish_reason == "stop"
        held = sink.tokens("held")
        assert len(held) >= 6 and stop not in held[:6]
        assert held[0] == free[0]  # the first token was not the stop token anyway
        engine.add(gen("bad", prompt, max_tokens=2, min_tokens=3))
        sink.wait("bad")
        assert "min_tokens" in (sink.last("bad").error or "")
    finally:
        engine.shutdown(0)


def test_one_stalled_decode_step_barely_moves_the_fallback_decode_base() -> None:
    """The fallback decode base (no calibrated cost model) is an EWMA of decode-only steps.
    One 500-ms stall among 10-ms steps lifted it to ~59 ms; a step enters at most twice the
    average now, so it reads 11 ms, while a real change (10 -> 30 ms steps) is still
    followed within a few dozen steps."""
    from runtime.partition.pacing import decode_avg_s

    avg = 0.0
    for _ in range(20):
        avg = decode_avg_s(avg, 0.010)
    assert avg == pytest.approx(0.010)
    assert decode_avg_s(avg, 0.500) == pytest.approx(0.011)
    assert decode_avg_s(avg, 0.015) == pytest.approx(0.0105)  # within 2x: as an EWMA
    for _ in range(40):
        avg = decode_avg_s(avg, 0.030)
    assert 0.029 < avg <= 0.030
