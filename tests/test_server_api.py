"""The server as a drop-in for vLLM's OpenAI server: the bodies real clients send
(vLLM's benchmark client, the OpenAI SDK with its harmless extras), vLLM's sampling extras,
fields the engine cannot honour (400s naming them), unknown fields (a warning), vLLM's extra
endpoints, OpenAI-shaped errors on every path, logprobs wherever they are asked for, finish
reasons in /metrics and the access log."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
from serving import (
    MAX_MODEL_LEN,
    RunningServer,
    chat_model_dir,
    get,
    http,
    no_whitespace,
    sse_events,
    streamed_tool_calls,
)

pytestmark = pytest.mark.slow

PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("chat")))
    s = RunningServer(model, "--max-num-seqs", "8")
    yield s
    s.stop()


def answer(server, path: str, fields: dict) -> dict:
    """A 200's body: 8 greedy tokens, EOS ignored, unless ``fields`` say otherwise."""
    body = {"model": server.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, out = server.post(path, {**body, **fields})
    assert status == 200, out
    return out


def completion(server, **fields) -> dict:
    return answer(server, "/v1/completions", {"prompt": PROMPT, **fields})


def chat(server, **fields) -> dict:
    return answer(server, "/v1/chat/completions", {"messages": MESSAGES, **fields})


def streamed(server, path: str, body: dict) -> list[dict]:
    status, text = http(server.url + path, body)
    assert status == 200, text
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    return events[:-1]


# ---- real clients ---------------------------------------------------------------------------


def test_vllm_bench_completions_body(server):
    """What vLLM 0.32's `vllm bench serve --backend openai` sends (async_request_openai_
    completions in vllm/benchmarks/lib/endpoint_request_func.py), with --ignore-eos."""
    body = {
        "model": server.model,
        "prompt": "the quick brown fox jumps over",
        "repetition_penalty": 1.0,
        "max_tokens": 10,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events = streamed(server, "/v1/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert events[-1]["usage"]["prompt_tokens"] > 0
    assert all(e["choices"][0]["text"] is not None for e in events[:-1])


def test_vllm_bench_chat_body(server):
    """What `vllm bench serve --backend openai-chat` sends (async_request_openai_chat_
    completions, its message built by _get_chat_messages), with --ignore-eos."""
    body = {
        "model": server.model,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}
        ],
        "max_completion_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events = streamed(server, "/v1/chat/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_vllm_bench_prompt_alignment_bodies(server):
    """`vllm bench serve` aligns its prompts with the server's /tokenize and /detokenize."""
    status, tokens = server.post(
        "/tokenize", {"model": server.model, "prompt": PROMPT, "add_special_tokens": False}
    )
    assert status == 200
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    status, text = server.post("/detokenize", {"model": server.model, "tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": PROMPT}


def test_openai_sdk_calls_with_harmless_extras(server):
    warned = server.log().count("ignored")
    harmless = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    response = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=4, temperature=0,
        parallel_tool_calls=False, stream_options=None, **harmless,
    )  # fmt: skip
    assert response.choices[0].finish_reason in ("length", "stop")
    stream = server.client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=4, stream=True, user="u1",
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4
    assert server.log().count("ignored") == warned  # harmless fields are not warned of


# ---- request fields -----------------------------------------------------------------------


def test_vllm_sampling_extras_are_honoured(server):
    base = completion(server, max_tokens=6)
    ids = base["choices"][0]["token_ids"]
    # stop_token_ids: ends at the token, finish "stop", stop_reason the id (as vLLM answers)
    out = completion(server, stop_token_ids=[ids[2]], max_tokens=6)["choices"][0]
    assert out["token_ids"] == ids[:3] and out["finish_reason"] == "stop"
    assert out["stop_reason"] == ids[2]
    # min_tokens holds the stop token off until then
    out = completion(server, stop_token_ids=[ids[0]], min_tokens=3, max_tokens=6)["choices"][0]
    assert len(out["token_ids"]) >= 3
    # logit_bias (string keys, as JSON has them), top_k=-1 (off), min_p 0, seeds
    out = completion(server, logit_bias={"42": 100}, top_k=-1, min_p=0.0)["choices"][0]
    assert set(out["token_ids"]) == {42}
    one = completion(server, temperature=1.0, seed=7, top_k=50, min_p=0.05)["choices"][0]
    two = completion(server, temperature=1.0, seed=7, top_k=50, min_p=0.05)["choices"][0]
    assert one["token_ids"] == two["token_ids"]
    # repetition_penalty, on chat too, with max_completion_tokens
    out = chat(server, repetition_penalty=1.3, max_completion_tokens=5, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 5


def test_stop_strings_as_vllm_takes_them(server):
    text = completion(server, max_tokens=12)["choices"][0]["text"]
    stop = text[3:6]
    kept = completion(server, max_tokens=12, stop=stop, include_stop_str_in_output=True)
    choice = kept["choices"][0]
    assert choice["text"] == text[: text.find(stop) + len(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_skip_special_tokens_false_keeps_them_in_the_text(server):
    eos = 2  # "</s>" in the tiny tokenizer
    out = completion(server, logit_bias={str(eos): 100}, max_tokens=3, skip_special_tokens=False)
    assert "</s>" in out["choices"][0]["text"]
    out = completion(server, logit_bias={str(eos): 100}, max_tokens=3)
    assert "</s>" not in out["choices"][0]["text"]


def test_unknown_fields_are_taken_with_one_warning_naming_them(server):
    completion(server, bogus_field=1, another_one={"x": 1})
    warnings = [line for line in server.log().splitlines() if "bogus_field" in line]
    assert len(warnings) == 1
    assert "present in the request but ignored" in warnings[0] and "another_one" in warnings[0]


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("chat", {"tools": [WEATHER]}, "tool_choice"),  # no tool_choice: "auto"
        ("chat", {"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ("chat", {"tool_choice": "required"}, "tools"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format"),
        ("completions", {"guided_regex": "[a"}, "guided_regex"),
        ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"use_beam_search": True}, "use_beam_search"),
        ("completions", {"suffix": " the end"}, "suffix"),
        ("completions", {"length_penalty": 2.0}, "length_penalty"),
        ("completions", {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ("completions", {"priority": 1}, "priority"),
        ("chat", {"add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("chat", {"echo": True}, "echo"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0.content.0"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_honour_is_400_naming_the_field(server, path, fields, param):
    body = {"model": server.model, "max_tokens": 4, **fields}
    body.setdefault(
        "messages" if path == "chat" else "prompt", MESSAGES if path == "chat" else PROMPT
    )
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    status, out = server.post(url, body)
    assert status == 400, out
    assert out["error"]["param"] == param and param in out["error"]["message"]


def test_neutral_values_of_those_fields_are_taken(server):
    completion(server, best_of=1, suffix=None)
    chat(server, tool_choice="none", response_format={"type": "text"}, tools=[WEATHER])


def test_choices_and_the_chat_template_fields(server):
    out = completion(server, n=2, temperature=1.0, seed=1)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 16
    body = {"model": server.model, "messages": MESSAGES}
    with_prompt = server.post("/tokenize", body)[1]["tokens"]
    without = server.post("/tokenize", {**body, "add_generation_prompt": False})[1]["tokens"]
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    answer = {"role": "assistant", "content": "la la"}
    fields = {"add_generation_prompt": False, "continue_final_message": True,
              "messages": [*MESSAGES, answer]}  # fmt: skip
    assert chat(server, **fields)["usage"]["prompt_tokens"] > len(without)


def test_a_kv_cache_too_small_for_max_model_len_names_the_flags(model_dirs):
    with pytest.raises(RuntimeError, match="--kv-cache-bytes") as info:
        RunningServer(model_dirs("llama"), "--kv-cache-bytes", "4096")
    assert "--max-model-len" in str(info.value)


# ---- structured outputs and forced tool calls ---------------------------------------------


def test_structured_outputs_on_both_endpoints(server):
    out = completion(server, guided_choice=["yes", "no"], ignore_eos=False, max_tokens=10)
    assert out["choices"][0]["text"] in ("yes", "no")
    out = completion(server, structured_outputs={"regex": "[0-9]{3}"}, ignore_eos=False)
    assert re.fullmatch("[0-9]{3}", out["choices"][0]["text"])
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    out = chat(server, response_format=response_format, logit_bias=no_whitespace(server),
               ignore_eos=False, max_tokens=60)  # fmt: skip
    assert json.loads(out["choices"][0]["message"]["content"])["a"] in ("x", "y")


@pytest.mark.parametrize(
    "tool_choice, finish",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "weather"}}, "stop")],
)
def test_forced_tool_calls_whole_and_streamed(server, tool_choice, finish):
    fields = {"tools": [WEATHER], "tool_choice": tool_choice, "ignore_eos": False,
              "max_tokens": 100, "logit_bias": no_whitespace(server), "temperature": 0}  # fmt: skip
    choice = chat(server, **fields)["choices"][0]
    assert choice["finish_reason"] == finish and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    body = {"model": server.model, "messages": MESSAGES, "stream": True, **fields}
    chunks = [
        e["choices"][0] for e in streamed(server, "/v1/chat/completions", body) if e["choices"]
    ]
    assert chunks[-1]["finish_reason"] == finish
    (streamed_call,), pieces = streamed_tool_calls(chunks)
    assert streamed_call["function"] == call["function"]  # the arguments as the model wrote them
    assert pieces > 1  # sent as they were generated


def test_the_stop_tokens_text_is_left_out_whole_and_streamed(server):
    """vLLM's rule: the token that stopped a request keeps its id, not its text."""
    body = {"model": server.model, "prompt": "%", "add_special_tokens": False}
    (percent,) = server.post("/tokenize", body)[1]["tokens"]
    fields = {"stop_token_ids": [percent], "logit_bias": {str(percent): 100}, "ignore_eos": False}
    (choice,) = completion(server, **fields, return_token_ids=True)["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", percent)
    kept = completion(server, **fields, include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == "%"
    body = {"model": server.model, "prompt": PROMPT, "stream": True, "max_tokens": 8, **fields}
    assert "".join(e["choices"][0]["text"] for e in streamed(server, "/v1/completions", body)) == ""


# ---- endpoints and errors -----------------------------------------------------------------


def test_vllm_endpoints(server):
    assert json.loads(get(server.url + "/version")[1])["version"]
    assert get(server.url + "/ping")[0] == 200
    assert http(server.url + "/ping", b"", method="POST")[0] == 200
    assert get(server.url + "/health")[0] == 200
    (card,) = json.loads(get(server.url + "/v1/models")[1])["data"]
    assert card["id"] == server.model and card["root"] == server.model
    assert card["parent"] is None and card["max_model_len"] == MAX_MODEL_LEN
    status, chat_tokens = server.post("/tokenize", {"model": server.model, "messages": MESSAGES})
    assert status == 200
    assert chat_tokens["count"] == chat(server)["usage"]["prompt_tokens"]


def error_of(status_text: tuple[int, str], status: int) -> dict:
    got, text = status_text
    assert got == status, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_errors_are_openai_shaped_on_every_path(server):
    url = server.url
    assert "no such route" in error_of(get(url + "/v1/nope"), 404)["message"]
    assert "POST" in error_of(get(url + "/v1/completions"), 405)["message"]
    error = error_of(http(url + "/v1/completions", b"{not json"), 400)
    assert "not valid JSON" in error["message"] and error["param"] is None
    body = {"model": server.model, "prompt": PROMPT, "temperature": "hot"}
    error = error_of(http(url + "/v1/completions", body), 400)
    assert error["param"] == "temperature" and "'hot'" in error["message"]
    body = {"model": server.model, "prompt": PROMPT, "top_p": 0}
    error = error_of(http(url + "/v1/completions", body), 400)
    assert error["param"] == "top_p" and error["message"].startswith("top_p")


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("completions", {"max_tokens": 1000}, "max_tokens"),
        ("completions", {"prompt": "hello " * 200}, "prompt"),
        ("chat", {"max_completion_tokens": 1000}, "max_completion_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "hi " * 200}]}, "messages"),
    ],
)
def test_too_long_names_the_field_and_the_limit(server, path, fields, param):
    body = {"model": server.model, "max_tokens": 4, **fields}
    body.setdefault(
        "messages" if path == "chat" else "prompt", MESSAGES if path == "chat" else PROMPT
    )
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    error = error_of(http(url, body), 400)
    assert error["param"] == param and error["message"].startswith(param)
    assert str(MAX_MODEL_LEN) in error["message"]
    assert "request '" not in error["message"]


# ---- logprobs -----------------------------------------------------------------------------


def check_chosen_among_top(tokens: list[str], tops: list[dict], k: int) -> None:
    for token, top in zip(tokens, tops, strict=True):
        assert token in top and k <= len(top) <= k + 1


def test_completion_logprobs_whole_and_streamed(server):
    """Sampled (so the chosen token is often not the most likely): it is always among the
    top logprobs; the stream's chunks carry the same logprobs as the whole response."""
    fields = {"logprobs": 1, "temperature": 1.5, "seed": 3, "max_tokens": 10}
    whole = completion(server, **fields)["choices"][0]["logprobs"]
    check_chosen_among_top(whole["tokens"], whole["top_logprobs"], 1)
    offsets = [sum(len(t) for t in whole["tokens"][:i]) for i in range(len(whole["tokens"]))]
    assert whole["text_offset"] == offsets
    body = {"model": server.model, "prompt": PROMPT, "stream": True, "ignore_eos": True, **fields}
    chunks = [e["choices"][0]["logprobs"] for e in streamed(server, "/v1/completions", body)]
    joined = {key: [v for c in chunks for v in c[key]] for key in whole}
    assert joined == whole


def test_chat_logprobs_whole_and_streamed(server):
    fields = {"logprobs": True, "top_logprobs": 2, "temperature": 1.5, "seed": 3}
    out = chat(server, **fields)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 8
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8", errors="replace"))
        assert entry["token"] in [t["token"] for t in entry["top_logprobs"]]
        assert 2 <= len(entry["top_logprobs"]) <= 3
    # the same numbers as /v1/completions gives for the same token ids
    ids = out["choices"][0]["token_ids"]
    body = {"model": server.model, "messages": MESSAGES}
    prompt = server.post("/tokenize", body)[1]["tokens"]
    scored = completion(server, prompt=prompt, logprobs=2, logit_bias={str(ids[0]): 100},
                        max_tokens=1)["choices"][0]["logprobs"]  # fmt: skip
    assert scored["tokens"][0] == content[0]["token"]
    assert scored["token_logprobs"][0] == pytest.approx(content[0]["logprob"], abs=1e-4)
    body = {"model": server.model, "messages": MESSAGES, "stream": True, "max_tokens": 8,
            "ignore_eos": True, **fields}  # fmt: skip
    events = streamed(server, "/v1/chat/completions", body)
    joined = [c for e in events for c in e["choices"][0]["logprobs"]["content"]]
    assert joined == content


def test_prompt_logprobs_as_vllm_returns_them(server):
    out = completion(server, prompt_logprobs=2, max_tokens=2)["choices"][0]
    prompt = server.post("/tokenize", {"model": server.model, "prompt": PROMPT})[1]["tokens"]
    plp = out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for token, entry in zip(prompt[1:], plp[1:], strict=True):
        assert str(token) in entry and {"logprob", "rank", "decoded_token"} <= set(
            entry[str(token)]
        )


# ---- metrics and the access log -----------------------------------------------------------


def finished(server, reason: str) -> float:
    return server.metric(f'compile_runtime_requests_finished_total{{finish_reason="{reason}"')


def test_finish_reasons_in_metrics_as_they_happened(server):
    before = {r: finished(server, r) for r in ("stop", "length", "abort")}
    text = completion(server, max_tokens=12)["choices"][0]["text"]
    completion(server, max_tokens=12, stop=[text[3:6]])
    deadline = time.time() + 10  # the engine loop ends the stopped request after the answer
    while finished(server, "stop") == before["stop"] and time.time() < deadline:
        time.sleep(0.05)
    after = {r: finished(server, r) for r in ("stop", "length", "abort")}
    assert after["length"] == before["length"] + 1
    assert after["stop"] == before["stop"] + 1
    assert after["abort"] == before["abort"]


def access_lines(server, count: int) -> list[str]:
    """The access log's completion lines, once there are ``count`` (each is written once its
    response's last byte is sent: the client may read that first)."""
    deadline = time.time() + 10
    while True:
        lines = [line for line in server.log().splitlines() if '"POST /v1/completions"' in line]
        if len(lines) >= count or time.time() > deadline:
            return lines
        time.sleep(0.05)


def test_one_access_log_line_per_request(server):
    before = len(access_lines(server, 0))
    out = completion(server, max_tokens=5)
    lines = access_lines(server, before + 1)
    assert len(lines) == before + 1 and lines[-1].startswith("INFO")
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert re.search(
        rf'"POST /v1/completions" 200 prompt_tokens={prompt_tokens} completion_tokens=5 '
        r"[0-9.]+s$",
        lines[-1],
    )
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "stream": True,
            "ignore_eos": True}  # fmt: skip
    streamed(server, "/v1/completions", body)
    lines = access_lines(server, before + 2)
    assert len(lines) == before + 2 and "completion_tokens=3" in lines[-1]
