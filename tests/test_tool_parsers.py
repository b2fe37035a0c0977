"""``tool_choice="auto"``: the model family's tool-call syntax parsed out of free text
(``server/tool_parsers.py``), whole and as a stream cut anywhere."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from compile_runtime.server.tool_parsers import HermesParser, Llama3JsonParser, tool_call_parser
from compile_runtime.server.tools import AUTO, tool_constraint

PARIS = '{"name": "weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "time", "arguments": {"zone": "CET"}}'


def calls_of(parsed):
    content, calls = parsed
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (f"<tool_call>\n{PARIS}\n</tool_call>", None, [("weather", {"city": "Paris"})]),
        (
            f"Let me look.\n<tool_call>{PARIS}</tool_call>\n<tool_call>{ROME}</tool_call>",
            "Let me look.\n\n",
            [("weather", {"city": "Paris"}), ("time", {"zone": "CET"})],
        ),
        (f"<tool_call>{PARIS}", None, [("weather", {"city": "Paris"})]),  # EOS before the end tag
        ("no call here", "no call here", []),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        (
            f"<tool_call>oops</tool_call> then <tool_call>{PARIS}</tool_call>",
            "<tool_call>oops</tool_call> then ",
            [("weather", {"city": "Paris"})],
        ),
    ],
)
def test_hermes_calls_and_content(text, content, calls):
    assert calls_of(HermesParser().parse(text)) == (content, calls)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '{"name": "weather", "parameters": {"city": "Paris"}}',
            None,
            [("weather", {"city": "Paris"})],
        ),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
            None,
            [("a", {}), ("b", {"x": 1})],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        (
            '{"name": "a", "parameters": {}} and text',
            '{"name": "a", "parameters": {}} and text',
            [],
        ),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, not a call
    ],
)
def test_llama3_json_calls_and_content(text, content, calls):
    assert calls_of(Llama3JsonParser().parse(text)) == (content, calls)


def stream(parser, text: str, cuts: list[int]) -> str:
    """The content a stream sends, fed ``text`` in pieces split at ``cuts`` (chat_completions'
    rule: what ``streamable`` allows, then the rest of the parsed content at the end)."""
    sent, released, at = "", "", 0
    for cut in sorted(cuts) + [len(text)]:
        released += text[at:cut]
        at = cut
        upto = max(len(sent), parser.streamable(released))
        assert released[: len(sent)] == sent  # nothing sent is ever taken back
        sent = released[:upto]
    content = parser.parse(text)[0] or ""
    assert content.startswith(sent), (sent, content)
    return sent + content[len(sent) :]


TEXTS = [
    f"Checking.<tool_call>{PARIS}</tool_call>",
    f"<tool_call>{PARIS}</tool_call><tool_call>{ROME}</tool_call> done",
    "a < b <tool_ and <tool_call>broken",
    "plain text, <tool but no call",
    '{"name": "a", "parameters": {}}',
    "<|python_tag|> text",
    'text first {"name": "a"}',
]


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 80), max_size=12), st.booleans())
def test_a_stream_cut_anywhere_sends_exactly_the_content(text, cuts, llama):
    parser = Llama3JsonParser() if llama else HermesParser()
    cuts = [min(c, len(text)) for c in cuts]
    assert stream(parser, text, cuts) == (parser.parse(text)[0] or "")


def test_hermes_holds_back_what_may_start_a_call():
    parser = HermesParser()
    assert parser.streamable("Hello <tool") == len("Hello ")
    assert parser.streamable("Hello <tool_call>{") == len("Hello ")
    assert parser.streamable("a < b") == len("a < b")


def test_auto_needs_a_parser_and_a_known_name():
    assert tool_constraint([{"function": {"name": "f"}}], "auto", auto_enabled=True) == (None, AUTO)
    assert tool_call_parser(None) is None
    with pytest.raises(ValueError, match="hermes"):
        tool_call_parser("mistral2")


def _streamed(find, text: str, cuts: list[int]) -> tuple[list[dict], list[dict]]:
    """The calls a stream's deltas add up to, cut at ``cuts``, and the deltas."""
    from compile_runtime.server.tool_call_text import CallDeltas

    deltas, tracker = [], CallDeltas()
    for end in [*sorted(set(cuts)), len(text)]:
        deltas += tracker.update(find(text[:end]))
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)], deltas


ARGS = '{"city": "Pa\\"ris", "days": [1, 2]}'
STREAMED = [
    ("hermes", f"Let me look.<tool_call>{PARIS}</tool_call><tool_call>{ROME}</tool_call>"),
    ("hermes", f'<tool_call>{{"name": "weather", "arguments": {ARGS}}}'),
    ("llama3_json", f'<|python_tag|>{{"name": "weather", "parameters": {ARGS}}}; {ROME}'),
]


@pytest.mark.parametrize("name, text", STREAMED)
@given(cuts=st.lists(st.integers(0, 120), max_size=12))
def test_streamed_call_deltas_add_up_to_the_whole_answers_calls(name, text, cuts):
    parser = tool_call_parser(name)
    calls, deltas = _streamed(parser.stream_calls, text, cuts)
    whole = [c["function"] for c in parser.parse(text)[1]]
    assert calls == whole and whole
    assert [d["index"] for d in deltas if "id" in d] == list(range(len(whole)))


@pytest.mark.parametrize("forced", [None, "weather"])
@given(cuts=st.lists(st.integers(0, 90), max_size=12))
def test_forced_call_deltas_add_up_to_the_whole_answers_calls(forced, cuts):
    from compile_runtime.server.tools import constrained_calls, tool_calls

    text = ARGS if forced else f'[{{"name": "weather", "parameters": {ARGS}}}, ' \
        '{"name": "time", "parameters": {}}]'  # fmt: skip
    calls, _ = _streamed(lambda t: constrained_calls(t, forced), text, cuts)
    whole = [c["function"] for c in tool_calls(text, forced)]
    assert calls == whole
    assert whole[0]["arguments"] == ARGS  # as written, not re-serialized
