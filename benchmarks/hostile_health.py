"""``/health`` of ``compile-runtime serve`` while hostile requests are in flight.

Starts the server (``--enable-lora --allow-runtime-lora-updating --lora-root TMP
--api-key K``, ``-O '{"backend": "eager"}'``) on the real model (SmolLM2-135M-Instruct
Q4_1 GGUF; ``--model`` another), then two phases of ``--seconds`` each:

* ``idle``: ``GET /health`` polled at ~20 Hz (one new connection per poll, as a load
  balancer's probe), each poll's latency recorded;
* ``hostile``: 8 sender threads, each looping its one request until the phase ends, and
  0.5 s later ``/health`` polled the same way. The senders, the bodies shaped as in
  ``tests/test_server_hostile.py``:

  1. ``schema-5000-props``: a chat ``response_format`` json_schema of 5000 properties (at
     the server's bound, so it is compiled; on a small machine the compile passes the
     server's time bound and ends in a 400), ``max_tokens`` 1;
  2. ``prompt-2MB``: a 2 MiB prompt to ``/v1/completions``;
  3. ``choice-20000``: ``guided_choice`` of 20,000 entries (past the bound: a 400);
  4. ``template-loop``: ``chat_template_kwargs.chat_template`` a Jinja loop of 30,000,000
     iterations (refused: the server runs without ``--trust-request-chat-template``);
  5. ``schema-depth-10``: a json_schema nested 10 deep (the bound), ``max_tokens`` 2;
  6. ``regex-16KB``: ``structured_outputs.regex`` of 16 KiB (the bound), ``max_tokens`` 1;
  7. and 8. ``valid-a``, ``valid-b``: plain chat completions, ``max_tokens`` 16, whose
     status and latency are recorded.

Prints, per phase: ``/health`` polls, p50/p99/max ms and non-200s; hostile requests sent
and their status counts; valid requests ok/total and their p50 latency; the CPU and the
exact command line on every row; then per sender its count, statuses, latency and its
first answer other than a 200 (the error's message); and
writes JSON (``--out``) and the server's log beside it.

Target (``--check``: exit 1 on a FAIL): ``/health`` p99 < 100 ms while the 8 hostile
requests are in flight, every valid request finishes (200), no 5xx, no traceback in the
server's log.

Left out: TLS, more than one server process, a reverse proxy, streaming, LoRA loads; the
client (Python threads, stdlib ``http.client``) runs on the same cores as the server, so
its own CPU use (sending 2 MiB bodies in a loop) is part of the load the server sees.

    python benchmarks/hostile_health.py [--seconds 10] [--model PATH] [--check]
        [--out benchmarks/results/hostile_health.json] [-- SERVE FLAGS...]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from decode_replay import cpu_name

from compile_runtime.table import format_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, ".models", "SmolLM2-135M-Instruct.Q4_1.gguf")
NAME = "m"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
M = [{"role": "user", "content": "hi"}]
POLL_S = 0.05  # ~20 Hz
REQUEST_TIMEOUT_S = 120.0
TARGET_P99_MS = 100.0
# The server's bounds (compile_runtime/server/validation.py), written out so that the client
# imports nothing of the server.
MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_DEPTH = 10
MAX_PATTERN_CHARS = 16 * 1024


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def senders() -> list[tuple[str, str, dict, bool]]:
    """(name, path, body, valid) of the 8 senders."""
    wide = {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_PROPERTIES)}
    loop = "{% for i in range(30000000) %}{% endfor %}"
    valid = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
    return [
        ("schema-5000-props", CHAT, {"messages": M, "max_tokens": 1,
         "response_format": json_schema({"type": "object", "properties": wide})}, False),
        ("prompt-2MB", COMPLETIONS, {"prompt": "x" * (2 << 20)}, False),
        ("choice-20000", COMPLETIONS,
         {"prompt": "hi", "guided_choice": [str(i) for i in range(20000)]}, False),
        ("template-loop", CHAT, {"messages": M, "chat_template_kwargs": {"chat_template": loop}},
         False),
        ("schema-depth-10", CHAT, {"messages": M, "max_tokens": 2,
         "response_format": json_schema(nested_schema(MAX_SCHEMA_DEPTH))}, False),
        ("regex-16KB", COMPLETIONS,
         {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"regex": "a" * MAX_PATTERN_CHARS}},
         False),
        ("valid-a", CHAT, valid, True),
        ("valid-b", CHAT, valid, True),
    ]  # fmt: skip


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> tuple[str, float, str]:
    """(status, seconds, the body's first 300 characters): the HTTP status as text, or
    ``timeout`` / ``error:Name``."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        text = response.read(300).decode(errors="replace")
        response.read()
        status = str(response.status)
    except TimeoutError:
        status, text = "timeout", ""
    except OSError as e:
        status, text = f"error:{type(e).__name__}", str(e)
    finally:
        conn.close()
    return status, time.perf_counter() - start, text


def poll_health(port: int, seconds: float) -> list[tuple[str, float]]:
    """(status, seconds) of each ``GET /health`` at ~20 Hz for ``seconds``."""
    polls = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        status, took, _ = request(port, "GET", "/health", timeout=10)
        polls.append((status, took))
        time.sleep(max(0.0, POLL_S - took))
    return polls


def run_senders(port: int, key: str, seconds: float) -> tuple[list, dict, dict]:
    """The hostile phase: /health polls, and per sender [(status, seconds)] of its requests
    (those still in flight when the phase ends are waited for and counted)."""
    stop = threading.Event()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    jobs = [(name, path, json.dumps({"model": NAME, **body}).encode())  # encoded once
            for name, path, body, _ in senders()]  # fmt: skip
    results: dict[str, list[tuple[str, float]]] = {name: [] for name, _, _ in jobs}
    errors: dict[str, str] = {}  # per sender, its first answer other than a 200

    def send(name: str, path: str, body: bytes) -> None:
        while not stop.is_set():
            status, took, text = request(port, "POST", path, body, headers)
            results[name].append((status, took))
            if status != "200" and name not in errors:
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                errors[name] = f"{status}: {text}"

    threads = [threading.Thread(target=send, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every sender has its first request in flight
    polls = poll_health(port, seconds)
    stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 10)
    return polls, results, errors


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summarize(polls: list, results: dict, errors: dict, valid: set[str]) -> dict:
    ms = [took * 1e3 for _, took in polls]
    hostile = [r for name, rs in results.items() if name not in valid for r in rs]
    valid_rs = [r for name, rs in results.items() if name in valid for r in rs]
    return {
        "health_polls": len(polls),
        "health_p50_ms": pct(ms, 50), "health_p99_ms": pct(ms, 99),
        "health_max_ms": max(ms, default=float("nan")),
        "health_not_200": sum(status != "200" for status, _ in polls),
        "hostile_sent": len(hostile),
        "hostile_statuses": dict(sorted(collections.Counter(s for s, _ in hostile).items())),
        "valid_ok": sum(s == "200" for s, _ in valid_rs), "valid_total": len(valid_rs),
        "valid_p50_ms": pct([t * 1e3 for s, t in valid_rs if s == "200"], 50),
        "per_sender": {name: {
            "sent": len(rs), "statuses": dict(sorted(collections.Counter(s for s, _ in rs).items())),
            "p50_ms": pct([t * 1e3 for _, t in rs], 50), "max_ms": max((t * 1e3 for _, t in rs),
                                                                     default=float("nan")),
            "first_error": errors.get(name, "")}
            for name, rs in results.items()},
    }  # fmt: skip


def start_server(args: argparse.Namespace, port: int, key: str, lora_root: str, log):
    cmd = [sys.executable, "-m", "compile_runtime.cli", "serve", "--model", args.model,
           "--served-model-name", NAME, "--port", str(port), "--api-key", key,
           "--enable-lora", "--allow-runtime-lora-updating", "--lora-root", lora_root,
           "--compilation-config", '{"backend": "eager"}', *args.server_flags]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1800):  # 900 s
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, cmd
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not up in 900 s; see {log.name}")


def stop_server(proc: subprocess.Popen) -> int | str:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return f"killed after 60 s, {proc.wait()}"


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks/results/hostile_health.json")
    )
    args = parser.parse_args(argv[:split])
    args.server_flags = argv[split + 1 :]
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    cpu = cpu_name()
    valid = {name for name, _, _, ok in senders() if ok}
    key = secrets.token_hex(16)
    port = free_port()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    log_path = os.path.splitext(args.out)[0] + ".log"
    with tempfile.TemporaryDirectory() as lora_root, open(log_path, "w") as log:
        proc, server_cmd = start_server(args, port, key, lora_root, log)
        try:
            # A valid request first, and one with a small output constraint: what a first
            # request alone sets up (the grammar compiler and its process) is not measured.
            for extra in ({}, {"structured_outputs": {"regex": "[ab]+"}}):
                request(port, "POST", CHAT, json.dumps({"model": NAME, "messages": M, "max_tokens": 2, **extra}).encode(),
                        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
            idle = summarize(poll_health(port, args.seconds), {}, {}, valid)
            hostile = summarize(*run_senders(port, key, args.seconds), valid)
        finally:
            exit_code = stop_server(proc)
    with open(log_path) as f:
        tracebacks = f.read().count("Traceback")

    phases = {"idle": idle, "hostile (8 senders)": hostile}
    print(format_table(
        ["phase", "/health polls", "p50 ms", "p99 ms", "max ms", "not 200", "hostile sent",
         "statuses", "valid ok/total", "valid p50 ms", "CPU", "command"],
        [[phase, p["health_polls"], f"{p['health_p50_ms']:.1f}", f"{p['health_p99_ms']:.1f}",
          f"{p['health_max_ms']:.1f}", p["health_not_200"], p["hostile_sent"],
          " ".join(f"{s}:{n}" for s, n in p["hostile_statuses"].items()) or "-",
          f"{p['valid_ok']}/{p['valid_total']}",
          "-" if math.isnan(p["valid_p50_ms"]) else f"{p['valid_p50_ms']:.0f}", cpu, command]
         for phase, p in phases.items()]))  # fmt: skip
    print()
    print(format_table(
        ["sender (hostile phase)", "sent", "statuses", "p50 ms", "max ms", "first answer not a 200"],
        [[name, s["sent"], " ".join(f"{k}:{n}" for k, n in s["statuses"].items()) or "-",
          f"{s['p50_ms']:.0f}", f"{s['max_ms']:.0f}", s["first_error"][:100] or "-"]
         for name, s in hostile["per_sender"].items()]))  # fmt: skip

    statuses = collections.Counter()
    for s in hostile["per_sender"].values():
        statuses.update(s["statuses"])
    server_errors = sum(n for s, n in statuses.items() if not s[:1].isdigit() or s >= "500")
    verdict = {
        f"/health p99 < {TARGET_P99_MS:g} ms under 8 hostile senders": [
            round(hostile["health_p99_ms"], 1), hostile["health_p99_ms"] < TARGET_P99_MS
            and hostile["health_not_200"] == 0],
        "every valid request finishes (200)": [
            f"{hostile['valid_ok']}/{hostile['valid_total']}",
            hostile["valid_total"] > 0 and hostile["valid_ok"] == hostile["valid_total"]],
        "no 5xx, timeout or broken connection": [server_errors, server_errors == 0],
        "no traceback in the server's log": [tracebacks, tracebacks == 0],
    }  # fmt: skip
    print()
    print(format_table(["target", "value", "verdict"],
                       [[t, v, "PASS" if ok else "FAIL"] for t, (v, ok) in verdict.items()]))  # fmt: skip
    print(f"\nserver exit code {exit_code}; CPU {cpu}; {os.cpu_count()} cores")

    result = {
        "cpu": cpu, "cores": os.cpu_count(), "command": command,
        "args": vars(args), "phases": phases, "server_exit_code": exit_code,
        "tracebacks": tracebacks,
        "verdicts": {t: {"value": v, "pass": ok} for t, (v, ok) in verdict.items()},
    }  # fmt: skip
    result["server_command"] = [c if c != key else "KEY" for c in server_cmd]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}, {log_path}")
    return 1 if args.check and not all(ok for _, ok in verdict.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
