"""The responses ``/v1/responses`` keeps (``store``): the last ``STORE_SIZE``, and no more
than ``STORE_CHARS`` characters of text in all, each with its conversation as chat
messages, for ``previous_response_id`` and ``GET /v1/responses/{id}``. In memory: a
restart forgets them, as vLLM's store does. Bounded both ways, the store holds the same
memory after a second burst of large requests as after the first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from compile_runtime.server.api_error import APIError

STORE_SIZE = 1000  # responses kept for previous_response_id / GET
STORE_CHARS = 64 << 20  # characters of text in the responses kept


def text_chars(value: Any) -> int:
    """The characters of every string (and key) in a JSON-like value."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return total


class ResponseStore:
    """The last ``size`` stored responses (fewer when they hold more than ``chars``
    characters of text), each with its conversation as chat messages."""

    def __init__(self, size: int = STORE_SIZE, chars: int = STORE_CHARS):
        self.size = size
        self.chars = chars
        self.held = 0  # characters of text in the entries
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, messages: list[dict]) -> None:
        chars = text_chars(response) + text_chars(messages)
        old = self._entries.pop(response["id"], None)
        if old is not None:
            self.held -= old[2]
        self._entries[response["id"]] = (response, messages, chars)
        self.held += chars
        while len(self._entries) > self.size or (self.held > self.chars and len(self._entries) > 1):
            self.held -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        return entry[0], entry[1]
