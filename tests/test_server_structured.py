"""The server's structured-output and tool fields, mapped to one constraint (no server here:
the mapping alone; tests/test_server_api.py drives the routes)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jsonschema")
import jsonschema

from compile_runtime.server.structured import ConstraintError, constraint_of
from compile_runtime.server.tools import tool_calls, tool_constraint

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_every_spelling_maps_to_one_constraint():
    assert constraint_of({}) is None
    assert constraint_of({"response_format": {"type": "text"}}) is None
    assert constraint_of({"response_format": {"type": "json_object"}}).json_object
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert constraint_of({"response_format": rf}).json_schema == SCHEMA
    assert constraint_of({"guided_json": SCHEMA}).json_schema == SCHEMA
    assert constraint_of({"guided_regex": "[0-9]+"}).regex == "[0-9]+"
    assert constraint_of({"guided_choice": ["a", "b"]}).choice == ["a", "b"]
    assert constraint_of({"structured_outputs": {"choice": ["a"]}}).choice == ["a"]
    assert constraint_of({"guided_grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema is missing"),
        ({"guided_json": {"type": "objectz"}}, "guided_json", "not valid"),
        ({"guided_regex": "[a"}, "guided_regex", "not valid"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
    ],
)
def test_a_bad_constraint_names_the_field_sent(fields, param, message):
    with pytest.raises(ConstraintError, match=message) as info:
        constraint_of(fields)
    assert info.value.param == param


def test_forced_tool_calls_are_constrained_by_the_tools_schemas():
    constraint, name = tool_constraint([WEATHER], "required")
    assert name is None
    calls = [{"name": "weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(calls, constraint.json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], constraint.json_schema)
    (call,) = tool_calls(json.dumps(calls), None)
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}

    named = {"type": "function", "function": {"name": "weather"}}
    constraint, name = tool_constraint([WEATHER], named)
    assert name == "weather" and constraint.json_schema == WEATHER["function"]["parameters"]
    (call,) = tool_calls('{"city": "Rome"}', "weather")
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert tool_constraint([WEATHER], "none") == (None, None)
    assert tool_constraint(None, None) == (None, None)


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([WEATHER], "auto", "tool_choice='required'"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([{"type": "function", "function": {}}], "required", "tools\\[0\\]"),
        (None, "required", "no tools were sent"),
    ],
)
def test_tool_requests_it_cannot_honour_are_refused_by_name(tools, choice, message):
    with pytest.raises(ConstraintError, match=message):
        tool_constraint(tools, choice)
