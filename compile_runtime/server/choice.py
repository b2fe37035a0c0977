"""One choice of a server request: its incremental text (``engine/incremental_text.py``), the
stream of its engine request, its logprobs and how far it has been streamed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from compile_runtime.engine.async_engine import FinishEvent, RequestStream, TokenEvent
from compile_runtime.engine.incremental_text import IncrementalText


@dataclass
class Choice(IncrementalText):
    index: int = 0
    stream: RequestStream | None = None
    logprobs: list[Any] = field(default_factory=list)  # per token, when asked for
    sent_tokens: int = 0  # token ids already streamed
    text_offset: int = 0  # characters of the streamed tokens' logprob texts (text_offset)
    finish_reason: str | None = None

    def add(self, event: TokenEvent) -> None:
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        if self.add_token(event.token, event.stop_token):
            self.finish_reason = "stop"  # stop_reason: the string

    def finish(self, event: FinishEvent) -> None:
        self.flush()
        if self.finish_reason is None:
            self.finish_reason = event.reason
            self.stop_reason = event.stop_reason  # a stop token id, or None

    def new_tokens(self) -> tuple[list[int], list[Any]]:
        """The token ids not streamed yet and their logprobs (empty when not asked for)."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return self.token_ids[start:], self.logprobs[start : self.sent_tokens]
