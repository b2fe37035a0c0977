"""Tool calls that the grammar guarantees: ``tool_choice="required"`` or a named function.

The output is constrained to JSON matching the tools' parameter schemas (works for any model,
as vLLM does it), then parsed into OpenAI's ``tool_calls``. ``tool_choice="auto"`` leaves the
output free and parses the model family's own call format out of it (``tool_parsers.py``);
a server started without a parser refuses it with a 400 naming the flags, never silently
ignoring the tools.
"""

from __future__ import annotations

import json
from typing import Any

from compile_runtime.core.sampling_params import StructuredOutputsParams
from compile_runtime.server.structured import ConstraintError
from compile_runtime.server.tool_call_text import PartialCall, named_call, partial_calls
from compile_runtime.server.tool_parsers import openai_call

AUTO = "auto"  # tool_constraint's answer for tool_choice="auto": no constraint, parse the text


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not function or not function.get("name"):
            raise ConstraintError(f"tools[{i}] is not a function with a name", "tools")
        out[function["name"]] = function.get("parameters") or {"type": "object"}
    return out


def tool_constraint(
    tools: list[dict[str, Any]] | None, tool_choice: Any, auto_enabled: bool = False
) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the forced function's name or None for "required"); (None, None)
    when the request asks for no tool call, (None, AUTO) for calls parsed out of free text
    (``auto_enabled``: the server has a tool-call parser)."""
    if not tools or tool_choice in (None, "none"):
        if tool_choice not in (None, "none", "auto"):
            raise ConstraintError("tool_choice names a tool but no tools were sent", "tools")
        return None, None
    functions = _functions(tools)
    if tool_choice == "auto":
        if auto_enabled:
            return None, AUTO
        raise ConstraintError(
            "tool_choice='auto' needs the model family's tool-call format parsed out of free "
            "text: start the server with --enable-auto-tool-choice --tool-call-parser NAME "
            "(hermes, llama3_json), or send tool_choice='required' or "
            '{"type": "function", "function": {"name": ...}} (the arguments are then '
            "guaranteed by the tool's JSON schema), or tool_choice='none'",
            "tool_choice",
        )
    if tool_choice == "required":
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"enum": [name]}, "parameters": schema},
                        "required": ["name", "parameters"],
                    }
                    for name, schema in functions.items()
                ]
            },
        }
        return StructuredOutputsParams(json=calls), None
    name = (
        (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    )
    if name not in functions:
        raise ConstraintError(
            f"tool_choice names {name!r}, which is not among the tools ({sorted(functions)})",
            "tool_choice",
        )
    return StructuredOutputsParams(json=functions[name]), name


def constrained_calls(text: str, forced: str | None) -> list[PartialCall]:
    """The calls in the constrained output so far (a list of calls, or one function's
    arguments when ``forced`` names it)."""
    return [named_call(text, forced)] if forced is not None else partial_calls(text, "parameters")


def tool_calls(text: str, forced: str | None) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from the whole constrained output, each call's arguments as the
    model wrote them; JSONDecodeError when the output was cut short."""
    json.loads(text)
    return [openai_call(c.name, c.arguments) for c in constrained_calls(text, forced)]
