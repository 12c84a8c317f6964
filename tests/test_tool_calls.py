"""Tool calls forced by a grammar (app/tool_calls.py): which requests can be served, the
grammar a named function or "required" compiles to, and how a finished output becomes
OpenAI's `tool_calls`. The outputs through the server: tests/test_api_real.py."""

from __future__ import annotations

import json

import llguidance
import pytest

from app.tool_calls import (
    NAMED,
    REQUIRED,
    finish_reason,
    tool_calls_of,
    tool_choice_error,
    tool_mode,
)
from runtime.structured import GrammarError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_which_choices_can_be_served() -> None:
    tools = [WEATHER, TIME]
    assert tool_choice_error(None, None) is None
    assert tool_choice_error(None, "auto") is None  # nothing to choose from
    assert tool_choice_error(tools, "none") is None
    assert tool_choice_error(tools, "required") is None
    assert tool_choice_error(tools, NAMED_WEATHER) is None
    assert "parser" in (tool_choice_error(tools, None) or "")  # OpenAI's default is auto
    assert "parser" in (tool_choice_error(tools, "auto") or "")
    assert "no tools" in (tool_choice_error(None, "required") or "")
    other = {"type": "function", "function": {"name": "nope"}}
    assert "not among" in (tool_choice_error(tools, other) or "")
    assert "repeated" in (tool_choice_error([TIME, TIME], "required") or "")


@pytest.fixture(scope="module")
def lltok(default_model_dir):  # noqa: ANN001, ANN201
    return llguidance.LLTokenizer((default_model_dir / "tokenizer.json").read_text())


def _accepts(tok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (SmolLM2's tokens of it)."""
    m = llguidance.LLMatcher(tok, grammar)
    return m.consume_tokens(tok.tokenize_bytes(text.encode())) and m.is_accepting()


def test_the_grammars_take_calls_and_refuse_anything_else(lltok) -> None:  # noqa: ANN001
    tools = [WEATHER, TIME]
    named = tool_mode(tools, NAMED_WEATHER, None)
    assert named is not None and named.kind == NAMED and named.name == "get_weather"
    assert _accepts(lltok, named.grammar, '{"city":"Oslo","unit":"c"}')
    assert not _accepts(lltok, named.grammar, '{"city":"Oslo"}')  # unit is required
    required = tool_mode(tools, "required", None)
    assert required is not None and required.kind == REQUIRED
    two = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"A","unit":"f"}}]'
    assert _accepts(lltok, required.grammar, two)
    assert not _accepts(lltok, required.grammar, "[]")  # at least one call
    assert not _accepts(lltok, required.grammar, '[{"name":"other","parameters":{}}]')
    single = tool_mode(tools, "required", False)  # parallel_tool_calls false: one call
    assert single is not None and not _accepts(lltok, single.grammar, two)
    assert tool_mode(tools, "none", None) is None and tool_mode(None, None, None) is None
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(GrammarError, match="tool parameters"):
        tool_mode([bad], "required", None)


def test_finished_outputs_become_tool_calls() -> None:
    named = tool_mode([WEATHER], NAMED_WEATHER, None)
    assert named is not None
    (call,) = tool_calls_of(named, '{"city":"Oslo","unit":"c"}') or []
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"c"}'}
    assert tool_calls_of(named, '{"city":"Os') is None  # cut by max_tokens: content instead
    required = tool_mode([WEATHER, TIME], "required", None)
    assert required is not None
    calls = tool_calls_of(
        required,
        '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Å","unit":"f"}}]',
    )
    assert calls is not None and [c["function"]["name"] for c in calls] == [
        "get_time",
        "get_weather",
    ]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Å", "unit": "f"}
    assert len({c["id"] for c in calls}) == 2
    # A forced named call ends "stop" (as OpenAI's); calls the model was asked to choose end
    # "tool_calls"; a cut output keeps "length".
    assert finish_reason(named, "stop") == "stop"
    assert finish_reason(required, "stop") == "tool_calls"
    assert finish_reason(required, "length") == "length"
