"""One choice of a server request: its incremental text (``engine/incremental_text.py``), the
stream of its engine request, its logprobs and how far it has been streamed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compile_runtime.engine.async_engine import RequestStream, TokenEvent
from compile_runtime.engine.incremental_text import IncrementalText


@dataclass
class Choice(IncrementalText):
    index: int = 0
    stream: RequestStream | None = None
    logprobs: list[Any] = field(default_factory=list)
    sent_tokens: int = 0  # token ids already streamed
    finish_reason: str | None = None

    def add(self, event: TokenEvent) -> None:
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        if self.add_token(event.token):
            self.finish_reason = "stop"

    def new_token_ids(self) -> list[int]:
        ids = self.token_ids[self.sent_tokens :]
        self.sent_tokens = len(self.token_ids)
        return ids
