"""Checks of request fields past their types, for ``protocol.py``'s validators: text that
cannot be encoded (a lone surrogate), the shapes of ``response_format`` / ``text.format``,
``tools`` and ``tool_choice``, and the size of what the output is constrained to (a JSON
schema, a choice list, a regex or grammar), so that nothing a client sends makes the
server compile without bound.

The bounds (OpenAI's for schemas):

* a JSON schema: at most ``MAX_SCHEMA_DEPTH`` levels of nested schemas, ``MAX_SCHEMA_PROPERTIES``
  object properties in all and ``MAX_SCHEMA_ENUM_VALUES`` enum values in all;
* ``guided_choice`` / ``structured_outputs.choice``: at most ``MAX_CHOICES`` strings of
  ``MAX_CHOICE_CHARS`` characters in all;
* a regex or an EBNF grammar: at most ``MAX_PATTERN_CHARS`` characters;
* the lists and maps of a request: ``stop`` at most ``MAX_STOP_STRINGS`` strings of
  ``MAX_STOP_CHARS`` characters each, ``stop_token_ids`` ``MAX_STOP_TOKEN_IDS`` ids,
  ``logit_bias`` ``MAX_LOGIT_BIAS`` entries, ``tools`` ``MAX_TOOLS`` (OpenAI's bound),
  ``messages`` / ``input`` ``MAX_MESSAGES`` items, ``metadata`` ``MAX_METADATA`` pairs
  (OpenAI's bound), ``include`` ``MAX_INCLUDE`` values and ``/detokenize``'s ``tokens``
  ``MAX_DETOKENIZE_TOKENS`` ids.

Each failure is a ``ValueError`` (pydantic makes it a 400 naming the field), except
unencodable text, an ``APIError`` naming where it is.
"""

from __future__ import annotations

import json
from typing import Any

from compile_runtime.server.api_error import APIError

MAX_SCHEMA_DEPTH = 10
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_ENUM_VALUES = 1000
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 64 * 1024
MAX_PATTERN_CHARS = 16 * 1024
MAX_JSON_DEPTH = 64  # any JSON value inside a schema (defaults, consts, examples)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_MESSAGES = 4096
MAX_METADATA = 16
MAX_INCLUDE = 16
MAX_DETOKENIZE_TOKENS = 1 << 20

# The keywords whose value is a schema, a list of schemas, or a dict of schemas.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_DICT = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unencodable(value: Any, where: str = "") -> str | None:
    """The path of the first string (or key) in ``value`` that UTF-8 cannot encode."""
    stack = [(value, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or "body"
                stack.append((item, sub))
        elif isinstance(v, list):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(v))
    return None


def check_encodable(value: Any) -> None:
    """An ``APIError`` (400) naming the first field holding text that is not Unicode."""
    try:  # the common case at C speed; the walk only to name the field
        json.dumps(value, ensure_ascii=False, check_circular=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, RecursionError):
        pass  # not JSON (a model built in code) or too deep: walk it
    where = unencodable(value)
    if where is not None:
        field = where.split(".", 1)[0]
        raise APIError(
            400,
            f"{where}: the text holds a lone surrogate (such as \\ud800), which is not "
            "Unicode; send valid UTF-8 text",
            field,
        )


def _json_depth(value: Any, limit: int) -> bool:
    """Whether ``value`` nests no deeper than ``limit``."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return False
            items = v.values() if isinstance(v, dict) else v
            stack.extend((item, depth + 1) for item in items)
    return True


def check_schema(schema: Any, what: str = "the schema") -> None:
    """A JSON schema within the bounds (a dict, a bool, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"{what} is not valid JSON") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{what} must be a JSON object (got {type(schema).__name__})")
    if not _json_depth(schema, MAX_JSON_DEPTH * 2):
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH * 2} JSON levels")
    properties = enums = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"{what} nests more than {MAX_SCHEMA_DEPTH} levels of schemas, the most this "
                "server takes"
            )
        enum = node.get("enum")
        if isinstance(enum, list):
            enums += len(enum)
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
        if properties > MAX_SCHEMA_PROPERTIES or enums > MAX_SCHEMA_ENUM_VALUES:
            raise ValueError(
                f"{what} has more than {MAX_SCHEMA_PROPERTIES} properties or "
                f"{MAX_SCHEMA_ENUM_VALUES} enum values in all, the most this server takes"
            )
        for key in _ONE:
            sub = node.get(key)
            if isinstance(sub, list):  # items as a list (older drafts)
                stack.extend((s, depth + 1) for s in sub)
            elif sub is not None:
                stack.append((sub, depth + 1))
        for key in _LIST:
            sub = node.get(key)
            if isinstance(sub, list):
                stack.extend((s, depth + 1) for s in sub)
        for key in _DICT:
            sub = node.get(key)
            if isinstance(sub, dict):
                # $defs are reached by reference: each definition starts at level 1 again.
                start = 0 if key in ("$defs", "definitions") else depth
                stack.extend((s, start + 1) for s in sub.values())


