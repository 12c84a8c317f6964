"""Tool calls the way vLLM serves them without a model-specific parser: forced by a grammar.

`tool_choice` a named function: the output is that function's arguments, JSON valid under its
`parameters` schema. `tool_choice: "required"`: the output is a JSON array of one or more
`{"name": ..., "parameters": {...}}` objects, each a declared tool with its schema (one item
at most with `parallel_tool_calls: false`). Both work with any model, since the grammar, not
the model's own tool format, makes the call parsable (not necessarily a good one: the model
sees the tools only as its chat template shows them). `"auto"` would need a parser for each
model family's own format and is refused by name (`tool_choice_error`), as vLLM refuses it
unless started with one.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from runtime.structured import GrammarError, compile_response_format

NAMED = "named"
REQUIRED = "required"


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `kind` NAMED (the output is the
    arguments of `name`) or REQUIRED (a JSON array of calls); `grammar` forces it."""

    kind: str
    grammar: str
    name: str | None = None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def tool_mode(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolMode | None:
    """The forced tool call a request asks for (None: none; the request's text is its answer).
    `tools`: OpenAI function tools as dicts; `tool_choice`: "none" / "auto" / "required" / a
    named choice as a dict, checked before (`tool_choice_error`). Raises GrammarError when a
    schema cannot be compiled."""
    if not tools or tool_choice in (None, "none"):
        return None
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


def tool_choice_error(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """Why `tools` / `tool_choice` cannot be served (None: they can)."""
    names = [t["function"]["name"] for t in tools or []]
    if len(set(names)) != len(names):
        return "tools have repeated function names"
    if tool_choice in (None, "none"):
        # OpenAI's default with tools is "auto": tools without a tool_choice ask for it.
        if tools and tool_choice is None:
            return _AUTO
        return None
    if tool_choice == "auto":
        return _AUTO if tools else None  # (no tools: nothing to choose)
    if not tools:
        return "tool_choice asks for a tool call but no tools are given"
    if tool_choice == REQUIRED:
        return None
    name = tool_choice["function"]["name"]
    if name not in names:
        return f"tool_choice names {name!r}, which is not among the tools"
    return None


_AUTO = (
    "tool_choice 'auto' (the default when tools are given) needs a parser for the model's own "
    "tool-call format, which this server does not have: send tool_choice 'required' or a "
    "named function (forced by a grammar, any model), or 'none'"
)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls_of(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` for a finished output, or None when the text is no complete
    call (cut by max_tokens: the caller returns it as content)."""
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
    """OpenAI's: a forced named function ends "stop"; calls the model chose to make (here:
    required) end "tool_calls"; a cut or failed output keeps its own reason."""
    if reason == "stop" and mode.kind == REQUIRED:
        return "tool_calls"
    return reason
