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

import json
import secrets
from dataclasses import dataclass
from typing import Any

from runtime.structured import GrammarError, compile_response_format

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

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style tool calls (Qwen2.5 / Qwen3, Hermes 2 Pro and later): each call a JSON
    `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. Returns the
    text before the first call (None when blank) and the calls; when a block is not such a
    call of a declared tool, none are: the whole text is the content."""
    if _OPEN not in text:
        return text, []
    head, _, rest = text.partition(_OPEN)
    calls = []
    for block in (_OPEN + rest).split(_OPEN)[1:]:
        body, closed, _ = block.partition(_CLOSE)
        call = _hermes_call(body, tool_names) if closed else None
        if call is None:
            return text, []
        calls.append(call)
    return (head.strip() or None), calls


def _hermes_call(body: str, tool_names: set[str]) -> dict[str, Any] | None:
    try:
        return _call_of(json.loads(body), tool_names)
    except ValueError:
        return None


def _call_of(value: Any, tool_names: set[str]) -> dict[str, Any] | None:
    """A parsed `{"name": ..., "arguments" (or "parameters"): {...}}` of a declared tool as
    an OpenAI call, else None (both parsers' checks)."""
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return _call(value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


class HermesStream:
    """The streamed side of `parse_hermes`: `feed` the output's text as it comes and get back
    content to send and whole calls (each when its `</tool_call>` arrives). Text that could be
    the start of `<tool_call>` is held until it is clear. A block that is no call of a
    declared tool is sent as content, as it was written."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._held = ""  # text not yet sent: a possible tag start, or a block not yet closed
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                body, closed, rest = self._held.partition(_CLOSE)
                if not closed:
                    break
                call = _hermes_call(body, self.tool_names)
                if call is None:
                    content.append(_OPEN + body + _CLOSE)
                else:
                    calls.append(call)
                self._held, self._in_call = rest, False
                continue
            before, opened, rest = self._held.partition(_OPEN)
            if opened:
                content.append(before)
                self._held, self._in_call = rest, True
                continue
            keep = _partial_tag(self._held)
            content.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        if final and self._held:
            content.append((_OPEN if self._in_call else "") + self._held)
            self._held, self._in_call = "", False
        self.num_calls += len(calls)
        text_out = "".join(content)
        if self.num_calls:  # after a call, the newlines between blocks are not content
            text_out = text_out.strip()
        return text_out, calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
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


class Llama3JsonStream:
    """The streamed side of `parse_llama3_json`: an answer that opens like a call (`{` or
    `<|python_tag|>` first) is held and parsed when it ends; any other streams as content."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._held = ""
        self._holding: bool | None = None  # None: not known yet (only blanks so far)
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if self._holding is False:
            return text, []
        self._held += text
        lead = self._held.lstrip()
        if self._holding is None and lead:
            self._holding = lead.startswith("{") or _PYTHON_TAG.startswith(lead[:14])
            if not self._holding:
                out, self._held = self._held, ""
                return out, []
        if not final:
            return "", []
        content, calls = parse_llama3_json(self._held, self.tool_names)
        self._held = ""
        self.num_calls += len(calls)
        return content or "", calls


def tool_parser(name: str, tool_names: set[str]) -> Any:
    """The streamed parser for `--tool-call-parser name` (hermes, llama3_json)."""
    return HermesStream(tool_names) if name == "hermes" else Llama3JsonStream(tool_names)


def parse_tool_calls(
    name: str, text: str, tool_names: set[str]
) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished answer read by `--tool-call-parser name`: (content, calls)."""
    parse = parse_hermes if name == "hermes" else parse_llama3_json
    return parse(text, tool_names)
