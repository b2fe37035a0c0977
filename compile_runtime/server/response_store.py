"""The responses ``/v1/responses`` keeps (``store``): the last ``STORE_SIZE``, each with its
conversation as chat messages, for ``previous_response_id`` and ``GET /v1/responses/{id}``.
In memory: a restart forgets them, as vLLM's store does."""

from __future__ import annotations

from collections import OrderedDict

from compile_runtime.server.api_error import APIError

STORE_SIZE = 1000  # responses kept for previous_response_id / GET


class ResponseStore:
    """The last ``size`` stored responses, each with its conversation as chat messages."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, messages: list[dict]) -> None:
        self._entries[response["id"]] = (response, messages)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        return entry
