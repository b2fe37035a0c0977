"""The server's incremental detokenizing (server/app.py Choice): the same text as decoding
every token at once, one short window per token."""

from __future__ import annotations

import random

from compile_runtime.engine.async_engine import TokenEvent
from compile_runtime.server.app import Choice

# Pieces as bytes: an emoji split over three tokens, a two-byte character over two, words
# with and without a leading space.
VOCAB = [b" the", b"cat", b" sat", b"\xf0\x9f", b"\x98", b"\x80", b"\xc3", b"\xa9", b".", b" "]


class SentencePieceLike:
    """Bytes joined and decoded with replacement characters; like SentencePiece, the first
    token of a decode loses its leading space. Counts the tokens it decodes."""

    def __init__(self):
        self.decoded_tokens = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_tokens += len(ids)
        data = b"".join(VOCAB[i] for i in ids)
        text = data.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


def test_incremental_text_equals_decoding_everything():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(1, 40))]
        tokenizer = SentencePieceLike()
        choice = Choice(0, stream=None, stop=[], tokenizer=tokenizer)
        for t in ids:
            choice.add(TokenEvent(t))
            assert tokenizer.decode(ids[: len(choice.token_ids)]).startswith(choice.text)
        choice.flush()
        assert choice.text == SentencePieceLike().decode(ids)


def test_each_token_decodes_a_short_window_not_the_whole_output():
    tokenizer = SentencePieceLike()
    choice = Choice(0, stream=None, stop=[], tokenizer=tokenizer)
    ids = [0, 1, 2, 8] * 50  # plain ASCII: no window waits for more tokens
    for t in ids:
        choice.add(TokenEvent(t))
    assert choice.text == SentencePieceLike().decode(ids)
    assert tokenizer.decoded_tokens <= 4 * len(ids)  # decoding everything: ~len(ids)**2 / 2


def test_stop_string_cuts_the_incremental_text():
    tokenizer = SentencePieceLike()
    choice = Choice(0, stream=None, stop=["sat"], tokenizer=tokenizer)
    for t in (0, 1, 2, 8):
        choice.add(TokenEvent(t))
        if choice.finish_reason == "stop":
            break
    assert choice.text == "thecat " and choice.finish_reason == "stop"
