"""``tool_choice="auto"``: tool calls parsed out of free text in the model family's format.

A model whose chat template takes ``tools`` answers either with text or with calls written
in its family's own syntax; the server (``--enable-auto-tool-choice --tool-call-parser
NAME``, vLLM's flags) splits the output into ``content`` and OpenAI ``tool_calls``. A call
that does not parse stays in the content, as written: nothing is dropped. In a stream the
content is sent as it comes, minus any tail that may be the start of a call (what was sent
is always a prefix of the final content); each call streams as deltas, its name then its
arguments as written (``stream_calls``, ``tool_call_text.py``), and the whole answer's
arguments are the same text.

* ``hermes`` (Hermes, Qwen 2/2.5/3, SmolLM3): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, any number, anywhere in the text.
* ``llama3_json`` (Llama 3.1-3.3): the whole output is one JSON object ``{"name": ...,
  "parameters": {...}}`` or several separated by ``;``, after an optional
  ``<|python_tag|>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from compile_runtime.server.tool_call_text import PartialCall, new_call_id, partial_calls


def openai_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (arguments: the JSON text, a fresh id)."""
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments or "{}"}}  # fmt: skip


def _call_of(text: str, arguments_key: str) -> dict[str, Any] | None:
    """The call one JSON object's text makes, its arguments as written; None if it is not one."""
    value = json.loads(text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    (call,) = partial_calls(text, arguments_key)
    return openai_call(value["name"], call.arguments)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls, kept, end = [], [], 0
        for match in self._CALL.finditer(text):
            try:
                call = _call_of(match.group(1), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue  # not a call: left in the content as written
            kept.append(text[end : match.start()])
            end = match.end()
            calls.append(call)
        if not calls:
            return text, []
        content = "".join(kept) + text[end:]
        return (content if content.strip() else None), calls

    def streamable(self, text: str) -> int:
        """How much of ``text`` (so far) is content for sure."""
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _held_back(text, self.START)

    def stream_calls(self, text: str) -> list[PartialCall]:
        """The calls written so far, the last perhaps still growing."""
        calls = []
        for piece in text.split(self.START)[1:]:
            calls += partial_calls(piece.split(self.END)[0], "arguments")
        return calls


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            start = at
            try:
                _, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(body[start:at], "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return None, calls

    def streamable(self, text: str) -> int:
        head = text.lstrip()
        if head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return 0  # may be a call: held until the output is complete
        return len(text)

    def stream_calls(self, text: str) -> list[PartialCall]:
        body = text.lstrip().removeprefix(self.TAG).lstrip()
        return partial_calls(body, "parameters") if body.startswith("{") else []


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_call_parser(name: str | None):
    """The parser called ``name`` (None: none); a ValueError names the ones there are."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: use one of {sorted(PARSERS)}")
    return PARSERS[name]()
