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
    HermesStream,
    finish_reason,
    parse_hermes,
    parse_llama3_json,
    parse_tool_calls,
    tool_calls_of,
    tool_choice_error,
    tool_mode,
    tool_parser,
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


# ---- tool_choice "auto" with the hermes parser

NAMES = {"get_weather", "get_time"}
TWO_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>"
)


def test_hermes_reads_calls_and_leaves_anything_else_as_content() -> None:
    content, calls = parse_hermes(TWO_CALLS, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert parse_hermes("just text", NAMES) == ("just text", [])
    for broken in (
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>',  # not a declared tool
        '<tool_call>{"name": "get_time", "arguments": {}',  # cut before its end
        "<tool_call>not json</tool_call>",
    ):
        assert parse_hermes(broken, NAMES) == (broken, []), broken
    # arguments written as a JSON string are read as the object they spell
    _, (call,) = parse_hermes(
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', NAMES
    )
    assert json.loads(call["function"]["arguments"]) == {"tz": "UTC"}


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_stream_sends_what_the_whole_parse_reads(step: int) -> None:
    """Fed in pieces of any size, the stream lets the same content through (held while it
    could open a call) and the same calls, each once, when it closes."""
    for text in (TWO_CALLS, "a < b and <tool_cal is no tag", "<tool_call>oops</tool_call> x"):
        stream = HermesStream(NAMES)
        content, calls = "", []
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for j, piece in enumerate(pieces):
            c, k = stream.feed(piece, final=j == len(pieces) - 1)
            assert "<tool_call" not in c or "oops" in text  # never half a tag, never a call
            content += c
            calls += k
        whole_content, whole_calls = parse_hermes(text, NAMES)
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
        expected = (whole_content or "") if whole_calls else text

        def bare(t: str) -> str:
            return t.replace("\n", "").strip()

        assert bare(content) == bare(expected)


# ---- tool_choice "auto" with the llama3_json parser


def test_llama3_json_reads_whole_answers_that_are_calls() -> None:
    one = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    assert parse_tool_calls("llama3_json", one, NAMES)[0] is None
    (call,) = parse_tool_calls("llama3_json", one, NAMES)[1]
    assert call["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}
    two = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "A", "unit": "f"}}'
    content, calls = parse_llama3_json(two, NAMES)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    for text in ("The time is noon.", '{"name": "other", "parameters": {}}', '{"name": "get_ti'):
        assert parse_llama3_json(text, NAMES) == (text, []), text


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_llama3_json_stream_holds_a_call_and_streams_prose(step: int) -> None:
    def run(text: str) -> tuple[list[str], list[dict]]:
        stream = tool_parser("llama3_json", NAMES)
        sent, calls = [], []
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for j, piece in enumerate(pieces):
            c, k = stream.feed(piece, final=j == len(pieces) - 1)
            sent.append(c)
            calls += k
        return sent, calls

    sent, calls = run(' {"name": "get_time", "parameters": {}}')
    assert "".join(sent) == "" and [c["function"]["name"] for c in calls] == ["get_time"]
    prose = "It is noon in Oslo."
    sent, calls = run(prose)
    assert "".join(sent) == prose and not calls
    if step < len(prose):
        assert sent[0] == prose[:step]  # prose goes out as it comes, not at the end
    sent, calls = run('{"not": "a call"}')
    assert "".join(sent) == '{"not": "a call"}' and not calls  # held, then sent as content
