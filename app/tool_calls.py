"""Tool calls the way vLLM serves them without a model-specific parser: forced by a grammar.

`tool_choice` a named function: the output is that function's arguments, JSON valid under its
`parameters` schema. `tool_choice: "required"`: the output is a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, each a declared tool with its schema (one item
at most with `parallel_tool_calls: false`). Both work with any model, since the grammar, not
the model's own tool format, makes the call parsable (not necessarily a good one: the model
sees the tools only as its chat template shows them). `"auto"` reads the model's own format back
with a parser, which the server is started with (`--tool-call-parser hermes`); without one it
is refused by name (`tool_choice_error`), as vLLM refuses it.
"""

from __future__ import annotations

import ast
import json
import math
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.sampling.structured import GrammarError, compile_response_format

NAMED = "named"
REQUIRED = "required"
AUTO = "auto"


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `kind` NAMED (the output is the
    arguments of `name`) or REQUIRED (a JSON array of calls), forced by `grammar`; or AUTO
    (the model's own format, read back by the server's parser; `tool_names`: the declared
    ones, the only calls it accepts)."""

    kind: str
    grammar: str | None
    name: str | None = None
    tool_names: frozenset[str] = frozenset()
    parser: str = "none"  # AUTO: the server's --tool-call-parser
    # AUTO with parallel_tool_calls false: the model's first call only (its output is not
    # constrained; REQUIRED's grammar holds it to one instead)
    max_calls: int | None = None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def tool_mode(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser: str = "none",
) -> ToolMode | None:
    """The tool calls a request asks for (None: none; the request's text is its answer).
    `tools`: OpenAI function tools as dicts; `tool_choice`: "none" / "auto" (or None: OpenAI's
    default with tools) / "required" / a named choice as a dict, checked before
    (`tool_choice_error`). Raises GrammarError when a schema cannot be compiled."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice in (None, AUTO):
        names = frozenset(t["function"]["name"] for t in tools)
        one = 1 if parallel_tool_calls is False else None
        return ToolMode(AUTO, None, tool_names=names, parser=parser, max_calls=one)
    if tool_choice == REQUIRED:
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": items[0] if len(items) == 1 else {"anyOf": items},
        }
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolMode(REQUIRED, _grammar(schema))
    name = tool_choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return ToolMode(NAMED, _grammar(_parameters(tool)), name)


def _grammar(schema: dict[str, Any]) -> str:
    try:
        grammar = compile_response_format(
            {"type": "json_schema", "json_schema": {"name": "tool", "schema": schema}}
        )
    except GrammarError as e:
        raise GrammarError(str(e).replace("response_format schema", "tool parameters")) from e
    assert grammar is not None
    return grammar


def tool_choice_error(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str = "none"
) -> str | None:
    """Why `tools` / `tool_choice` cannot be served with the server's `parser` (None: they
    can)."""
    names = [t["function"]["name"] for t in tools or []]
    if len(set(names)) != len(names):
        return REPEATED_NAMES
    if tool_choice in (None, "none", AUTO):
        # OpenAI's default with tools is "auto": tools without a tool_choice ask for it.
        if tools and tool_choice != "none" and parser == "none":
            return _AUTO
        return None
    if not tools:
        return "tool_choice asks for a tool call but no tools are given"
    if tool_choice == REQUIRED:
        return None
    name = tool_choice["function"]["name"]
    if name not in names:
        return f"tool_choice names {name!r}, which is not among the tools"
    return None


