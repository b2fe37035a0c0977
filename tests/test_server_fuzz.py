"""Request bodies generated from the OpenAI schemas, right and wrong (types, huge numbers,
huge arrays, deep nesting, prompts past ``max_model_len``): every answer is a 2xx or a 4xx
naming what was wrong, never a 5xx, and the server stays up and answers quickly, so no
number a client sent made it allocate in proportion."""

from __future__ import annotations

import collections
import http.client
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serving import RunningServer, get

HUGE = st.sampled_from([10**6, 2**31, 2**63, 10**30, -(2**63), -1, 0])
NUMBERS = st.one_of(st.integers(-5, 300), HUGE, st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def deep(field: str, depth: int) -> bytes:
    """A body whose ``field`` is nested ``depth`` lists deep (as bytes: too deep for the
    ``json`` module to write)."""
    return b'{"%s": %s"x"%s}' % (field.encode(), b"[" * depth, b"]" * depth)


# Each field: a plausible value or anything at all.
SAMPLING = {
    "max_tokens": st.integers(1, 6) | NUMBERS,
    "temperature": st.sampled_from([0, 0.7]) | NUMBERS,
    "top_p": st.floats(0.1, 1) | NUMBERS,
    "top_k": st.integers(-1, 50) | NUMBERS,
    "min_p": NUMBERS,
    "n": st.integers(1, 3) | NUMBERS,
    "seed": NUMBERS,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | ANY_JSON,
    "stream": st.booleans() | ANY_JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | ANY_JSON,
    "logit_bias": st.dictionaries(st.integers(-3, 300).map(str), NUMBERS, max_size=4) | ANY_JSON,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "repetition_penalty": NUMBERS,
    "min_tokens": st.integers(0, 4) | NUMBERS,
    "stop_token_ids": st.lists(st.integers(-3, 300), max_size=3) | ANY_JSON,
    "ignore_eos": st.booleans() | ANY_JSON,
    "prompt_logprobs": st.integers(0, 3) | NUMBERS,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]) | ANY_JSON,
    "structured_outputs": st.sampled_from([{"choice": ["a", "b"]}, {"regex": "[ab]+"}]) | ANY_JSON,
    "best_of": NUMBERS,
    "user": ANY_JSON,
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.text(max_size=30)
    | st.lists(st.integers(-5, 400), max_size=200)
    | st.lists(st.text(max_size=5), max_size=4)
    | ANY_JSON,
    "logprobs": st.integers(0, 5) | NUMBERS,
    "echo": st.booleans() | ANY_JSON,
    "suffix": ANY_JSON,
}
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | ANY_JSON,
        "content": st.text(max_size=20) | ANY_JSON,
    },  # fmt: skip
)
CHAT = {
    **SAMPLING,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3) | ANY_JSON,
    "logprobs": st.booleans() | ANY_JSON,
    "top_logprobs": st.integers(0, 5) | NUMBERS,
    "max_completion_tokens": st.integers(1, 6) | NUMBERS,
    "tools": ANY_JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | ANY_JSON,
}

ITEM = st.one_of(
    MESSAGE.map(lambda m: {"type": "message", **m}),
    st.fixed_dictionaries({"type": st.just("function_call")},
                          optional={"call_id": ANY_JSON, "name": ANY_JSON, "arguments": ANY_JSON}),
    st.fixed_dictionaries({"type": st.just("function_call_output")},
                          optional={"call_id": ANY_JSON, "output": ANY_JSON}),
    st.dictionaries(st.sampled_from(["type", "role", "content", "text"]), ANY_JSON, max_size=3),
)  # fmt: skip
RESPONSES = {
    "input": st.text(max_size=20) | st.lists(ITEM, min_size=1, max_size=3) | ANY_JSON,
    "instructions": st.text(max_size=10) | ANY_JSON,
    "max_output_tokens": st.integers(1, 6) | NUMBERS,
    "temperature": st.sampled_from([0, 0.7]) | NUMBERS,
    "top_p": NUMBERS,
    "top_logprobs": NUMBERS,
    "tools": ANY_JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | ANY_JSON,
    "text": st.sampled_from([{"format": {"type": "json_object"}}]) | ANY_JSON,
    "previous_response_id": ANY_JSON,
    "store": st.booleans() | ANY_JSON,
    "stream": st.booleans() | ANY_JSON,
    "truncation": ANY_JSON,
    "background": ANY_JSON,
}


def bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """A body with the required field and any subset of the others."""
    optional = {k: v for k, v in fields.items() if k != required}
    return st.fixed_dictionaries({required: fields[required]}, optional=optional)


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    from serving import chat_model_dir

    model = chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("fuzz")))
    running = RunningServer(model, "--max-choices-per-request", "8", "--max-num-seqs", "8")
    yield running
    running.stop()


def send(server, path: str, body: object) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, text = response.status, response.read().decode()
    conn.close()
    return status, text


SEEN: collections.Counter[int] = collections.Counter()  # statuses the generated bodies got


def check_answer(status: int, text: str, body: object) -> None:
    """2xx, or a 4xx whose message names a field of the body (or says the body is bad)."""
    SEEN[status] += 1
    assert status < 500 or status == 503, f"{status} for {body!r}: {text[:500]}"
    if status >= 400:
        error = json.loads(text)["error"]
        assert error["message"] and "Traceback" not in error["message"]
        named = error["param"] or error["message"]
        if isinstance(body, dict) and body:
            assert any(key in named for key in body) or "body" in named, (body, error)
    elif '"stream": true' in json.dumps(body) and text.startswith("data:"):
        for line in text.splitlines():  # an error inside a stream is still the client's
            if line.startswith("data: {") and '"error"' in line[:20]:
                assert json.loads(line[6:])["error"]["code"] < 500, line


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=bodies(COMPLETION, "prompt"))
@example(body={"prompt": "hi", "n": 10**9})
@example(body={"prompt": "hi", "max_tokens": 10**12})
@example(body={"prompt": "hi", "logprobs": 10**6})
@example(body={"prompt": "hi", "prompt_logprobs": 10**6})
@example(body={"prompt": "hi", "top_k": 10**12, "seed": 2**64})
@example(body={"prompt": [7] * 1000})
@example(body={"prompt": [[1, 2]] * 10**4})
@example(body={"prompt": "hi", "logit_bias": {str(i): 1 for i in range(10**4)}})
@example(body={"prompt": "hi", "stop": ["a"] * 10**4, "max_tokens": 2})
def test_completion_bodies_get_a_2xx_or_a_4xx_naming_the_field(server, body):
    check_answer(*send(server, "/v1/completions", {"model": server.model, **body}), body)


@FUZZ
@given(body=bodies(CHAT, "messages"))
@example(body={"messages": [{"role": "user", "content": "x" * 2000}]})
@example(body={"messages": [{"role": "user", "content": "hi"}] * 10**4})
@example(body={"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 10**9,
               "logprobs": True})  # fmt: skip
def test_chat_bodies_get_a_2xx_or_a_4xx_naming_the_field(server, body):
    check_answer(*send(server, "/v1/chat/completions", {"model": server.model, **body}), body)


@FUZZ
@given(body=bodies(RESPONSES, "input"))
@example(body={"input": [{"type": "message", "role": "user", "content": 5}]})
@example(body={"input": [{"type": "function_call", "name": ["f"]}]})
def test_responses_bodies_get_a_2xx_or_a_4xx_naming_the_field(server, body):
    check_answer(*send(server, "/v1/responses", {"model": server.model, **body}), body)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
@example(raw=b"[" * 100_000 + b"]" * 100_000)
@example(raw=deep("prompt", 100_000))
@example(raw=deep("messages", 100_000))
@example(raw=deep("input", 100_000))
@example(raw=b'{"prompt": "' + b"\xff" * 100 + b'"}')
@example(raw=b'{"prompt": NaN, "max_tokens": Infinity}')
def test_bodies_that_are_not_requests_get_a_4xx(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
        status, text = send(server, path, raw)
        assert 400 <= status < 500, f"{path} {status} for {raw[:100]!r}: {text[:300]}"


def test_the_server_is_still_up_and_serving(server):
    if SEEN:  # after the generated bodies: they were both right and wrong
        assert SEEN[200] > 10 and SEEN[400] > 10, SEEN
    assert get(server.url + "/health")[0] == 200
    status, text = send(server, "/v1/completions", {"model": server.model, "prompt": "hi",
                                                   "max_tokens": 3})  # fmt: skip
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] <= 3
    assert server.metric("compile_runtime_kv_blocks_in_use") == 0
