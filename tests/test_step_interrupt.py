"""A prefill step under way stops between layers when every request in it is aborted (a client
gone) or shutdown's grace is over, instead of running to its end; nothing is left behind: the
KV returns to the pool and later requests give the same tokens. A step that also carries a
request nobody aborted runs to its end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from runtime.model.llama import LlamaForCausalLM
from tests.test_engine import gen, make_engine, score

LONG = 48  # prompt tokens that mark "the long prompt" in the spied layers


class LayerSpy:
    """Wraps each layer's forward: records (layer, rows) of every call, and lets a test hold
    layer 0 of the long prompt until something happened (`hold_until`) or for `delay_s`."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.calls: list[tuple[int, int]] = []
        self.started = threading.Event()
        self.hold_until: Callable[[], bool] | None = None
        self.delay_s = 0.0
        for i, layer in enumerate(model.layers):
            layer.forward = self._wrap(i, layer.forward)  # type: ignore[method-assign]

    def _wrap(self, i: int, forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]):  # type: ignore[no-untyped-def]
        def spied(h, *args, **kwargs):  # type: ignore[no-untyped-def]
            rows = int(h.shape[0])
            self.calls.append((i, rows))
            if rows >= LONG:
                self.started.set()
                hold = self.hold_until
                if i == 0 and hold is not None:
                    deadline = time.monotonic() + 10
                    while not hold() and time.monotonic() < deadline:
                        time.sleep(0.005)
                time.sleep(self.delay_s)
            return forward(h, *args, **kwargs)

        return spied

    def long_layers(self) -> list[int]:
        return [i for i, rows in self.calls if rows >= LONG]


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 4000, (n,), generator=g).tolist()


def test_aborting_the_only_request_stops_its_prefill_before_the_next_layer() -> None:
    engine, sink = make_engine()
    try:
        spy = LayerSpy(engine.runner.model)
        spy.hold_until = lambda: "long" in engine._aborting  # the abort reached the engine
        engine.add(gen("long", prompt(1, 200), max_tokens=4))
        assert spy.started.wait(30)
        live = engine.live_stats()  # held in layer 0 of the long prompt: where it is
        assert live["step_layer"] == 0 and live["step_num_layers"] == 2
        assert live["step_prefill_tokens"] == 200 and live["step_running_s"] >= 0.0
        engine.abort("long")
        sink.wait("long", timeout=30)
        assert sink.last("long").finish_reason == "abort"
        assert spy.long_layers() == [0]  # layer 1 never ran
        assert engine.fresh_stats()["num_interrupted_steps"] == 1
        assert engine.live_stats()["step_layer"] is None  # no forward under way
        # Nothing left behind: every block back, and the same greedy tokens as before.
        engine.add(gen("after", prompt(2, 60), max_tokens=6))
        sink.wait("after")
        assert engine.fresh_stats()["kv_blocks_used"] == 0
        engine.block_manager.check_integrity()
    finally:
        engine.shutdown(0)
    fresh, fresh_sink = make_engine()
    try:
        fresh.add(gen("after", prompt(2, 60), max_tokens=6))
        fresh_sink.wait("after")
        assert sink.tokens("after") == fresh_sink.tokens("after")
    finally:
        fresh.shutdown(0)


def test_a_step_with_a_request_nobody_aborted_runs_to_its_end() -> None:
    engine, sink = make_engine(prefill_token_budget=512)
    try:
        spy = LayerSpy(engine.runner.model)
        spy.hold_until = lambda: "a" in engine._aborting
        # One prefill step holds both prompts (the scheduler takes both within the budget).
        engine.add_many([gen("a", prompt(3, 100), max_tokens=4), score("b", prompt(4, 100))])
        assert spy.started.wait(30)
        engine.abort("a")
        sink.wait("a", "b", timeout=30)
        assert sink.last("a").finish_reason == "abort"
        assert sink.last("b").finish_reason == "stop" and sink.last("b").label_probs
        assert spy.long_layers()[:2] == [0, 1]
        assert engine.fresh_stats()["num_interrupted_steps"] == 0
    finally:
        engine.shutdown(0)


def test_shutdown_stops_a_long_prefill_when_its_grace_is_over() -> None:
    engine, sink = make_engine()
    spy = LayerSpy(engine.runner.model)
    spy.delay_s = 1.0  # each layer of the long prompt: the step takes > 2 s
    engine.add(gen("long", prompt(5, 200), max_tokens=4))
    assert spy.started.wait(30)
    t0 = time.monotonic()
    engine.shutdown(0.1)
    took_s = time.monotonic() - t0
    assert sink.last("long").finish_reason == "abort"
    assert spy.long_layers() == [0]
    assert took_s < 1.6  # what is left of layer 0 (< 1 s), not of the whole step (> 1 s more)
