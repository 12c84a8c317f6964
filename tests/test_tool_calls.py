"""Tool calls forced by a grammar (app/tool_calls.py): which requests can be served, the
grammar a named function or "required" compiles to, and how a finished output becomes
OpenAI's `tool_calls`; for tool_choice "auto", the parsers of the models' own formats, whole
and streamed. The outputs through the server: tests/test_api_real.py (and, with the fake
engine, the mistral and pythonic parsers here; hermes: tests/test_api_dropin.py)."""

from __future__ import annotations

import json
import typing
import warnings
from pathlib import Path

import httpx
import llguidance
import openai
import pytest
from pydantic import ValidationError
from server_thread import fake_server

from app.cli import build_parser
from app.settings import Settings
from app.tool_calls import (
    NAMED,
    REQUIRED,
    TOOL_CALL_PARSERS,
    HermesStream,
    finish_reason,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_pythonic,
    parse_tool_calls,
    tool_calls_of,
    tool_choice_error,
    tool_mode,
    tool_parser,
)
from runtime.sampling.structured import GrammarError

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
    # a block that is no call beside one that is: the call stays a call (as streamed), the
    # other block and the prose stay content; blanks next to the call are not content
    content, (call,) = parse_hermes(
        'Hi.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        "<tool_call>nope</tool_call>  and after it, words  ",
        NAMES,
    )
    assert call["function"]["name"] == "get_time"
    assert content == "Hi.<tool_call>nope</tool_call>  and after it, words"
    for odd in (  # arguments that are no object; a lone surrogate no response could carry
        '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"tz": "\\ud800"}}</tool_call>',
    ):
        assert parse_hermes(odd, NAMES) == (odd, []), odd


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

        assert content == expected


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


# ---- tool_choice "auto" with the mistral parser

MISTRAL_TWO = (
    'Let me check.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "c"}}, {"name": "get_time", "arguments": {}}]'
)
# Mistral's v11+ tokenizers: `name[ARGS]{json}` behind each marker
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}'
)


def _names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


