"""The server's incremental detokenizing (server/choice.py Choice): the same text as decoding
every token at once, one short window per token, so linear in the output's length."""

from __future__ import annotations

import random

import pytest

from compile_runtime.engine.async_engine import TokenEvent
from compile_runtime.models.gguf import gguf_model_dir
from compile_runtime.models.smollm2 import smollm2_gguf
from compile_runtime.server.choice import Choice

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
        choice = Choice(tokenizer, [])
        for t in ids:
            choice.add(TokenEvent(t))
            assert tokenizer.decode(ids[: len(choice.token_ids)]).startswith(choice.text)
        choice.flush()
        assert choice.text == SentencePieceLike().decode(ids)


def test_each_token_decodes_a_short_window_not_the_whole_output():
    tokenizer = SentencePieceLike()
    choice = Choice(tokenizer, [])
    ids = [0, 1, 2, 8] * 50  # plain ASCII: no window waits for more tokens
    for t in ids:
        choice.add(TokenEvent(t))
    assert choice.text == SentencePieceLike().decode(ids)
    assert tokenizer.decoded_tokens <= 4 * len(ids)  # decoding everything: ~len(ids)**2 / 2


def test_stop_string_cuts_the_incremental_text():
    tokenizer = SentencePieceLike()
    choice = Choice(tokenizer, ["sat"])
    for t in (0, 1, 2, 8):
        choice.add(TokenEvent(t))
        if choice.finish_reason == "stop":
            break
    assert choice.text == "thecat " and choice.finish_reason == "stop"


# ---- the real model's tokenizer (byte-level BPE): 2,000 tokens, decodes counted ----------

# ASCII, two-byte (é), three-byte (東) and four-byte (😀, split over several tokens) characters.
TEXT = "The café served crème brûlée 😀🎉 to friends from 東京, naïve señor! "
STOP = "fin 東京"  # not in TEXT: found once, in the middle of the output
N = 2000
IDS_PER_TOKEN = 8  # decoding the whole text at every token: about N / 2 per token


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_model_dir(smollm2_gguf()))


class CountingTokenizer:
    """A tokenizer that counts its decode calls and the token ids they decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0
        self.ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(ids: list[int], tokenizer, stop: list[str]) -> tuple[Choice, str]:
    """The choice after its tokens arrive one by one, and the text it streamed (as the
    server does: a stop string ends the request, its end flushes what was held back)."""
    choice = Choice(tokenizer, stop)
    pieces = []
    for t in ids:
        choice.add(TokenEvent(t))
        if choice.finish_reason == "stop":
            break
        pieces.append(choice.ready_text(final=False))
    else:
        choice.flush()
    pieces.append(choice.ready_text(final=True))
    return choice, "".join(pieces)


def output_streams(tok) -> dict[str, list[int]]:
    emoji = tok("😀")["input_ids"]
    assert len(emoji) > 1 and tok.decode(emoji[:1]).endswith("\ufffd")  # split bytes
    rng = random.Random(0)
    return {
        "text": tok(TEXT * 100)["input_ids"][:N],
        "random ids": [rng.randrange(len(tok)) for _ in range(N)],  # special ones too
        # A model stuck on one byte: every window ends in part of a character, for ever.
        "repeated lead bytes": emoji[:1] * N,
        "repeated continuation byte": emoji[-1:] * N,
    }


@pytest.mark.parametrize(
    "kind", ["text", "random ids", "repeated lead bytes", "repeated continuation byte"]
)
def test_2000_tokens_detokenize_in_linear_decodes(tokenizer, kind):
    ids = output_streams(tokenizer)[kind]
    assert len(ids) == N
    counting = CountingTokenizer(tokenizer)
    choice, streamed = stream(ids, counting, stop=[])
    assert choice.text == streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.ids <= IDS_PER_TOKEN * N
    assert counting.calls <= 2 * N + 2  # a window and its context per token, at most


def test_stop_string_in_the_middle_of_2000_tokens(tokenizer):
    ids = tokenizer(TEXT * 33 + "🎉 " + STOP + TEXT * 40)["input_ids"][:N]  # at ~1,000
    assert len(ids) == N
    full = tokenizer.decode(ids)
    counting = CountingTokenizer(tokenizer)
    choice, streamed = stream(ids, counting, stop=[STOP, "nowhere"])
    assert choice.finish_reason == "stop"
    assert choice.text == streamed == full[: full.index(STOP)]
    assert N // 3 < len(choice.token_ids) < N  # it stopped where the stop string arrived
    assert counting.ids <= IDS_PER_TOKEN * len(choice.token_ids)
