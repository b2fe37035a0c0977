"""A request's text as its tokens arrive: incremental detokenizing and stop strings.

Each token costs a decode of a few recent tokens (prefix/read offsets, as the incremental
detokenizers of vLLM and HF tokenizers keep), never of the whole output, so a text is
linear in its length and equals decoding all its tokens at once. The offline ``LLM`` and
the server both use it, so a stop string ends a request the same way in either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# A UTF-8 character is at most 4 bytes and a token at least one: a window still ending in
# part of a character after 4 tokens holds invalid bytes (a full decode shows them as
# "\ufffd" too) or a token that straddles two characters. It is taken as it is rather than
# waited on (waiting could last the whole output: decoding it again at every token); the
# next window mends a "\ufffd" that its tokens complete.
MAX_HELD_TOKENS = 4


@dataclass
class IncrementalText:
    tokenizer: Any
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far, cut at a stop string
    sent: int = 0  # characters of text already handed out (ready_text)
    stop_reason: str | None = None  # the stop string the text ended at
    # token_ids[prefix:read] were decoded last time, as context for the next ones (a
    # token's text can depend on the token before it).
    prefix: int = 0
    read: int = 0
    hidden: int = 0  # 1: the last token is the stop token, not decoded

    def add_token(self, token: int, stop_token: bool = False) -> bool:
        """Take one more token; True when the text has reached a stop string. ``stop_token``:
        the stop token that ends the request, whose text is left out unless
        ``include_stop_str_in_output`` (vLLM's rule); its id is kept."""
        self.token_ids.append(token)
        if stop_token and not self.include_stop_str_in_output:
            self.hidden = 1
        self._text_until_stop(final=False)
        return self.stop_reason is not None

    def flush(self) -> None:
        """At the request's end: the text still held back (partial characters too)."""
        self._text_until_stop(final=True)

    def _text_until_stop(self, final: bool) -> None:
        if self.stop_reason is not None:
            return
        changed = self.decode_new_tokens(final)
        if changed is None:
            return
        for s in self.stop:  # only where the text changed: the rest was searched before
            at = self.text.find(s, max(0, changed - len(s) + 1))
            if at != -1:
                self.text = self.text[: at + len(s) if self.include_stop_str_in_output else at]
                self.stop_reason = s
                return

    def decode_new_tokens(self, final: bool = False) -> int | None:
        """Bring ``text`` up to the tokens received; returns where it changed (None: not).

        The window ``token_ids[prefix:]`` is decoded with the context ``token_ids[prefix:read]``:
        the new tokens add what the window has past the context. Where the new tokens changed
        the context's own text (they complete a character it ended with), the text's end is
        mended from that point. Unless ``final``, a window ending in part of a character
        waits for more tokens, up to ``MAX_HELD_TOKENS``.
        """
        ids = self.token_ids[: len(self.token_ids) - self.hidden]
        if self.tokenizer is None or self.read == len(ids):
            return None
        window = self._decode(ids[self.prefix :])
        if not final and window.endswith("\ufffd") and len(ids) - self.read < MAX_HELD_TOKENS:
            return None
        context = self._decode(ids[self.prefix : self.read])
        same = len(os.path.commonprefix([context, window]))
        if not self.text.endswith(context[same:]):  # not the text's end: add past its length
            same = len(context)
        start = len(self.text) - (len(context) - same)
        self.text = self.text[:start] + window[same:]
        self.prefix, self.read = self.read, len(ids)
        return start

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def ready_text(self, final: bool) -> str:
        """Text not handed out yet, holding back what may still become a stop string or is
        a partial character."""
        end = len(self.text)
        if not final and self.stop_reason is None:
            if self.text.endswith("\ufffd"):
                end -= 1
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.sent, end - hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece
