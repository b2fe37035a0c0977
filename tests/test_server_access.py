"""Who may use the server and how much one request may ask: API keys (401 in OpenAI's
shape, the probes open), CORS only for the origins given, and the bounds on body size,
prompts and choices (4xx naming the field and the flag)."""

from __future__ import annotations

import http.client
import json

import pytest
from serving import RunningServer, get
from serving import http as http_call

from compile_runtime.server.api_keys import ApiKeyAuth, api_keys

openai = pytest.importorskip("openai")  # serving.py skips this module without it first

KEYS = ("first-key", "second-key")
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(model_dirs):
    flags = ["--api-key", KEYS[0], "--api-key", KEYS[1], "--allowed-origins", f'["{ORIGIN}"]',
             "--max-request-body-bytes", "4096", "--max-prompts-per-request", "4",
             "--max-choices-per-request", "6"]  # fmt: skip
    running = RunningServer(model_dirs("llama"), *flags)
    yield running
    running.stop()


def call(server, path: str, body: dict | bytes | None = None, headers: dict | None = None,
         method: str | None = None) -> tuple[int, dict, dict]:  # fmt: skip
    """(status, JSON body or {}, headers) of one request with ``headers``."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method or ("POST" if data is not None else "GET"), path, data, sent)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        parsed = json.loads(text) if text else {}
    except json.JSONDecodeError:
        parsed = {}
    return response.status, parsed, {k.lower(): v for k, v in response.getheaders()}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong-key"),
        bearer(KEYS[0] + "x"),
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": KEYS[0]},
        bearer(""),
    ],  # fmt: skip
)
def test_without_a_right_key_every_route_is_a_401(server, headers):
    for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": []}), ("/tokenize", {"prompt": "a"}),
                       ("/v1/no-such-route", None)):  # fmt: skip
        status, error, got = call(server, path, body, headers)
        assert status == 401, path
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == 401
        assert "--api-key" in error["error"]["message"] and got["www-authenticate"] == "Bearer"


def test_each_key_lets_in_and_the_probes_stay_open(server):
    for key in KEYS:
        assert call(server, "/v1/models", headers=bearer(key))[0] == 200
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert get(server.url + path)[0] == 200, path
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0)
    out = client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens <= 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_answers_the_allowed_origin_only(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, _, headers = call(server, "/v1/completions", headers=preflight, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, _, headers = call(
        server, "/v1/models", headers={**preflight, "Origin": "https://evil.example"},
        method="OPTIONS",
    )  # fmt: skip
    assert status == 400 and "access-control-allow-origin" not in headers
    _, _, headers = call(server, "/v1/models", headers={"Origin": ORIGIN, **bearer(KEYS[0])})
    assert headers["access-control-allow-origin"] == ORIGIN


def test_a_body_over_the_bound_is_a_413_sized_or_chunked(server):
    body = {"model": server.model, "prompt": "x" * 5000, "max_tokens": 1}
    status, error, _ = call(server, "/v1/completions", body, bearer(KEYS[0]))
    assert status == 413 and "--max-request-body-bytes" in error["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    chunks = (b" " * 1024 for _ in range(8))  # no Content-Length: counted as it arrives
    conn.request("POST", "/v1/completions", chunks, {**bearer(KEYS[0]),
                 "Content-Type": "application/json"}, encode_chunked=True)  # fmt: skip
    response = conn.getresponse()
    assert response.status == 413 and b"4096" in response.read()
    conn.close()


def test_prompts_and_choices_per_request_are_bounded(server):
    def complete(**fields) -> tuple[int, dict]:
        body = {"model": server.model, "max_tokens": 1, **fields}
        return call(server, "/v1/completions", body, bearer(KEYS[0]))[:2]

    status, error = complete(prompt=["a"] * 5)
    assert status == 400 and error["error"]["param"] == "prompt"
    assert "--max-prompts-per-request" in error["error"]["message"]
    for fields in ({"prompt": "a", "n": 7}, {"prompt": ["a", "b", "c"], "n": 3},
                   {"prompt": [[1, 2]] * 4, "n": 2}, {"prompt": "a", "n": 10**12}):  # fmt: skip
        status, error = complete(**fields)
        assert status == 400 and error["error"]["param"] == "n", fields
        assert "--max-choices-per-request" in error["error"]["message"]
    status, body = complete(prompt=["a", "b", "c"], n=2)  # 6: at the bound
    assert status == 200 and len(body["choices"]) == 6
    status, error, _ = call(
        server, "/v1/chat/completions",
        {"model": server.model, "messages": [{"role": "user", "content": "a"}], "n": 7},
        bearer(KEYS[0]),
    )  # fmt: skip
    assert status == 400 and error["error"]["param"] == "n"


def test_keys_come_from_the_flag_else_the_environment():
    assert api_keys(["a"], {"VLLM_API_KEY": "b"}) == ["a"]
    assert api_keys(None, {"VLLM_API_KEY": "b"}) == ["b"]
    assert api_keys(None, {"COMPILE_RUNTIME_API_KEY": "c"}) == ["c"]
    assert api_keys(None, {}) == []
    with pytest.raises(ValueError, match="empty key"):
        api_keys([" "], {})
    auth = ApiKeyAuth(None, ["k"])
    assert auth.allows(b"Bearer k") and auth.allows(b"bearer k")
    assert not auth.allows(b"Bearer k2") and not auth.allows(b"Token k") and not auth.allows(b"")


def test_an_open_server_sends_no_cors_headers(model_dirs):
    server = RunningServer(model_dirs("llama"))
    try:
        _, _, headers = call(server, "/v1/models", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in headers
        assert http_call(server.url + "/v1/models")[0] == 200  # no key needed
    finally:
        server.stop()
