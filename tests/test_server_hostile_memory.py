"""What the server keeps after a burst of large requests is the same after a second
identical burst: the large-body byte budget is back to zero and the C heap is trimmed once
per burst, the stored responses are bounded in count and in text, a request's long chat
template is not cached, and the grammar digests are bounded (test_server_hostile_grammar).
Counted on the structures themselves, never on the clock or the RSS."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from compile_runtime.server import chat_template, request_limits
from compile_runtime.server.response_store import ResponseStore, text_chars


def test_a_burst_of_large_bodies_leaves_the_budget_empty_and_trims_once(monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(request_limits, "_malloc_trim", lambda: trims.append(1))
    read: list[int] = []

    async def run() -> list[int]:
        go = asyncio.Event()

        async def app(scope, receive, send):
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            read.append(len(body))
            await go.wait()  # every body of the burst in flight at once
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        limit = request_limits.BodySizeLimit(app, max_bytes=16 << 20, in_flight=64 << 20)
        size = 2 << 20
        scope = {"type": "http", "headers": [(b"content-length", str(size).encode())]}

        async def one() -> int:
            sent: list[dict] = []

            async def receive():
                return {"type": "http.request", "body": b"x" * size, "more_body": False}

            async def send(message):
                sent.append(message)

            await limit(scope, receive, send)
            return sent[0]["status"]

        used = []
        for n in range(2):
            burst = [asyncio.ensure_future(one()) for _ in range(8)]
            while len(read) < 8 * (n + 1):
                await asyncio.sleep(0.001)
            in_flight = limit.budget.used
            go.set()
            assert in_flight == 8 * (2 << 20)
            assert await asyncio.gather(*burst) == [400] * 8
            go.clear()
            await asyncio.sleep(0.01)
            used.append((limit.budget.used, len(trims)))
        return used

    assert asyncio.run(run()) == [(0, 1), (0, 2)]  # empty after each burst, one trim each


def test_the_response_store_is_bounded_in_count_and_text():
    store = ResponseStore(size=50, chars=10 << 20)
    message = [{"role": "user", "content": "x" * (1 << 20)}]
    after = []
    for burst in range(2):
        for i in range(30):
            store.put({"id": f"resp_{burst}_{i}", "output": []}, message)
        after.append((len(store), store.held))
    assert after[0] == after[1]
    assert after[0][1] <= 10 << 20 and after[0][0] == 9  # 9 of 1 MiB each fit in 10 MiB
    assert store.get("resp_1_29")[1] == message
    store.put({"id": "huge"}, [{"content": "y" * (20 << 20)}])  # alone past the bound: kept
    assert len(store) == 1 and store.held == text_chars({"id": "huge"}) + (20 << 20) + 7
    small = ResponseStore(size=3)
    for i in range(10):
        small.put({"id": str(i)}, [])
    assert len(small) == 3 and small.held == 3 * 3


def test_long_request_templates_are_not_cached():
    chat_template._cached_variables.cache_clear()
    sizes = []
    for _ in range(2):
        for i in range(20):  # a request's own template, long: parsed, not kept
            pad = "{# " + "p" * chat_template.CACHED_TEMPLATE_CHARS + " #}"
            template = pad + "{{ messages }}{{ v" + str(i) + " }}"
            assert chat_template.template_variables(template) == {"messages", f"v{i}"}
        sizes.append(chat_template._cached_variables.cache_info().currsize)
    assert sizes == [0, 0]
    for i in range(40):
        chat_template.template_variables("{{ w" + str(i) + " }}")
    assert chat_template._cached_variables.cache_info().currsize == 16
    assert sorted(chat_template.template_variables("{{ a }}{{ b }}")) == ["a", "b"]
