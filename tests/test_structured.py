"""Structured outputs (`response_format`): the grammar compiled from the API's shapes, and the
engine sampling only what keeps it valid on a random model, whose unconstrained output is
never JSON. CPU, tiny random model with the default model's tokenizer."""

from __future__ import annotations

import json
import time

import pytest
from test_engine import Collector, make_engine

from runtime.request import Request, RequestKind, SamplingParams
from runtime.sampling.structured import (
    GrammarError,
    compile_response_format,
    compile_structured_outputs,
)

# Small enough that a random model finishes it well inside max_tokens: the grammar leaves it
# one choice of label and one digit.
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "n"],
    "additionalProperties": False,
}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_response_formats_compile_and_bad_schemas_say_why() -> None:
    assert compile_response_format({"type": "text"}) is None
    assert compile_response_format({"type": "json_object"})
    assert compile_response_format(_json_schema(SCHEMA))
    with pytest.raises(GrammarError, match="nonsense"):
        compile_response_format(_json_schema({"type": "nonsense"}))
    with pytest.raises(GrammarError, match="does not exist"):
        compile_response_format(_json_schema({"properties": {"a": {"$ref": "#/defs/x"}}}))
    with pytest.raises(GrammarError, match="not supported"):
        compile_response_format({"type": "yaml"})
    with pytest.raises(GrammarError, match="json_schema"):
        compile_response_format({"type": "json_schema"})


def test_vllm_structured_outputs_compile_one_kind_and_say_what_is_wrong() -> None:
    for spec in (
        {"json": SCHEMA},
        {"json": json.dumps(SCHEMA)},
        {"regex": "[0-9]{3}-[a-z]+"},
        {"choice": ["positive", "negative", 'odd "one" (x)']},
        {"grammar": 'start: "yes" | "no"'},  # Lark
        {"grammar": 'root ::= "yes" | "no"'},  # GBNF
        {"json_object": True},
    ):
        assert compile_structured_outputs(spec), spec
    for spec, says in (
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "not JSON"),
        ({"json": [1]}, "schema object"),
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"regex": "[a-"}, "unclosed"),
        ({"choice": []}, "non-empty"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"grammar": "start: foo"}, "unknown name"),
        ({"grammar": "root ::= ( "}, "Expected"),
        ({"json_object": "yes"}, "must be true"),
        # Passes llguidance's validation, but nothing can start it: used to end the request
        # at once with empty text and "stop".
        ({"json": {"$ref": "#"}}, "allows no output"),
    ):
        with pytest.raises(GrammarError, match=says):
            compile_structured_outputs(spec)


def _gen(rid: str, max_tokens: int, grammar: str | None, **sp) -> Request:
    return Request(
        rid,
        RequestKind.GENERATE,
        [11, 22, 33, 44, 55],
        SamplingParams(max_tokens=max_tokens, grammar=grammar, **{"temperature": 1.0, **sp}),
    )


def _text(engine, sink: Collector, rid: str) -> str:
    return engine.tokenizer.decode(sink.tokens(rid), skip_special_tokens=True)


def test_every_sample_keeps_the_grammar_and_ends_with_eos() -> None:
    """Four constrained requests (two seeded alike) beside an unconstrained one that keeps the
    overlapped loop busy: each output parses and matches the schema, ends because the model
    sampled EOS where the grammar had to end, and seeds still reproduce. The unconstrained
    request's text is not JSON (what the mask changes), and its tokens are the same as alone."""
    engine, sink = make_engine()
    try:
        grammar = compile_response_format(_json_schema(SCHEMA))
        engine.add(_gen("alone", 40, None, seed=7, ignore_eos=True))
        sink.wait("alone")
        engine.add(_gen("free", 40, None, seed=7, ignore_eos=True))
        for i in range(4):
            engine.add(_gen(f"json{i}", 40, grammar, seed=100 + i % 2))
        sink.wait("free", *(f"json{i}" for i in range(4)))
        texts = [_text(engine, sink, f"json{i}") for i in range(4)]
        for i, text in enumerate(texts):
            value = json.loads(text)
            assert set(value) == {"label", "n"} and value["label"] in ("yes", "no")
            assert isinstance(value["n"], int) and 0 <= value["n"] <= 9
            last = sink.last(f"json{i}")
            assert last.finish_reason == "stop", (text, last)
            assert sink.tokens(f"json{i}")[-1] in engine.model_config.eos_token_ids
        assert texts[0] == texts[2] and texts[1] == texts[3]  # same seed, same sample
        assert sink.tokens("free") == sink.tokens("alone")
        with pytest.raises(ValueError):
            json.loads(_text(engine, sink, "free"))
        assert len(engine.runner.grammars) == 0  # every matcher released with its request
    finally:
        engine.shutdown(0)