REPEATED_NAMES = "tools have repeated function names"  # (a 400 naming tools, not tool_choice)
_AUTO = (
    "tool_choice 'auto' (the default when tools are given) needs a parser for the model's own "
    "tool-call format, and this server was started without one (--tool-call-parser): send "
    "tool_choice 'required' or a named function (forced by a grammar, any model), or 'none'"
)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls_of(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` for a finished forced output (NAMED, REQUIRED), or None when
    the text is no complete call (cut by max_tokens: the caller returns it as content)."""
    if mode.kind == NAMED:
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(mode.name or "", text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [
        _call(c["name"], json.dumps(c["parameters"], ensure_ascii=False, separators=(",", ":")))
        for c in calls
    ]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def finish_reason(mode: ToolMode, reason: str | None) -> str | None:
    """OpenAI's, for an output that made calls: a forced named function ends "stop"; calls
    the model chose to make (required, auto) end "tool_calls"; a cut or failed output keeps
    its own reason."""
    if reason == "stop" and mode.kind != NAMED:
        return "tool_calls"
    return reason


# ---- tool_choice "auto": the model's own format, read back by a parser (`--tool-call-parser`)

# What each parser's whole-text function returns: the content (None when there is none beside
# the calls) and the calls as OpenAI's `tool_calls` items.
Parsed = tuple[str | None, list[dict[str, Any]]]


class ToolCallStream(Protocol):
    """The streamed side of a parser: `feed` each new piece of the output (`final` with the
    last) and get back the content to send now and the calls that are complete; `num_calls`
    counts the calls sent so far."""

    num_calls: int

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]: ...


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style tool calls (Qwen2.5 / Qwen3, Hermes 2 Pro and later): each call a JSON
    `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. Returns the
    content (None when blank) and the calls. A block that is not a call of a declared tool, or
    is not closed, stays content as written; so does everything when there is no call. Read
    by `HermesStream` in one piece, so the streamed and the whole answer never differ."""
    content, calls = HermesStream(tool_names).feed(text, final=True)
    if not calls:
        return text, []
    return (content or None), calls


def _hermes_call(body: str, tool_names: set[str]) -> dict[str, Any] | None:
    try:
        return _call_of(json.loads(body), tool_names)
    except ValueError:
        return None


def _call_of(value: Any, tool_names: set[str]) -> dict[str, Any] | None:
    """A parsed `{"name": ..., "arguments" (or "parameters"): {...}}` of a declared tool as
    an OpenAI call, else None (the JSON parsers' checks). The arguments must be an object (a
    string holding one is read): OpenAI's `arguments` is always one."""
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    try:  # JSON may spell a lone surrogate ("\ud800"), which no response could carry
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return _call(value["name"], text)


class HermesStream:
    """The streamed side of `parse_hermes`: `feed` the output's text as it comes and get back
    content to send and whole calls (each when its `</tool_call>` arrives). Held until it is
    clear: text that could begin `<tool_call>`, trailing blanks (dropped before a call and at
    the end of an answer with calls), and an open block. The blanks right after a call are
    dropped; a block that is no call of a declared tool is sent as content, as written."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._held = ""  # text not yet sent: blanks, a possible tag start, an open block
        self._in_call = False
        self._pre_blanks = ""  # the blanks before an open block (dropped if it is a call)
        self._after_call = False  # the next content's leading blanks follow a call: dropped
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []

        def emit(piece: str) -> None:
            if self._after_call:
                piece = piece.lstrip()
                self._after_call = not piece
            content.append(piece)

        while True:
            if self._in_call:
                body, closed, rest = self._held.partition(_CLOSE)
                if not closed:
                    break
                call = _hermes_call(body, self.tool_names)
                if call is None:
                    emit(self._pre_blanks + _OPEN + body + _CLOSE)
                else:
                    calls.append(call)
                    self._after_call = True
                self._held, self._in_call, self._pre_blanks = rest, False, ""
                continue
            before, opened, rest = self._held.partition(_OPEN)
            if opened:
                kept = before.rstrip()
                emit(kept)
                self._pre_blanks = before[len(kept) :]
                self._held, self._in_call = rest, True
                continue
            cut = len(self._held) - _partial_tag(self._held)
            cut = len(self._held[:cut].rstrip())
            emit(self._held[:cut])
            self._held = self._held[cut:]
            break
        if final:
            if self._in_call:  # a block never closed: content, as written
                emit(self._pre_blanks + _OPEN + self._held)
            elif self.num_calls + len(calls) == 0:
                emit(self._held)  # no call: the answer is content exactly as written
            else:
                emit(self._held.rstrip())  # (a last partial tag is text; blanks are not kept)
            self._held, self._in_call, self._pre_blanks = "", False, ""
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_tag(text: str, tag: str = _OPEN) -> int:
    """How many characters at the end of `text` could begin `tag` (not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.1 / 3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters":
    {...}}` (after an optional `<|python_tag|>`), several separated by `;`. Returns (None,
    calls), or (the text, []) when it is not such calls of declared tools."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(value, tool_names)
        if call is None:
            return text, []
        calls.append(call)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


class _WholeAnswerStream:
    """The streamed side of a parser whose calls are the whole answer (llama3_json,
    pythonic): an answer whose first non-blank text opens like a call (`_opener`, or the
    start of `_tag`) is held and read by `_parse` when it ends, since until then it may turn
    out to be prose; any other answer streams as content as it comes."""

    _opener: str
    _tag: str
    _parse: Callable[[str, set[str]], Parsed]

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._held = ""
        self._holding: bool | None = None  # None: not known yet (only blanks so far)
        self.num_calls = 0

    def _opens_like_call(self, lead: str) -> bool:
        return lead.startswith(self._opener) or self._tag.startswith(lead[: len(self._tag)])

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if self._holding is False:
            return text, []
        self._held += text
        # (decided once, on the first non-blank text: a held answer is not scanned again at
        # every piece, which would make a long one quadratic)
        lead = self._held.lstrip() if self._holding is None else ""
        if lead:
            self._holding = self._opens_like_call(lead)
            if not self._holding:
                out, self._held = self._held, ""
                return out, []
        if not final:
            return "", []
        content, calls = type(self)._parse(self._held, self.tool_names)
        self._held = ""
        self.num_calls += len(calls)
        return content or "", calls


class Llama3JsonStream(_WholeAnswerStream):
    """The streamed side of `parse_llama3_json`: an answer that opens like a call (`{` or
    `<|python_tag|>` first) is held and parsed when it ends; any other streams as content."""

    _opener, _tag, _parse = "{", _PYTHON_TAG, staticmethod(parse_llama3_json)


# ---- mistral: `[TOOL_CALLS]` and the calls (Mistral-Instruct v0.3, Mistral-Nemo, Mistral-Small)

_TOOL_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str, tool_names: set[str]) -> Parsed:
    """Mistral tool calls: the answer's text, then `[TOOL_CALLS]` and the calls, in either of
    the forms Mistral's tokenizers use: a JSON array of `{"name": ..., "arguments": {...}}`
    (v3: Mistral-7B-Instruct v0.3, Mistral-Nemo, Mistral-Small; a single such object is taken
    too), or `name[ARGS]{...}` (v11 and later), each call behind its own `[TOOL_CALLS]`.
    Arguments may be an object or a string holding one. Returns the text before the marker
    (its trailing blanks left out; None when blank) and the calls; when what follows the
    marker is not wholly such calls of declared tools, none are: the whole text is the
    content, as written."""
    head, marker, rest = text.partition(_TOOL_CALLS)
    calls = _mistral_calls(rest, tool_names) if marker else None
    if not calls:
        return text, []
    return (head.rstrip() or None), calls


def _mistral_calls(rest: str, tool_names: set[str]) -> list[dict[str, Any]] | None:
    """The calls in the text after the first `[TOOL_CALLS]`, or None unless all of it is calls
    of declared tools. Read left to right with a JSON decoder rather than split on the
    markers, so a marker inside an argument's string cannot cut a call in two."""
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    at = _skip_blanks(rest, 0)
    while True:
        try:
            if rest.startswith(("[", "{"), at):  # v3: an array of calls (or one call)
                value, at = decoder.raw_decode(rest, at)
                items = value if isinstance(value, list) else [value]
            else:  # v11: name[ARGS]{...}
                name, args_tag, _ = rest[at:].partition(_ARGS)
                if not args_tag:
                    return None
                at = _skip_blanks(rest, at + len(name) + len(_ARGS))
                arguments, at = decoder.raw_decode(rest, at)
                items = [{"name": name.strip(), "arguments": arguments}]
        except ValueError:
            return None
        if not items:  # `[]`: no call, so nothing to take the marker away for
            return None
        for item in items:
            call = _call_of(item, tool_names)
            if call is None:
                return None
            calls.append(call)
        at = _skip_blanks(rest, at)
        if at == len(rest):
            return calls
        if not rest.startswith(_TOOL_CALLS, at):  # anything else after a call: not calls
            return None
        at = _skip_blanks(rest, at + len(_TOOL_CALLS))


def _skip_blanks(text: str, at: int) -> int:
    """The first index from `at` on that is not whitespace (len(text) when none is)."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class MistralStream:
    """The streamed side of `parse_mistral`: prose streams as it comes, less any end that
    could begin `[TOOL_CALLS]` and any trailing blanks (the whole parse leaves those out of
    the content before a call), held until the next text shows what they are. From the marker
    on everything is held, and read when the output ends: a later call of an unknown tool
    makes the whole answer content, so no call is safe to send before then."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._held = ""  # not yet sent: blanks, a possible marker start, or the calls
        self._in_calls = False  # `[TOOL_CALLS]` was seen: all the rest is held to the end
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        out = ""
        if not self._in_calls:
            found = self._held.find(_TOOL_CALLS)
            if found >= 0:
                self._in_calls = True
                cut = len(self._held[:found].rstrip())
            else:
                cut = len(self._held) - _partial_tag(self._held, _TOOL_CALLS)
                cut = len(self._held[:cut].rstrip())
            out, self._held = self._held[:cut], self._held[cut:]
        if not final:
            return out, []
        calls: list[dict[str, Any]] = []
        if self._in_calls:
            # (the held text is blanks, the marker and what follows: the parse's content
            # before the marker is None, and the whole text when there are no calls)
            content, calls = parse_mistral(self._held, self.tool_names)
            out += content or ""
        else:
            out += self._held
        self._held = ""
        self.num_calls += len(calls)
        return out, calls


# ---- pythonic: a Python list of calls (Llama 3.2, Llama 4)

_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"


class _NotLiteral(Exception):
    """A pythonic call's argument is not a plain literal value."""


def parse_pythonic(text: str, tool_names: set[str]) -> Parsed:
    """Pythonic tool calls (Llama 3.2, Llama 4): the whole answer is a Python list of calls
    such as `[get_weather(city="Paris", unit="c"), get_time(tz="UTC")]`, optionally between
    `<|python_start|>` and `<|python_end|>`. Each call names a declared tool and has keyword
    arguments only, each a literal: a string, number, True / False / None (JSON's true /
    false / null), or a list or dict (string keys) of those. The text is parsed with `ast`,
    never evaluated. Returns (None, calls), or (the text, []) when it is not such calls."""
    body = text.strip().removeprefix(_PYTHON_START).strip().removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        # A string such as "C:\dir" makes Python warn of an invalid escape (and is read as
        # written): silenced, so the answer does not depend on the process's warning filters
        # (with warnings as errors it would be a SyntaxError, and the call content).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):  # (RecursionError: nested too deep)
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for node in tree.elts:
        call = _pythonic_call(node, tool_names)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _pythonic_call(node: ast.expr, tool_names: set[str]) -> dict[str, Any] | None:
    """`name(key=literal, ...)` of a declared tool as an OpenAI call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None  # (a dotted or computed callee is no tool's name)
    if node.func.id not in tool_names or node.args:
        return None
    arguments: dict[str, Any] = {}
    for kw in node.keywords:
        # kw.arg is None for `**mapping`; ast.parse lets a repeated keyword through (only
        # the compiler refuses it), and a call cannot have two values for one parameter
        if kw.arg is None or kw.arg in arguments:
            return None
        try:
            arguments[kw.arg] = _literal(kw.value)
        except (_NotLiteral, RecursionError):
            return None
    return _call(node.func.id, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _literal(node: ast.expr) -> Any:
    """The JSON value a literal node spells; raises _NotLiteral for anything else. Written
    out rather than `ast.literal_eval`, which also takes tuples, sets, bytes and complex
    numbers, none of which JSON has."""
    if isinstance(node, ast.Constant):
        return _scalar(node.value)
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)  # not -True
    ):
        value = node.operand.value
        return _scalar(-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]  # (a `*starred` item is no literal: raises)
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            # (key None: a `**mapping` inside the dict)
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral
            out[_scalar(key.value)] = _literal(value)
        return out
    raise _NotLiteral


def _scalar(value: Any) -> Any:
    """A constant's value when JSON has it (and UTF-8 can carry it), else _NotLiteral."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):  # 1e999 is inf: no JSON for it
        return value
    if isinstance(value, str):
        try:  # a lone surrogate ("\ud800") could not be sent as UTF-8
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _NotLiteral from None
        return value
    raise _NotLiteral  # bytes, complex, Ellipsis


class PythonicStream(_WholeAnswerStream):
    """The streamed side of `parse_pythonic`: an answer that opens like a call (`[` or
    `<|python_start|>` first) is held and parsed when it ends; any other streams as content."""

    _opener, _tag, _parse = "[", _PYTHON_START, staticmethod(parse_pythonic)


# `--tool-call-parser` name -> (whole-text parse, streamed parser). The settings' Literal names
# the same keys (and "none"), so no other name reaches these (tests/test_tool_calls.py checks
# that the two agree).
TOOL_CALL_PARSERS: dict[str, tuple[Callable[[str, set[str]], Parsed], type[ToolCallStream]]] = {
    "hermes": (parse_hermes, HermesStream),
    "llama3_json": (parse_llama3_json, Llama3JsonStream),
    "mistral": (parse_mistral, MistralStream),
    "pythonic": (parse_pythonic, PythonicStream),
}


def tool_parser(name: str, tool_names: set[str]) -> ToolCallStream:
    """The streamed parser for `--tool-call-parser name` (a key of TOOL_CALL_PARSERS)."""
    return TOOL_CALL_PARSERS[name][1](tool_names)


def parse_tool_calls(name: str, text: str, tool_names: set[str]) -> Parsed:
    """A finished answer read by `--tool-call-parser name`: (content, calls)."""
    return TOOL_CALL_PARSERS[name][0](text, tool_names)
