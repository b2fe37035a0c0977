"""Tool calls read out of JSON text that may still be growing, and the stream deltas of them.

``partial_calls`` walks the text of one call object, an array of them, or several separated
by ``;`` (however far it has come) and gives each call's name once its string is whole and
the raw text of its arguments value so far. The arguments are always the model's own text,
never re-serialized, so the fragments a stream sends add up to exactly the arguments of the
whole answer. ``CallDeltas`` turns successive readings into OpenAI's ``tool_calls`` stream
deltas: ``index``, ``id``, ``type`` and ``function.name`` once, then ``function.arguments``
pieces.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

_SPACE = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None  # None until its string is whole
    arguments: str  # the raw text of its arguments value so far
    complete: bool  # the call object is closed


def _skip(text: str, i: int, chars: str = _SPACE) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at ``i``, or None if the text stops inside it."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if text[i] in "{[":
        depth, j, in_string = 0, i, False
        while j < len(text):
            c = text[j]
            if in_string:
                j += 2 if c == "\\" else 1
                in_string = in_string and c != '"'
                continue
            if c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _SPACE:
        j += 1
    return j if j < len(text) else None  # a number may go on


def _object(text: str, i: int, name_key: str, args_keys: tuple[str, ...]):
    """(the call of the object at ``i``, where it ends or None)."""
    call = PartialCall(None, "", False)
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "}":
        key_end = _value_end(text, i)
        if key_end is None or text[i] != '"':
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, None
        start = _skip(text, i + 1)
        end = _value_end(text, start)
        if key == name_key and end is not None:
            call.name = json.loads(text[start:end])
        elif key in args_keys and start < len(text):
            call.arguments = text[start : end if end is not None else len(text)]
        if end is None:
            return call, None
        i = _skip(text, end, _SPACE + ",")
    if i >= len(text):
        return call, None
    call.complete = True
    return call, i + 1


def partial_calls(text: str, args_key: str, name_key: str = "name") -> list[PartialCall]:
    """The calls in ``text`` so far (see the module docstring); ``args_key`` names the
    arguments ("parameters" or "arguments"; "arguments" is always taken too)."""
    keys = (args_key, "arguments")
    calls: list[PartialCall] = []
    i = _skip(text, 0)
    in_array = i < len(text) and text[i] == "["
    if in_array:
        i = _skip(text, i + 1)
    while i < len(text) and text[i] == "{":
        call, end = _object(text, i, name_key, keys)
        calls.append(call)
        if end is None:
            break
        i = _skip(text, end, _SPACE + ",;")
    return calls


def named_call(text: str, name: str) -> PartialCall:
    """The call of a named ``tool_choice``: the whole text is its arguments object."""
    start = _skip(text, 0)
    end = _value_end(text, start)
    return PartialCall(name, text[start : end if end is not None else len(text)], end is not None)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallDeltas:
    """The ``tool_calls`` deltas of one choice: each call's header once its name is known,
    then what its arguments grew by since the last reading."""

    def __init__(self):
        self.ids: list[str] = []
        self.sent: list[int] = []  # characters of each call's arguments sent

    def update(self, calls: list[PartialCall]) -> list[dict]:
        out = []
        for index, call in enumerate(calls):
            if index == len(self.ids):
                if call.name is None:
                    break  # headers go out in order
                self.ids.append(new_call_id())
                self.sent.append(0)
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            piece = call.arguments[self.sent[index] :]
            if piece:
                self.sent[index] = len(call.arguments)
                if out and out[-1]["index"] == index:
                    out[-1]["function"]["arguments"] += piece
                else:
                    out.append({"index": index, "function": {"arguments": piece}})
        return out