def test_json_object_and_a_grammar_cut_by_max_tokens() -> None:
    """`json_object` under greedy sampling starts with "{"; cut by max_tokens the request
    ends with "length", its text a prefix of valid JSON."""
    engine, sink = make_engine()
    try:
        grammar = compile_response_format({"type": "json_object"})
        engine.add(_gen("obj", 6, grammar, temperature=0.0))
        sink.wait("obj")
        text = _text(engine, sink, "obj")
        assert text.startswith("{")
        assert sink.last("obj").finish_reason in ("length", "stop")
        if sink.last("obj").finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    finally:
        engine.shutdown(0)


def test_a_choice_is_exactly_one_of_the_strings() -> None:
    """vLLM's `choice`, the labelling case: sampled outputs are each one of the choices."""
    choices = ["positive", "negative", "neutral (unsure)"]
    engine, sink = make_engine()
    try:
        grammar = compile_structured_outputs({"choice": choices})
        for i in range(6):
            engine.add(_gen(f"c{i}", 20, grammar, seed=i))
        sink.wait(*(f"c{i}" for i in range(6)))
        for i in range(6):
            assert _text(engine, sink, f"c{i}") in choices
            assert sink.last(f"c{i}").finish_reason == "stop"
    finally:
        engine.shutdown(0)


def test_the_matcher_is_built_where_requests_are_added_and_freed_however_they_end() -> None:
    """The grammar compiles in `add` (the caller's thread), before the engine thread has run
    a step; a request aborted while it waits frees its matcher as one that ran does."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    sink = Collector()
    engine = Engine(EngineConfig(model="random:tiny", max_num_seqs=1, block_size=4), sink)
    try:
        grammar = compile_response_format({"type": "json_object"})
        engine.add(_gen("first", 12, grammar))
        engine.add(_gen("second", 12, grammar))
        assert len(engine.runner.grammars) == 2  # both compiled; no step has run
        engine.abort("second")  # waits behind "first" (one sequence at a time)
        engine.start()
        sink.wait("first", "second")
        assert sink.last("second").finish_reason == "abort"
        deadline = time.monotonic() + 10
        while len(engine.runner.grammars) and time.monotonic() < deadline:
            time.sleep(0.01)  # released when the engine next applies a step's results
        assert len(engine.runner.grammars) == 0
    finally:
        engine.shutdown(0)


def test_a_grammar_with_ignore_eos_or_min_tokens_is_refused() -> None:
    engine, sink = make_engine()
    try:
        grammar = compile_response_format({"type": "json_object"})
        engine.add(_gen("eos", 8, grammar, ignore_eos=True))
        engine.add(_gen("min", 8, grammar, min_tokens=2))
        sink.wait("eos", "min")
        assert "ignore_eos" in (sink.last("eos").error or "")
        assert "min_tokens" in (sink.last("min").error or "")
    finally:
        engine.shutdown(0)


class _StepCollector(Collector):
    """Also numbers the engine's steps: which step each output came from."""

    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0
        self.steps_of: dict[str, list[int]] = {}

    def __call__(self, outs) -> None:  # noqa: ANN001 - one engine step's outputs
        self.num_steps += 1
        for o in outs:
            if o.new_token_ids:
                self.steps_of.setdefault(o.request_id, []).append(self.num_steps)
        super().__call__(outs)


def test_a_constrained_request_decodes_every_step_beside_others(monkeypatch, caplog) -> None:  # noqa: ANN001
    """Under overlapped scheduling a constrained request is planned while its last sample is
    in flight (the runner waits for that one token to fill its mask), so beside an
    unconstrained request it gets a token in every step, not every other one; its output
    still keeps the grammar. On CPU a launched step is done at once and would be collected
    before the next is planned: a step here reads as not ready until the engine blocks on
    it, as on CUDA, so the next step is planned with its tokens in flight."""
    from runtime import runner

    monkeypatch.setattr(runner.PendingOutput, "ready", lambda self: False)
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    sink = _StepCollector()
    cfg = EngineConfig(model="random:tiny", prefill_policy="fcfs", block_size=4, num_kv_blocks=256)
    assert cfg.overlap_scheduling
    engine = Engine(cfg, sink)
    engine.start()
    try:
        grammar = compile_structured_outputs({"regex": "[a-z]{40}"})
        engine.add(_gen("free", 200, None, seed=1, ignore_eos=True))
        engine.add(_gen("re", 60, grammar, seed=2))
        sink.wait("free", "re")
        text = _text(engine, sink, "re")
        assert len(text) == 40 and text.isalpha() and text.islower(), text
        steps = sink.steps_of["re"]
        assert len(steps) >= 8
        # every step between its first and last token gave it one (before: every other one)
        assert steps[-1] - steps[0] + 1 == len(steps), steps
        assert sink.steps_of["free"][-1] > steps[-1]  # the other one ran beside it throughout
        assert sink.last("re").finish_reason == "stop"
        # Its EOS was in flight when it was planned once more: that surplus sample's mask came
        # from a stopped matcher (EOS only, no error), and the scheduler dropped the token.
        assert sink.tokens("re")[-1] in engine.model_config.eos_token_ids
        assert "cannot continue" not in caplog.text
        assert len(engine.runner.grammars) == 0 and not engine.runner._grammar_pending
    finally:
        engine.shutdown(0)
