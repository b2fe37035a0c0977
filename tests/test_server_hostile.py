"""The server under hostile input: every body below was once a 500, a 200 with garbage or a
stall; each is now a 400 in OpenAI's error shape naming the field, with no traceback in the
log, and ``/health`` answers while hostile requests are in flight. The limits' own pieces
(schema bounds, chat template arguments, adapter paths, the body byte budget, the worker
pool's time bound, the 500 body) are checked without a server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import statistics
import threading
import time

import pytest

pytest.importorskip("fastapi")
from serving import RunningServer, chat_model_dir, get, http

from compile_runtime.server import validation
from compile_runtime.server.api_error import APIError

SERVED = "tiny"
M = [{"role": "user", "content": "hi"}]


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_schema_bytes(depth: int) -> bytes:
    """A response_format whose schema nests ``depth`` objects (as bytes: too deep for the
    json module to write)."""
    head = b'{"type": "object", "properties": {"a": ' * depth
    return (
        b'{"type": "json_schema", "json_schema": {"name": "x", "schema": %s{"type": "string"}%s}}'
        % (
            head,
            b"}}" * depth,
        )
    )


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_root")
    os.symlink("/etc", root / "escape")  # a link inside the root to a directory outside it
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory, lora_root):
    model = chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("hostile")))
    running = RunningServer(
        model, "--served-model-name", SERVED, "--max-num-seqs", "8", "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
        "--lora-root", str(lora_root),
    )  # fmt: skip
    running.model = SERVED
    yield running
    running.stop()


def raw(server, path: str, body: bytes | dict) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text = http(server.url + path, data)
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def assert_400(answer: tuple[int, dict | str], param: str) -> dict:
    status, body = answer
    assert status == 400, (status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").startswith(param), (param, error)
    assert "Traceback" not in error["message"] and "compile_runtime." not in error["message"]
    return error


CHAT = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f"}}
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
CASES = [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 42}]}]}, "messages"),
    (CHAT, {"messages": M, "response_format": {"type": "json_schema", "json_schema": "zzz"}},
     "response_format"),
    (CHAT, {"messages": M, "response_format": {"type": "yaml"}}, "response_format"),
    (RESPONSES, {"input": "hi", "text": {"format": "json"}}, "text"),
    (RESPONSES, {"input": "hi", "text": [1]}, "text"),
    (RESPONSES, {"input": "hi", "n": "x"}, "n"),
    (RESPONSES, {"input": "hi", "stop": {"a": 1}}, "stop"),
    (RESPONSES, {"input": "hi", "top_k": 0.5}, "top_k"),
    (RESPONSES, {"input": "hi", "messages": 5}, "messages"),
    (RESPONSES, {"input": "hi", "presence_penalty": 3}, "presence_penalty"),
    (RESPONSES, {"input": "", "max_output_tokens": 0}, "max_output_tokens"),  # its own name
    (COMPLETIONS, {"prompt": "hi", "best_of": {"a": 1}}, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": "hi\ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": ["hi", "\ud800"]}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "model": "\ud800"}, "model"),
    (CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    (CHAT, {"messages": M, "chat_template_kwargs": {"return_tensors": "pt"}},
     "chat_template_kwargs"),
    (CHAT, {"messages": M, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": M, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}},
     "chat_template_kwargs"),
    (CHAT, {"messages": M, "chat_template": "{% for i in range(99999) %}{% endfor %}"},
     "chat_template"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 1e308}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": float("nan")}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": float("inf")}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": float("-inf")}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x" * (15 << 20)}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "guided_choice": [str(i) for i in range(20000)]},
     "guided_choice"),
    (COMPLETIONS, {"prompt": "hi", "guided_grammar": "root ::= " + '"a" ' * 10000},
     "guided_grammar"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a" * 20000}},
     "structured_outputs"),
    (CHAT, {"messages": M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_schema(11)}}}, "response_format"),
    (CHAT, {"messages": M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(5001)}}}}}, "response_format"),
    (CHAT, {"messages": M, "tools": [{"type": "function", "function": {"name": 5}}]}, "tools"),
    (CHAT, {"messages": M, "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": 3}]}]}, "messages"),
    (COMPLETIONS, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    (CHAT, {"messages": M, "stop": "x" * 1025}, "stop"),
    (RESPONSES, {"input": "hi", "stop": ["a", "x" * 1025]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": list(range(1025))}, "stop_token_ids"),
    (CHAT, {"messages": M, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (CHAT, {"messages": M, "tools": [TOOL] * 129}, "tools"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 129}, "tools"),
    ("/tokenize", {"messages": M, "tools": [TOOL] * 129}, "tools"),
    (CHAT, {"messages": M * 4097}, "messages"),
    ("/tokenize", {"messages": M * 4097}, "messages"),
    (RESPONSES, {"input": M * 4097}, "input"),
    (RESPONSES, {"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    (RESPONSES, {"input": "hi", "include": ["message.output_text.logprobs"] * 17}, "include"),
    ("/detokenize", {"tokens": [1] * ((1 << 20) + 1)}, "tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=lambda v: str(v)[:40])
def test_hostile_bodies_are_400s_naming_the_field(server, path, body, param):
    assert_400(raw(server, path, {"model": server.model, **body}), param)


def test_a_schema_nested_500_deep_is_refused_at_once(server):
    body = (
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": %s}'
    )
    for depth, param in [(200, "response_format"), (500, "")]:  # 500: too deep for JSON
        start = time.monotonic()
        answer = raw(server, CHAT, body % (SERVED.encode(), deep_schema_bytes(depth)))
        assert time.monotonic() - start < 5
        assert_400(answer, param)


def test_limits_at_their_bound_are_served(server):
    schema = nested_schema(validation.MAX_SCHEMA_DEPTH)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for path, body in [
        (CHAT, {"messages": M, "response_format": fmt, "max_tokens": 2}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "guided_choice": ["a", "b"] * 500}),
        (CHAT, {"messages": M, "max_tokens": 2, "chat_template_kwargs": {
            "enable_thinking": False, "add_generation_prompt": True}}),
        (RESPONSES, {"input": "hi", "max_output_tokens": 2, "top_k": 3, "min_p": 0.1,
                     "repetition_penalty": 1.1, "stop": ["x"]}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "best_of": 1, "presence_penalty": 2,
                       "frequency_penalty": -2, "logit_bias": {"5": -100}}),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1024] * 16,
                       "stop_token_ids": [7] * 1024, "logit_bias": {str(i): 0 for i in range(500)}}),
        (CHAT, {"messages": M * 2, "max_tokens": 2, "tools": [TOOL] * 128, "tool_choice": "none"}),
        (RESPONSES, {"input": "hi", "max_output_tokens": 2,
                     "metadata": {str(i): "v" for i in range(16)}}),
    ]:  # fmt: skip
        status, out = raw(server, path, {"model": server.model, **body})
        assert status == 200, (path, body, out)


def test_lora_paths_outside_the_root_or_missing_are_one_answer(server, lora_root):
    messages = set()
    for path in ["/etc", "../../etc", str(lora_root / "escape"), "escape", "nope", "empty",
                 str(lora_root / "empty"), "/proc/self"]:  # fmt: skip
        error = assert_400(
            raw(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}),
            "lora_path",
        )
        messages.add(error["message"].replace(path[:200], "PATH"))
    assert messages == {"lora_path: no LoRA adapter is available at 'PATH'"}


def test_model_card_and_404_name_no_path(server):
    status, text = get(server.url + "/v1/models")
    card = json.loads(text)["data"][0]
    assert status == 200 and card["id"] == card["root"] == SERVED
    status, body = raw(server, COMPLETIONS, {"model": "nope", "prompt": "hi"})
    assert status == 404 and "/" not in body["error"]["message"].replace("GET /v1/models", "")


def test_health_answers_while_hostile_requests_are_in_flight(server):
    """8 senders of slow or hostile bodies (a schema at the bounds, a 2 MB prompt, a huge
    grammar, a template loop, valid generations) while /health is polled."""
    wide = {f"p{i}": {"type": "string"} for i in range(validation.MAX_SCHEMA_PROPERTIES)}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": wide}}}  # fmt: skip
    hostile = [
        (CHAT, {"messages": M, "response_format": fmt, "max_tokens": 1}),
        (COMPLETIONS, {"prompt": "x" * (2 << 20)}),
        (COMPLETIONS, {"prompt": "hi", "guided_choice": [str(i) for i in range(20000)]}),
        (CHAT, {"messages": M, "chat_template": "{% for i in range(99999) %}{% endfor %}"}),
        (COMPLETIONS, {"prompt": [[1, 2, 3]] * 8, "max_tokens": 16, "ignore_eos": True}),
        (CHAT, {"messages": M, "max_tokens": 16, "ignore_eos": True, "stream": True}),
        ("/tokenize", {"prompt": "hello " * 200}),
        (RESPONSES, {"input": "hi", "max_output_tokens": 16}),
    ]
    stop = threading.Event()
    statuses: list[int] = []

    def send(job):
        path, body = job
        while not stop.is_set():
            statuses.append(raw(server, path, {"model": server.model, **body})[0])

    with concurrent.futures.ThreadPoolExecutor(len(hostile)) as pool:
        futures = [pool.submit(send, job) for job in hostile]
        time.sleep(0.5)
        latencies = []
        for _ in range(40):
            start = time.monotonic()
            assert get(server.url + "/health")[0] == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
        stop.set()
        for f in futures:
            f.result(120)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health under 8 hostile senders: median {statistics.median(latencies) * 1000:.1f} ms,"
          f" p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms; {len(statuses)} requests")  # fmt: skip
    assert p99 < 1.0, latencies  # a shared CI machine: the bound is loose, the report exact
    assert statuses and all(s in (200, 400) for s in statuses), sorted(set(statuses))
    assert 200 in statuses


def test_the_log_has_no_traceback_for_client_errors(server):
    log = server.log()
    assert "Traceback" not in log, log[-3000:]


# Pieces without a server.


def test_schema_bounds():
    validation.check_schema(nested_schema(validation.MAX_SCHEMA_DEPTH), "s")
    with pytest.raises(ValueError, match="levels"):
        validation.check_schema(nested_schema(validation.MAX_SCHEMA_DEPTH + 1), "s")
    with pytest.raises(ValueError, match="levels"):  # through anyOf and items too
        validation.check_schema({"anyOf": [{"items": nested_schema(10)}]}, "s")
    with pytest.raises(ValueError, match="enum"):
        validation.check_schema({"enum": list(range(1001))}, "s")
    with pytest.raises(ValueError, match="not valid JSON"):
        validation.check_schema("[" * 100000, "s")
    refs = {"$defs": {"n": nested_schema(9)}, "$ref": "#/$defs/n"}
    validation.check_schema(refs, "s")  # a definition starts at the first level again


def test_list_bounds_at_and_past_them():
    from pydantic import ValidationError

    from compile_runtime.server import protocol as p

    def body(cls, **fields):
        base = {"prompt": "a"} if cls is p.CompletionRequest else {"messages": M}
        return cls(**(base | fields))

    at = validation.MAX_LOGIT_BIAS
    for cls, field, value, past in [
        (p.CompletionRequest, "stop", ["x" * validation.MAX_STOP_CHARS] * 16, ["x"] * 17),
        (p.ChatCompletionRequest, "stop", "x" * 1024, "x" * 1025),
        (p.CompletionRequest, "stop_token_ids", [1] * 1024, [1] * 1025),
        (p.ChatCompletionRequest, "logit_bias", {str(i): 1 for i in range(at)},
         {str(i): 1 for i in range(at + 1)}),
        (p.ChatCompletionRequest, "tools", [TOOL] * validation.MAX_TOOLS, [TOOL] * 129),
        (p.TokenizeRequest, "tools", [TOOL] * 128, [TOOL] * 129),
        (p.ChatCompletionRequest, "messages", M * validation.MAX_MESSAGES, M * 4097),
    ]:  # fmt: skip
        body(cls, **{field: value})
        with pytest.raises(ValidationError, match="this server takes at most"):
            body(cls, **{field: past})
    p.ResponsesRequest(input=M * 4096, metadata={str(i): 1 for i in range(16)}, include=["a"] * 16)
    for fields in ({"input": M * 4097}, {"metadata": {str(i): 1 for i in range(17)}},
                   {"include": ["a"] * 17}):  # fmt: skip
        with pytest.raises(ValidationError, match="this server takes at most"):
            p.ResponsesRequest(**({"input": "a"} | fields))
    with pytest.raises(ValidationError, match="this server takes at most"):
        p.DetokenizeRequest(tokens=[1] * (validation.MAX_DETOKENIZE_TOKENS + 1))


def test_unencodable_text_is_found_anywhere():
    assert validation.unencodable({"a": ["ok", {"b": "x\ud800"}]}) == "a.1.b"
    assert validation.unencodable({"k\udc00": 1}) == "body"
    assert validation.unencodable({"a": ["é", "日本"]}) is None
    with pytest.raises(APIError) as e:
        validation.check_encodable({"prompt": ["a", "\ud800"]})
    assert e.value.status == 400 and e.value.param == "prompt"


class Tok:
    chat_template = "{{ messages[0]['content'] }}{% if flavour %}{{ flavour }}{% endif %}"


def test_chat_template_arguments():
    from compile_runtime.server.chat_template import template_arguments

    kwargs, overrides = template_arguments(
        {"flavour": "x", "enable_thinking": False, "add_generation_prompt": False}, None, Tok(),
        trust=False,
    )  # fmt: skip
    assert kwargs == {"flavour": "x"} and overrides == {"add_generation_prompt": False}
    for bad in ("return_tensors", "tokenize", "return_dict", "tokenizer_kwargs", "padding"):
        with pytest.raises(APIError, match=bad):
            template_arguments({bad: 1}, None, Tok(), trust=True)
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        template_arguments({"chat_template": "{{ 1 }}"}, None, Tok(), trust=False)
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        template_arguments(None, "{{ 1 }}", Tok(), trust=False)
    kwargs, _ = template_arguments({"v": 1}, "{{ v }}", Tok(), trust=True)
    assert kwargs == {"v": 1, "chat_template": "{{ v }}"}


def test_runtime_adapter_paths(tmp_path):
    from compile_runtime.server.lora_modules import runtime_adapter_path

    root = tmp_path / "root"
    good = root / "good"
    good.mkdir(parents=True)
    (good / "adapter_config.json").write_text("{}")
    (good / "adapter_model.safetensors").write_bytes(b"x" * 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (outside / "adapter_model.safetensors").write_bytes(b"x")
    os.symlink(outside, root / "link")
    leaky = root / "leaky"
    leaky.mkdir()
    (leaky / "adapter_config.json").write_text("{}")
    os.symlink(outside / "adapter_model.safetensors", leaky / "adapter_model.safetensors")
    assert runtime_adapter_path("good", str(root)) == str(good)
    assert runtime_adapter_path(str(good), str(root)) == str(good)
    for path in ("link", str(outside), "leaky", "../outside", "missing"):
        with pytest.raises(APIError, match="no LoRA adapter is available"):
            runtime_adapter_path(path, str(root))
    with pytest.raises(APIError, match="no LoRA adapter is available"):
        runtime_adapter_path("good", str(root), max_bytes=50)
    with pytest.raises(APIError, match="--lora-root"):
        runtime_adapter_path("good", None)


def test_byte_budget_and_worker_pool_bounds():
    from compile_runtime.server.request_limits import ByteBudget
    from compile_runtime.server.worker_pool import WorkerPool

    async def budget():
        b = ByteBudget(100)
        assert await b.acquire(60, 1) and await b.acquire(40, 1)
        assert not await b.acquire(10, 0.05)  # full: waits, then gives up
        waiter = asyncio.ensure_future(b.acquire(10, 5))
        await b.release(40)
        assert await waiter and b.used == 70
        assert await b.acquire(10**9, 0.05) is False  # counted as the whole budget

    async def pool():
        p = WorkerPool(workers=1, timeout_s=0.2)
        assert await p.run(sum, [1, 2], what="adding", param=None) == 3
        with pytest.raises(APIError) as slow:
            await p.run(time.sleep, 1, what="sleeping", param="prompt")
        assert slow.value.status == 400 and slow.value.param == "prompt"
        with pytest.raises(APIError) as busy:  # the one worker still sleeps
            await p.run(sum, [1], what="adding", param=None)
        assert busy.value.status == 503
        p.shutdown()

    async def interrupted():  # a template loop is stopped at the bound: the worker is free
        import jinja2.sandbox

        p = WorkerPool(workers=1, timeout_s=0.2)
        loop = "{% for i in range(99999) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
        render = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(loop).render
        with pytest.raises(APIError) as slow:
            await p.run(render, what="rendering", param="messages", interrupt=True)
        assert slow.value.status == 400
        start = time.monotonic()
        assert await p.run(sum, [1], what="adding", param=None) == 1
        assert time.monotonic() - start < 0.1
        p.shutdown()

    asyncio.run(budget())
    asyncio.run(pool())
    asyncio.run(interrupted())


def test_a_500_carries_a_request_id_not_the_exception(caplog):
    from fastapi import FastAPI

    from compile_runtime.server.errors import add_error_handlers

    app = FastAPI()
    add_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret /etc/shadow detail")

    sent: list[dict] = []

    async def call():
        scope = {"type": "http", "method": "GET", "path": "/boom", "raw_path": b"/boom",
                 "query_string": b"", "headers": [], "http_version": "1.1", "scheme": "http",
                 "server": ("t", 80), "client": ("c", 1), "root_path": ""}  # fmt: skip

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        with pytest.raises(RuntimeError):  # starlette re-raises after answering
            await app(scope, receive, send)

    with caplog.at_level(logging.ERROR, logger="compile_runtime.server.errors"):
        asyncio.run(call())
    assert sent[0]["status"] == 500
    error = json.loads(sent[1]["body"])["error"]
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    request_id = error["message"].split("request id ")[1].split(")")[0]
    record = next(r for r in caplog.records if request_id in r.getMessage())
    assert record.exc_info is not None and "secret" in str(record.exc_info[1])


def test_a_trusted_request_template_renders_and_its_loop_is_stopped(model_dirs, tmp_path):
    model = chat_model_dir(model_dirs("llama"), str(tmp_path))
    running = RunningServer(model, "--trust-request-chat-template", "--max-prepare-seconds", "1")
    try:
        body = {"model": model, "messages": M, "chat_template_kwargs": {"who": "me"}}
        status, out = raw(running, "/tokenize", {**body, "chat_template": "{{ who }}!"})
        assert status == 200 and out["count"] >= 1, out
        loop = "{% for i in range(99999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}"
        start = time.monotonic()
        assert_400(raw(running, CHAT, {**body, "chat_template": loop}), "messages")
        assert time.monotonic() - start < 5
        assert get(running.url + "/health")[0] == 200
        status, out = raw(running, CHAT, {**body, "max_tokens": 2})
        assert status == 200, out
        # A grammar slower to compile than the bound: a 400, its process killed.
        wide = {f"p{i}": {"type": "string"} for i in range(validation.MAX_SCHEMA_PROPERTIES)}
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": wide}}}  # fmt: skip
        error = assert_400(raw(running, CHAT, {**body, "response_format": fmt}), "response_format")
        assert "--max-prepare-seconds" in error["message"]
        fmt["json_schema"]["schema"] = nested_schema(3)
        status, out = raw(running, CHAT, {**body, "response_format": fmt, "max_tokens": 2})
        assert status == 200, out
    finally:
        running.stop()
