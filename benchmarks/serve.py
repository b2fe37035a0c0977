"""The OpenAI server under concurrent streaming clients vs offline ``LLM.generate``, same work.

The mixed workload of ``benchmarks/vs_transformers.py`` (prompts of 8-200 tokens,
8-128 output tokens each, greedy, EOS ignored so every side makes the same number
of tokens) on the Llama-shaped ~33M model, all on this machine:

* ``offline``: one ``LLM.generate`` call over every request;
* ``served``: ``compile-runtime serve`` in its own process, ``--clients`` concurrent
  streaming clients (loopback, HTTP + server-sent events) each taking the next request
  from a shared list until none is left.

Prints output tokens/s of both and their ratio, time to first token and inter-token
latency p50/p99 of the served side (from the clients' clocks), failed requests, and
the server's KV blocks in use once every client is done (from ``/metrics``). Left
out: HTTP keep-alive tuning, multiple server processes, tokenization (prompts are
token ids).

    python benchmarks/serve.py [--requests 64] [--clients 16] [--out benchmarks/results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import repo_root  # noqa: F401  (testing/ on the path)
from llama_33m import MODEL
from vs_transformers import mixed_workload

CONFIG = '{"backend": "inductor"}'
ENGINE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 512}


def offline(model_dir: str, requests) -> dict:
    import compile_runtime as cr

    llm = cr.LLM(model_dir, CONFIG, device="cpu", **ENGINE)
    params = [
        cr.SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    llm.generate([r.prompt for r in requests[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


async def clients(url: str, model: str, requests, num_clients: int, limit_s: float) -> dict:
    """Streaming clients on one asyncio loop: plain HTTP + SSE lines (httpx2, what the openai
    client uses underneath) so that the clients' own parsing takes little of the CPU the
    server shares with them."""
    import httpx2

    todo = list(range(len(requests)))
    ttft, itl, failures, tokens = [], [], [], 0
    deadline = time.perf_counter() + limit_s
    limits = httpx2.Limits(max_connections=num_clients + 4)
    http = httpx2.AsyncClient(base_url=url, timeout=600, limits=limits)

    async def one_client() -> None:
        nonlocal tokens
        while todo and time.perf_counter() < deadline:
            r = requests[todo.pop(0)]
            body = {
                "model": model,
                "prompt": r.prompt,
                "max_tokens": r.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            sent = time.perf_counter()
            last, got = None, 0
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        # One event per token (its text may be held back: a partial character).
                        n = len(json.loads(line[6:])["choices"][0].get("token_ids") or ())
                        if n:
                            if last is None:
                                ttft.append(now - sent)
                            else:
                                itl.append(now - last)
                            last, got = now, got + n
                if got != r.max_tokens:
                    raise RuntimeError(f"{got} tokens, expected {r.max_tokens}")
                tokens += got
            except Exception as e:  # noqa: BLE001 - counted and reported
                failures.append(f"{type(e).__name__}: {e}")

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(num_clients)))
    seconds = time.perf_counter() - start
    await http.aclose()
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "failed": len(failures),
        "failures": failures[:5],
        "not_sent": len(todo),
        "ttft": ttft,
        "itl": itl,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def served(model_dir: str, requests, num_clients: int, limit_s: float, extra=()) -> dict:
    """``extra``: more ``serve`` flags (e.g. ``--pipeline-parallel-size 2``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "compile_runtime.cli", "serve", "--model", model_dir]
    cmd += ["-O", CONFIG, "--device", "cpu", "--port", str(port)]
    cmd += ["--max-num-seqs", str(ENGINE["max_num_seqs"])]
    cmd += ["--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"])]
    cmd += ["--max-model-len", str(ENGINE["max_model_len"]), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{proc.stderr.read()[-3000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        asyncio.run(clients(url, model_dir, requests[:4], 4, limit_s))  # warm-up
        result = asyncio.run(clients(url, model_dir, requests, num_clients, limit_s))
        result["kv_blocks_in_use_after"] = metric(url, "compile_runtime_kv_blocks_in_use")
        result["requests_running_after"] = metric(url, "compile_runtime_requests_running")
        return result
    finally:
        proc.terminate()
        proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--limit-s", type=float, default=900.0, help="stop sending after this")
    parser.add_argument("--out", default="benchmarks/results/serve.json")
    args = parser.parse_args()

    from compile_runtime.table import format_table
    from testing.model_dirs import make_model_dir

    (workload_row,) = mixed_workload(args.requests).rows
    requests = workload_row.requests
    with tempfile.TemporaryDirectory() as root:
        os.environ.setdefault("COMPILE_RUNTIME_CACHE_DIR", os.path.join(root, "cache"))
        model_dir = make_model_dir(os.path.join(root, "model"), arch="llama", **MODEL)
        off = offline(model_dir, requests)
        srv = served(model_dir, requests, args.clients, args.limit_s)
    ms = 1e3
    rows = [
        ["offline LLM.generate", f"{off['tok_s']:.1f}", "-", "-", "-", "-", 0, "-"],
        [
            f"served, {args.clients} streaming clients",
            f"{srv['tok_s']:.1f}",
            f"{pct(srv['ttft'], 50) * ms:.0f}",
            f"{pct(srv['ttft'], 99) * ms:.0f}",
            f"{pct(srv['itl'], 50) * ms:.1f}",
            f"{pct(srv['itl'], 99) * ms:.1f}",
            srv["failed"],
            int(srv["kv_blocks_in_use_after"]),
        ],
    ]
    headers = ["side", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    print(format_table([*headers, "failed", "KV blocks after"], rows))
    print(
        f"served / offline throughput: {srv['tok_s'] / off['tok_s']:.2f} "
        f"({args.requests} requests, {off['tokens']} output tokens)"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"offline": off, "served": {**srv, "ttft": None, "itl": None}, **{
            "ttft_p50_ms": pct(srv["ttft"], 50) * ms, "ttft_p99_ms": pct(srv["ttft"], 99) * ms,
            "itl_p50_ms": pct(srv["itl"], 50) * ms, "itl_p99_ms": pct(srv["itl"], 99) * ms,
            "ratio": srv["tok_s"] / off["tok_s"], "requests": args.requests,
            "clients": args.clients}}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
