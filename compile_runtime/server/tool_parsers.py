"""``tool_choice="auto"``: tool calls parsed out of free text in the model family's format.

A model whose chat template takes ``tools`` answers either with text or with calls written
in its family's own syntax; the server (``--enable-auto-tool-choice --tool-call-parser
NAME``, vLLM's flags) splits the output into ``content`` and OpenAI ``tool_calls``. A call
that does not parse stays in the content, as written: nothing is dropped. In a stream the
content is sent as it comes, minus any tail that may be the start of a call (what was sent
is always a prefix of the final content); the calls come whole in the choice's last chunk.

* ``hermes`` (Hermes, Qwen 2/2.5/3, SmolLM3): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, any number, anywhere in the text.
* ``llama3_json`` (Llama 3.1-3.3): the whole output is one JSON object ``{"name": ...,
  "parameters": {...}}`` or several separated by ``;``, after an optional
  ``<|python_tag|>``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry (arguments as a JSON string, a fresh id)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _call_of(value: Any, arguments_key: str) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return openai_call(value["name"], arguments)


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
                call = _call_of(json.loads(match.group(1)), "arguments")
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


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(value, "parameters")
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


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_call_parser(name: str | None):
    """The parser called ``name`` (None: none); a ValueError names the ones there are."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: use one of {sorted(PARSERS)}")
    return PARSERS[name]()
