"""``/v1/responses`` through the OpenAI SDK's own ``responses.create`` and stream helper:
plain, streamed, ``text.format`` json_schema, a forced function tool, ``auto`` calls parsed
out of text, ``previous_response_id`` and the store. The tiny random model is steered with
vLLM's ``structured_outputs`` extra where an answer must be known."""

from __future__ import annotations

import json

import pytest
from serving import RunningServer, chat_model_dir, get, no_whitespace

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "name": "weather", "parameters": CITY}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("responses")))
    auto = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    s = RunningServer(model, *auto, "--max-model-len", "512")
    yield s
    s.stop()


def distinct(types: list[str]) -> list[str]:
    """``types`` with runs of one type as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_plain_response_equals_the_chat_completion(server):
    said = "the sky is blue"
    steer = {"structured_outputs": {"choice": [said]}}
    r = server.client.responses.create(model=server.model, input="what colour is the sky?",
                                       instructions="answer briefly", temperature=0,
                                       max_output_tokens=40, extra_body=steer)  # fmt: skip
    assert r.status == "completed" and r.output_text == said
    assert r.id.startswith("resp_") and r.output[0].type == "message"
    chat = server.client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=40, extra_body=steer,
        messages=[{"role": "system", "content": "answer briefly"},
                  {"role": "user", "content": "what colour is the sky?"}],
    )  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    cut = server.client.responses.create(model=server.model, input="hi", max_output_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_streamed_events_in_order_and_the_same_text(server):
    steer = {"structured_outputs": {"choice": ["streamed words here"]}}
    whole = server.client.responses.create(model=server.model, input="say it", temperature=0,
                                           max_output_tokens=40, extra_body=steer)  # fmt: skip
    with server.client.responses.stream(model=server.model, input="say it", temperature=0,
                                        max_output_tokens=40, extra_body=steer) as stream:  # fmt: skip
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert distinct(types) == TEXT_EVENTS
    assert types.count("response.output_text.delta") > 1  # piece by piece
    assert final.output_text == whole.output_text == "streamed words here"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema(server):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = server.client.responses.create(model=server.model, input="a city?", temperature=0,
                                       max_output_tokens=60, text={"format": fmt},
                                       extra_body={"logit_bias": no_whitespace(server)})  # fmt: skip
    assert json.loads(r.output_text)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_tool(server, stream):
    choice = {"type": "function", "name": "weather"}
    fields = dict(model=server.model, input="weather in Paris?", tools=[WEATHER],
                  tool_choice=choice, temperature=0, max_output_tokens=60,
                  extra_body={"logit_bias": no_whitespace(server)})  # fmt: skip
    if stream:
        with server.client.responses.stream(**fields) as s:
            types = [event.type for event in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.done" in types
        assert types.index("response.output_item.added") < types.index(
            "response.function_call_arguments.delta"
        )
    else:
        r = server.client.responses.create(**fields)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "weather" and set(json.loads(call.arguments)) == {"city"}


def test_auto_tool_choice_parses_the_written_call(server):
    r = server.client.responses.create(
        model=server.model, input="weather in Paris?", tools=[WEATHER], temperature=0,
        max_output_tokens=400, extra_body={"structured_outputs": {"choice": [CALL]}},
    )  # fmt: skip
    (call,) = r.output
    assert call.type == "function_call" and call.name == "weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_previous_response_id_continues_the_conversation(server):
    first = server.client.responses.create(
        model=server.model, input="remember: blue", temperature=0, max_output_tokens=40,
        extra_body={"structured_outputs": {"choice": ["ok"]}},
    )  # fmt: skip
    second = server.client.responses.create(
        model=server.model, input="what did I say?", previous_response_id=first.id,
        temperature=0, max_output_tokens=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chat = server.client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=5, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "remember: blue"},
                  {"role": "assistant", "content": "ok"},
                  {"role": "user", "content": "what did I say?"}],
    )  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert server.client.responses.retrieve(first.id).output_text == "ok"


def test_store_false_keeps_nothing_and_unknown_ids_are_404(server):
    r = server.client.responses.create(model=server.model, input="hi", store=False,
                                       max_output_tokens=2)  # fmt: skip
    assert get(f"{server.url}/v1/responses/{r.id}")[0] == 404
    status, body = server.post("/v1/responses", {"model": server.model, "input": "x",
                                                 "previous_response_id": "resp_nope"})  # fmt: skip
    assert status == 404 and body["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
    ],
)
def test_fields_it_cannot_honour_are_400_naming_them(server, fields, param):
    status, body = server.post("/v1/responses", {"model": server.model, "input": "x", **fields})
    assert status == 400 and body["error"]["param"] == param


def test_real_model_responses_equal_its_chat_completions(gguf_path):
    """SmolLM2 (the GGUF file): a response, whole and streamed through the SDK's helper, has
    the chat completion's text; a follow-up with previous_response_id sees the first turn."""
    s = RunningServer(gguf_path, "--max-model-len", "1024")
    try:
        client = s.client
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=s.model, messages=question,
                                              temperature=0, max_tokens=24)  # fmt: skip
        r = client.responses.create(model=s.model, input=question, temperature=0,
                                    max_output_tokens=24)  # fmt: skip
        assert r.output_text == chat.choices[0].message.content and r.output_text
        with client.responses.stream(model=s.model, input=question, temperature=0,
                                     max_output_tokens=24) as stream:  # fmt: skip
            types = distinct([event.type for event in stream])
            final = stream.get_final_response()
        assert types == TEXT_EVENTS and final.output_text == r.output_text
        follow = client.responses.create(model=s.model, input="And of Italy?", temperature=0,
                                         previous_response_id=r.id, max_output_tokens=24)  # fmt: skip
        turns = question + [{"role": "assistant", "content": r.output_text},
                            {"role": "user", "content": "And of Italy?"}]  # fmt: skip
        again = client.chat.completions.create(model=s.model, messages=turns, temperature=0,
                                               max_tokens=24)  # fmt: skip
        assert follow.output_text == again.choices[0].message.content
    finally:
        s.stop()
