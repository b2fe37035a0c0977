"""``tool_choice="auto"`` on a served model (``--enable-auto-tool-choice --tool-call-parser
hermes``): the calls the model writes in its own syntax come back as ``tool_calls``, whole and
streamed. The tiny random model is made to write a call with a choice constraint (the
constraint and the parser are independent), so the answer is known."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serving import RunningServer, chat_model_dir, http, sse_events, streamed_tool_calls

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("chat")))
    auto = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    s = RunningServer(model, *auto, "--max-model-len", "512")  # a call is 66+ tokens
    yield s
    s.stop()


def body(server, said: str, **fields) -> dict:
    """A chat request whose answer is ``said`` exactly (then EOS)."""
    return {"model": server.model, "messages": MESSAGES, "tools": [WEATHER], "temperature": 0,
            "max_tokens": 400, "structured_outputs": {"choice": [said]}, **fields}  # fmt: skip


@pytest.mark.parametrize("before", ["", "Let me check. "])
def test_a_written_call_comes_back_as_tool_calls(server, before):
    status, out = server.post("/v1/chat/completions", body(server, before + CALL))
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == (before or None)
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    status, text = http(
        server.url + "/v1/chat/completions", body(server, before + CALL, stream=True)
    )
    assert status == 200, text
    chunks = [e["choices"][0] for e in sse_events(text)[:-1] if e["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == before  # none of the call's text leaks into the content
    (streamed_call,), pieces = streamed_tool_calls(chunks)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert streamed_call["function"] == call["function"] and pieces > 1


def test_text_without_a_call_is_the_content(server):
    status, out = server.post("/v1/chat/completions", body(server, "It is sunny <tool"))
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "It is sunny <tool"
    status, text = http(
        server.url + "/v1/chat/completions", body(server, "It is sunny <tool", stream=True)
    )
    chunks = [e["choices"][0] for e in sse_events(text)[:-1] if e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "It is sunny <tool"


def test_auto_tool_choice_needs_a_parser():
    cmd = [sys.executable, "-m", "compile_runtime.cli", "serve", "--model", "x"]
    out = subprocess.run([*cmd, "--enable-auto-tool-choice"], capture_output=True, text=True)
    assert out.returncode == 2 and "--tool-call-parser" in out.stderr