def check_count(items: Any, limit: int, what: str) -> None:
    """At most ``limit`` items (``what``: their name, plural) in a list or a map."""
    if items is not None and len(items) > limit:
        raise ValueError(f"{len(items)} {what}; this server takes at most {limit}")


def check_stop(stop: str | list[str] | None) -> None:
    """``stop``: at most ``MAX_STOP_STRINGS`` strings of ``MAX_STOP_CHARS`` characters."""
    strings = [stop] if isinstance(stop, str) else stop or []
    check_count(strings, MAX_STOP_STRINGS, "stop strings")
    longest = max((len(s) for s in strings), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(
            f"a stop string of {longest} characters; this server takes at most "
            f"{MAX_STOP_CHARS} characters in each"
        )


def check_choices(choices: list[str], what: str) -> None:
    if len(choices) > MAX_CHOICES or sum(len(c) for c in choices) > MAX_CHOICE_CHARS:
        where = f"{what}: " if what else ""
        raise ValueError(
            f"{where}{len(choices)} choices of {sum(len(c) for c in choices)} characters; this "
            f"server takes at most {MAX_CHOICES} choices of {MAX_CHOICE_CHARS} characters "
            "in all"
        )


def check_pattern(text: str, what: str) -> None:
    if len(text) > MAX_PATTERN_CHARS:
        raise ValueError(
            f"{what} is {len(text)} characters; this server takes at most {MAX_PATTERN_CHARS}"
        )


def check_structured(spec: dict[str, Any], what: str) -> None:
    """vLLM's ``structured_outputs`` (json, regex, choice, grammar...): types and bounds."""
    for key, value in spec.items():
        if key in ("json", "json_schema"):
            if not isinstance(value, dict | str | bool):
                raise ValueError(f"{what}.{key} must be a JSON schema (an object or its text)")
            check_schema(value, f"{what}.{key}")
        elif key in ("regex", "grammar"):
            if not isinstance(value, str):
                raise ValueError(f"{what}.{key} must be a string")
            check_pattern(value, f"{what}.{key}")
        elif key == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError(f"{what}.choice must be a list of strings")
            check_choices(value, f"{what}.choice")


def check_response_format(value: dict[str, Any], what: str, flat: bool = False) -> None:
    """OpenAI's ``response_format`` (chat) or, ``flat``, ``text.format`` (Responses: the
    schema's fields on the format itself)."""
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"{what}.type must be 'text', 'json_object' or 'json_schema'")
    if kind != "json_schema":
        return
    spec = value if flat else value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"{what}.json_schema must be an object with the schema")
    where = what if flat else f"{what}.json_schema"
    for key in ("name", "description"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ValueError(f"{where}.{key} must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"{where}.strict must be a boolean")
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is not None:
        check_schema(schema, f"{where}.schema")


def check_tools(tools: list[dict[str, Any]], responses: bool = False) -> None:
    """Function tools: ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` (Responses: the function's fields on the tool itself), at most
    ``MAX_TOOLS`` of them."""
    check_count(tools, MAX_TOOLS, "tools")
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            continue  # refused where it is used, naming the type
        function = tool if responses else tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"tools.{i}.function must be an object with the function's name")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools.{i}: the function's name must be a non-empty string")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ValueError(f"tools.{i}: the function's description must be a string")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(f"tools.{i}: the function's parameters must be a JSON schema")
            check_schema(parameters, f"tools.{i} parameters")


def check_tool_choice(choice: str | dict[str, Any], responses: bool = False) -> None:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError("give 'none', 'auto', 'required' or a function")
        return
    function = choice if responses else choice.get("function")
    if (
        choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        shape = (
            '{"type": "function", "name": ...}'
            if responses
            else ('{"type": "function", "function": {"name": ...}}')
        )
        raise ValueError(f"give 'none', 'auto', 'required' or {shape}")
