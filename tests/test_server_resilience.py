"""The server as an operator runs it: its worker killed under load (the requests on it fail
at once, the workers come back, the tokens are the same), past the restart budget (the
process exits non-zero), and SIGTERM with streams in flight (they finish, new ones get a
503, exit 0)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.request

import pytest
from serving import STANDBY_PROCESS_NAME, RunningServer, get, wait_for, worker_pids

from compile_runtime.engine import worker_restarts
from compile_runtime.engine.worker_restarts import WorkerDeath, WorkerRestarts

PROMPTS = [f"request number {i} says" for i in range(8)]


def test_restarts_retry_with_a_doubling_wait_within_the_budget(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(worker_restarts.time, "sleep", waits.append)
    outcomes = iter([OSError("port in use"), OSError("port in use"), None, None])

    def restart() -> None:
        if (error := next(outcomes)) is not None:
            raise error

    restarts = WorkerRestarts(restart, max_restarts=4, backoff_s=0.5)
    first, second, third = (WorkerDeath(f"rank 0 died ({i})", i) for i in range(3))
    assert restarts.recover(first) and restarts.attempts == 3 and waits == [0.5, 1.0]
    assert first.restart_seconds is not None
    assert restarts.recover(second) and restarts.attempts == 4 and not restarts.can_restart
    assert not restarts.recover(third) and third.restart_seconds is None
    assert restarts.restarted == 0  # ``deaths`` is the engine's to record
    restarts.deaths += [first, second, third]
    assert restarts.restarted == 2
    assert not WorkerRestarts(None).recover(first)  # nothing to restart: never


def complete_all(server: RunningServer, max_tokens: int = 12) -> list[str]:
    def one(prompt: str) -> str:
        out = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


class Stream(threading.Thread):
    """One streamed completion read line by line: when its first chunk came, its chunks,
    any error event and when it came, and whether it ended with ``[DONE]``."""

    def __init__(self, server: RunningServer, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        self.request = urllib.request.Request(
            server.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        self.started = threading.Event()
        self.chunks: list[dict] = []
        self.error: dict | None = None
        self.error_at: float | None = None
        self.done = False

    def run(self) -> None:
        with urllib.request.urlopen(self.request, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error, self.error_at = event["error"], time.monotonic()
                    else:
                        self.chunks.append(event)
                        self.started.set()

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"] if self.chunks else None


def start_streams(server: RunningServer, n: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(server, f"stream {i} goes", max_tokens) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120), "a stream got no first chunk"
    return streams


@pytest.mark.slow
def test_worker_killed_mid_stream_fails_its_requests_and_comes_back(model_dirs):
    server = RunningServer(model_dirs("llama"), "--max-num-seqs", "8", "--max-model-len", "512")
    try:
        before = complete_all(server)
        standby = lambda: worker_pids(server.proc.pid, STANDBY_PROCESS_NAME)  # noqa: E731
        wait_for(lambda: len(standby()) == 1, 60, "a standby process")
        (spare,) = standby()
        streams = start_streams(server, 8, max_tokens=480)
        held = concurrent.futures.ThreadPoolExecutor(1).submit(
            server.post, "/v1/completions",
            {"model": server.model, "prompt": "queued behind the batch", "max_tokens": 4},
        )  # fmt: skip
        time.sleep(0.2)  # the whole request is queued: the batch is full
        (pid,) = worker_pids(server.proc.pid)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: get(server.url + "/health")[0] == 503, 2, "/health 503 at once")
        for s in streams:
            s.join(30)
            assert s.error is not None and s.done, "a stream did not end with an error"
            assert s.error_at - killed < 5
            assert "workers died" in s.error["message"] and "SIGKILL" in s.error["message"]
            assert s.error["code"] == 500 and s.finish_reason is None
        status, body = held.result(30)  # the request still queued fails the same way
        assert status == 500 and "rank 0 died" in body["error"]["message"]

        wait_for(lambda: get(server.url + "/health")[0] == 200, 120, "/health 200 again")
        assert worker_pids(server.proc.pid) == [spare]  # the restart took the standby
        wait_for(lambda: len(standby()) == 1, 60, "a new standby process")
        assert complete_all(server) == before  # the same greedy tokens as before the fault
        assert server.metric("compile_runtime_worker_deaths_total") == 1
        assert server.metric("compile_runtime_worker_restarts_total") == 1
        assert server.metric("compile_runtime_requests_failed_by_worker_death_total") == 9
        assert server.metric("compile_runtime_kv_blocks_in_use") == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_past_the_restart_budget_the_server_exits_nonzero(model_dirs):
    server = RunningServer(model_dirs("llama"), "--max-worker-restarts", "0")
    try:
        (pid,) = worker_pids(server.proc.pid)
        os.kill(pid, signal.SIGKILL)  # idle: the engine sees it without a request
        assert server.proc.wait(60) == 1
        log = server.log()
        assert "rank 0 died" in log and "not restarted" in log
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_drains_32_streams_and_exits_0(model_dirs):
    server = RunningServer(model_dirs("llama"), "--max-num-seqs", "32", "--max-model-len", "512")
    try:
        streams = start_streams(server, 32, max_tokens=400)
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: get(server.url + "/health")[0] == 503, 10, "/health 503 (draining)")
        status, body = server.post("/v1/completions", {"model": server.model, "prompt": "late"})
        assert status == 503 and "shutting down" in body["error"]["message"]
        for s in streams:
            s.join(120)
            assert s.done and s.error is None and s.finish_reason == "length"
            assert sum(len(c["choices"][0]["text"]) > 0 for c in s.chunks) > 0
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_past_the_shutdown_timeout_the_rest_is_aborted(model_dirs):
    server = RunningServer(model_dirs("llama"), "--shutdown-timeout", "0", "--max-model-len", "512")
    try:
        streams = start_streams(server, 4, max_tokens=480)
        server.proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(60)
            assert s.done and s.finish_reason == "abort"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
