"""A real `compile-runtime serve` on 127.0.0.1 for the server tests: start, wait, talk, stop.

The server's output goes to a file (read by `RunningServer.log`), never to a pipe nobody
drains: its access log writes a line per request.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

# What a served test needs beyond the package (the OpenAI client, the `serve` extra): a test
# module importing this one is skipped where one is missing, not a collection error.
pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
import openai

from compile_runtime.executor.standby import STANDBY_PROCESS_NAME  # noqa: F401 (for callers)
from compile_runtime.worker.worker import WORKER_PROCESS_PREFIX

CONFIG = '{"backend": "eager"}'
MAX_MODEL_LEN = 128
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: bytes | dict | None = None, method: str | None = None):
    """(status, text) of one request; a dict body is sent as JSON."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url: str) -> tuple[int, str]:
    return http(url)


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    status, text = http(url, body)
    return status, json.loads(text)


def sse_events(text: str) -> list[dict | str]:
    """A server-sent event stream's payloads: JSON bodies, and the final ``[DONE]``."""
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def no_whitespace(server) -> dict[str, int]:
    """A logit_bias that keeps a random model from JSON whitespace (it would loop on it)."""
    body = {"model": server.model, "prompt": " \n\t\r", "add_special_tokens": False}
    return {str(t): -100 for t in server.post("/tokenize", body)[1]["tokens"]}


def streamed_tool_calls(choices: list[dict]) -> tuple[list[dict], int]:
    """The tool calls a stream's choice deltas add up to, as the OpenAI SDK accumulates them
    (``index`` picks the call; ``id``, ``type`` and the name come once, the arguments in
    pieces), and how many argument pieces there were."""
    calls: dict[int, dict] = {}
    pieces = 0
    for choice in choices:
        for delta in choice["delta"].get("tool_calls") or []:
            call = calls.get(delta["index"])
            if call is None:
                assert {"id", "type"} <= set(delta) and "name" in delta["function"]
                call = calls[delta["index"]] = {"id": delta["id"], "type": delta["type"],
                                                "function": dict(delta["function"])}  # fmt: skip
            else:
                assert "id" not in delta and "name" not in delta["function"]
                call["function"]["arguments"] += delta["function"]["arguments"]
            pieces += bool(delta["function"].get("arguments"))
    return [calls[i] for i in sorted(calls)], pieces


def chat_model_dir(model_dir: str, root: str) -> str:
    """A copy of a tiny model with ``CHAT_TEMPLATE`` in its tokenizer config."""
    path = os.path.join(root, "model")
    shutil.copytree(model_dir, path)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path


def serve_like_offline(model_dir: str, root: str, *flags: str) -> RunningServer:
    """A server of ``model_dir`` (with a chat template) started with ``flags``, after checking
    that 8 concurrent greedy completions from it equal one offline engine's; the caller
    stops it."""
    import concurrent.futures

    import compile_runtime as cr

    model = chat_model_dir(model_dir, root)
    texts = ["hello world", "the quick brown fox", "one two three", "a compiler turns"] * 2
    params = cr.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with cr.LLM(model, CONFIG, max_model_len=MAX_MODEL_LEN, max_num_seqs=8) as one:
        want = [o.outputs[0].text for o in one.generate(texts, params, use_tqdm=False)]
    server = RunningServer(model, *flags, "--max-num-seqs", "8")

    def complete(prompt: str) -> str:
        out = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    try:
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            assert list(pool.map(complete, texts)) == want
        assert server.metric("compile_runtime_requests_finished_total") == len(texts)
    except BaseException:
        server.stop()
        raise
    return server


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it holds; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def worker_pids(parent: int, name_prefix: str = WORKER_PROCESS_PREFIX) -> list[int]:
    """The model's worker processes under ``parent`` (not its resource tracker nor its
    standby processes: ``name_prefix=STANDBY_PROCESS_NAME`` gives those), whichever of its
    threads started them (a restart runs on the engine's thread)."""
    children = []
    for task in os.listdir(f"/proc/{parent}/task"):
        with open(f"/proc/{parent}/task/{task}/children") as f:
            children += [int(pid) for pid in f.read().split()]
    pids = []
    for pid in children:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip().startswith(name_prefix):
                pids.append(pid)
    return pids


class RunningServer:
    def __init__(self, model_dir: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_dir
        cmd = [sys.executable, "-m", "compile_runtime.cli", "serve", "--model", model_dir]
        cmd += ["-O", CONFIG, "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN)]
        self.output = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=self.output, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                output = self.log()
                os.unlink(self.output.name)
                raise RuntimeError(f"the server exited: {output[-3000:]}")
            try:
                if get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError("the server did not come up in 180 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def log(self) -> str:
        """Everything the server wrote so far (stdout and stderr)."""
        with open(self.output.name) as f:
            return f.read()

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        return post(self.url + path, body)

    def metric(self, name: str) -> float:
        _, text = get(self.url + "/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.output.name)