def test_mistral_reads_calls_after_the_marker_and_text_before_it_as_content() -> None:
    assert parse_mistral("The time is noon.", NAMES) == ("The time is noon.", [])
    one = '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    content, (call,) = parse_tool_calls("mistral", one, NAMES)
    assert content is None
    assert call["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    content, calls = parse_mistral(MISTRAL_TWO, NAMES)
    assert content == "Let me check." and _names(calls) == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    content, calls = parse_mistral("Sure. " + MISTRAL_V11 + "\n", NAMES)
    assert content == "Sure." and _names(calls) == ["get_weather", "get_time"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city":"Oslo","unit":"c"}', "{}"]
    # arguments written as a JSON string are read as the object they spell, in both forms
    for text in (
        '[TOOL_CALLS][{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
        '[TOOL_CALLS]get_time[ARGS]"{\\"tz\\": \\"UTC\\"}"',
    ):
        (call,) = parse_mistral(text, NAMES)[1]
        assert json.loads(call["function"]["arguments"]) == {"tz": "UTC"}, text
    # the marker inside an argument's text is that text, not a second call
    quoted = '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "a[TOOL_CALLS]b"}}]'
    (call,) = parse_mistral(quoted, NAMES)[1]
    assert json.loads(call["function"]["arguments"]) == {"tz": "a[TOOL_CALLS]b"}
    # several arrays, each behind its own marker
    again = '[TOOL_CALLS][{"name": "get_time"}] [TOOL_CALLS][{"name": "get_time"}]'
    assert _names(parse_mistral(again, NAMES)[1]) == ["get_time", "get_time"]


def test_mistral_leaves_anything_but_calls_of_declared_tools_as_content() -> None:
    for text in (
        '[TOOL_CALLS][{"name": "other", "arguments": {}}]',  # not a declared tool
        '[TOOL_CALLS]other[ARGS]{"a": 1}',
        # one unknown call makes the whole answer content, as hermes and llama3_json do
        MISTRAL_V11 + "[TOOL_CALLS]other[ARGS]{}",
        'Hi [TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "x"}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}',  # cut before its end
        '[TOOL_CALLS]get_time[ARGS]{"tz": ',
        "[TOOL_CALLS]not json",
        "[TOOL_CALLS]get_time{}",  # no [ARGS]
        '[TOOL_CALLS]get_time[ARGS]"not json"',
        "[TOOL_CALLS][]",  # no call
        "[TOOL_CALLS]",
        "[TOOL_CALLS][1, 2]",
        '[TOOL_CALLS][{"name": "get_time"}] and then some words',  # text after the calls
        '[TOOL_CALLS][{"name": "get_time"}][{"name": "get_time"}]',  # a second array, no marker
    ):
        assert parse_mistral(text, NAMES) == (text, []), text


# ---- tool_choice "auto" with the pythonic parser


def test_pythonic_reads_a_list_of_calls_with_literal_arguments() -> None:
    assert parse_pythonic("The time is noon.", NAMES) == ("The time is noon.", [])
    content, (call,) = parse_tool_calls("pythonic", '[get_time(tz="UTC")]', NAMES)
    assert content is None
    assert call["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}
    two = " [get_weather(city=\"Paris\", unit='c'), get_time()]\n"
    content, calls = parse_pythonic(two, NAMES)
    assert content is None and _names(calls) == ["get_weather", "get_time"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city":"Paris","unit":"c"}', "{}"]
    assert len({c["id"] for c in calls}) == 2
    tagged = '<|python_start|>[get_time(tz="UTC")]<|python_end|>'  # Llama 4
    assert _names(parse_pythonic(tagged, NAMES)[1]) == ["get_time"]
    assert _names(parse_pythonic('<|python_start|>[get_time(tz="UTC")]', NAMES)[1]) == ["get_time"]
    # every literal kind, as JSON: True / False / None are true / false / null
    text = (
        '[get_weather(s="Å\\n", i=-3, f=2.5, big=12345678901234567890, t=True, n=None, '
        'l=[1, [False, +0.5]], d={"k": {"j": None}, "e": []})]'
    )
    (call,) = parse_pythonic(text, NAMES)[1]
    assert call["function"]["arguments"] == (
        '{"s":"Å\\n","i":-3,"f":2.5,"big":12345678901234567890,"t":true,"n":null,'
        '"l":[1,[false,0.5]],"d":{"k":{"j":null},"e":[]}}'
    )
    # an invalid escape is read as Python reads it, whatever the warning filters say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (call,) = parse_pythonic('[get_time(tz="C:\\dir")]', NAMES)[1]
    assert json.loads(call["function"]["arguments"]) == {"tz": "C:\\dir"}


def test_pythonic_never_runs_the_text_and_leaves_non_calls_as_content(tmp_path: Path) -> None:
    touched = tmp_path / "touched"
    for text in (
        f'[get_time(tz=open("{touched}", "w").write("x"))]',  # a call inside: not a literal
        f'[get_time(tz=__import__("pathlib").Path("{touched}").touch())]',
        "[other(tz='UTC')]",  # not a declared tool
        "[get_time(), other()]",
        "[1, 2, 3]",  # a list, but of no calls
        "[]",
        '[get_time("UTC")]',  # positional arguments
        '[get_time(**{"tz": "UTC"})]',
        '[get_time(tz="a", tz="b")]',  # a repeated keyword (ast.parse lets it through)
        "[get_time(tz=utc)]",  # a name, not a literal
        "[get_time(tz=1 + 2)]",
        "[get_time(tz=(1, 2))]",  # tuples, sets, bytes, complex: no JSON for them
        "[get_time(tz={1, 2})]",
        '[get_time(tz=b"x")]',
        "[get_time(tz=1j)]",
        "[get_time(tz=-True)]",
        "[get_time(tz=1e999)]",  # inf
        '[get_time(tz=f"{1}")]',
        '[get_time(tz="\\ud800")]',  # a lone surrogate: no UTF-8 for it
        "[get_time(tz={1: 2})]",  # JSON keys are strings
        '[get_time(tz={**{"a": 1}})]',
        "[get_time(tz=[*x])]",
        "[os.get_time()]",  # a dotted callee
        '[get_time(tz="UTC")',  # cut before its end
        '[get_time(tz="UTC")] and more',
        '[get_time(tz="UTC")]; [get_time()]',
        "get_time()",  # not in a list
        "[get_time(tz=" + "[" * 5000 + "]" * 5000 + ")]",  # nested past the parser's limit
        "<|python_start|>hello",
    ):
        assert parse_pythonic(text, NAMES) == (text, []), text
    assert not touched.exists()


# ---- every parser: streamed in pieces of any size, what the whole parse reads

STREAM_CASES = {
    "hermes": [
        TWO_CALLS,
        "a < b and <tool_cal is no tag",
        "<tool_call>oops</tool_call> x",
        # a call, then a block that is none, then prose: the call stays a call
        'Hi.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        "<tool_call>nope</tool_call>  and after it, words  ",
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> then <tool_ca',
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name"',
        # arguments that are no object, or a lone surrogate no response could carry
        '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"tz": "\\ud800"}}</tool_call>',
    ],
    "llama3_json": [
        ' {"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
        "It is noon in Oslo.",
        '{"not": "a call"}',
        "<|python_tag|>nope",
    ],
    "mistral": [
        MISTRAL_TWO,
        MISTRAL_V11,
        "Sure thing. \n " + MISTRAL_V11 + " \n",
        "a [b] [TOOL_CA and [TOOL_CALL is no marker [",
        "Words then spaces   ",
        " \n[TOOL_CALLS]get_time[ARGS]{} trailing words",  # not calls: all of it is content
        'Hi [TOOL_CALLS][{"name": "other"}]',
        "[TOOL_CALLS][TOOL_CALLS]",
    ],
    "pythonic": [
        '[get_weather(city="Paris", unit="c"), get_time(tz="UTC")]',
        ' \n<|python_start|>[get_time(tz="UTC")]<|python_end|>\n',
        "It is noon in Oslo. [get_time()]",
        "[1, 2] is a list",
        '[get_time(tz=open("x"))]',
        "<|python_starts here, but no",
        "   ",
    ],
}


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_streams_send_exactly_what_the_whole_parse_reads(name: str) -> None:
    """Fed in pieces of every size, the stream's content put together is the whole parse's
    (none when it is None) and its calls are the same calls, each once: what could open a
    call is held until it is clear, never sent twice or lost."""
    for text in STREAM_CASES[name]:
        whole_content, whole_calls = parse_tool_calls(name, text, NAMES)
        for step in range(1, len(text) + 1):
            stream = tool_parser(name, NAMES)
            content, calls = "", []
            pieces = [text[i : i + step] for i in range(0, len(text), step)]
            for j, piece in enumerate(pieces):
                c, k = stream.feed(piece, final=j == len(pieces) - 1)
                content += c
                calls += k
            assert content == (whole_content or ""), (text, step)
            assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
            assert stream.num_calls == len(calls)


def test_mistral_stream_sends_prose_as_it_comes_and_holds_a_possible_marker() -> None:
    stream = tool_parser("mistral", NAMES)
    assert stream.feed("It is") == ("It is", [])
    assert stream.feed(" noon [TOOL") == (" noon", [])  # " [TOOL" may open the marker
    assert stream.feed("S] here") == (" [TOOLS] here", [])  # it did not
    assert stream.feed(" [TOOL_CALLS][") == ("", [])  # a call may follow: held to the end
    content, calls = stream.feed('{"name": "get_time"}]', final=True)
    assert content == "" and _names(calls) == ["get_time"]


def test_pythonic_stream_holds_an_answer_that_opens_like_a_list_and_streams_prose() -> None:
    prose = tool_parser("pythonic", NAMES)
    assert prose.feed(" It is") == (" It is", [])  # prose goes out as it comes
    assert prose.feed(" noon [f()]", final=True) == (" noon [f()]", [])
    held = tool_parser("pythonic", NAMES)
    assert held.feed("\n<|py") == ("", [])
    assert held.feed('thon_start|>[get_time(tz="UTC")') == ("", [])
    content, calls = held.feed("]<|python_end|>", final=True)
    assert content == "" and _names(calls) == ["get_time"]


def test_the_parsers_are_the_settings_choices() -> None:
    """Each --tool-call-parser the settings take (besides none) has a parser, and no parser
    is left out of the settings: adding one is a line in TOOL_CALL_PARSERS and the Literal."""
    field = Settings.model_fields["tool_call_parser"]
    assert set(typing.get_args(field.annotation)) == {"none", *TOOL_CALL_PARSERS}
    for name in ("mistral", "pythonic"):
        args = build_parser().parse_args(["serve", "--tool-call-parser", name])
        assert Settings(tool_call_parser=args.tool_call_parser).tool_call_parser == name
        assert name in (field.description or "")
    with pytest.raises(ValidationError):
        Settings(tool_call_parser="nope")


# ---- through the server (the fake engine answers with its prompt's text, so a prompt that
# ends in a call is an answer that does: the prompt ends inside an assistant message)

TOOLS = [{"type": "function", "function": {"name": "t"}}]
CHAT = "/v1/chat/completions"


def _continuing(text: str) -> dict:
    """A short request whose fake answer ends with `text`. (The fake context is 256 tokens
    and the answer is the whole prompt, so it stays short.)"""
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "assistant", "content": text}],
        "tools": TOOLS,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 140,
    }


def _sdk_stream(client: openai.OpenAI, body: dict) -> openai.Stream:
    """`body` streamed through the OpenAI SDK (vLLM's template options as its extra_body)."""
    extra = ("add_generation_prompt", "continue_final_message")
    std = {k: v for k, v in body.items() if k not in extra}
    return client.chat.completions.create(
        stream=True, tool_choice="auto", extra_body={k: body[k] for k in extra}, **std
    )


def test_auto_tool_calls_with_the_mistral_parser() -> None:
    body = _continuing('[TOOL_CALLS][{"name": "t", "arguments": {"a": 1}}]')
    with fake_server(tool_call_parser="mistral") as srv, httpx.Client(base_url=srv.url) as http:
        r = http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "tool_calls"
        (tc,) = choice["message"]["tool_calls"]
        assert tc["function"] == {"name": "t", "arguments": '{"a":1}'}
        # the text before the marker (the fake template's) is content
        assert choice["message"]["content"].startswith("[tools=1]")
        assert "[TOOL_CALLS]" not in choice["message"]["content"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        stream = _sdk_stream(client, body)
        chunks = [c for c in stream if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == choice["message"]["content"]
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
            (0, "t", '{"a":1}')
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # parallel_tool_calls false: the model's first call only (v11 form here)
        two = _continuing("[TOOL_CALLS]t[ARGS]{}[TOOL_CALLS]t[ARGS]{}")
        both = http.post(CHAT, json=two).json()
        assert len(both["choices"][0]["message"]["tool_calls"]) == 2
        one = http.post(CHAT, json={**two, "parallel_tool_calls": False}).json()
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1
        # an unknown tool: the answer is content, finish_reason stop
        other = http.post(CHAT, json=_continuing("[TOOL_CALLS]u[ARGS]{}")).json()
        assert other["choices"][0]["finish_reason"] == "stop"
        assert other["choices"][0]["message"]["content"].endswith("[TOOL_CALLS]u[ARGS]{}")
        assert "tool_calls" not in other["choices"][0]["message"]


def test_auto_with_the_pythonic_parser_holds_a_list_like_answer_and_sends_it_whole() -> None:
    """The fake answer opens with the fake template's `[tools=1]`, like a pythonic list: held
    to its end, then (no call) sent as content, the same streamed or not."""
    body = _continuing("[t(a=1)]")
    with fake_server(tool_call_parser="pythonic") as srv, httpx.Client(base_url=srv.url) as http:
        r = http.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        whole = choice["message"]["content"]
        assert whole.startswith("[tools=1]") and whole.endswith("[t(a=1)]")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        stream = _sdk_stream(client, body)
        chunks = [c for c in stream if c.choices]
        sent = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
        assert sent == [whole]  # held, then sent in one piece
        assert chunks[-1].choices[0].finish_reason == "stop"
