"""Where a served request's CPU time goes: the API process and the model's worker, by stage.

Starts ``compile-runtime serve --model <the Q4_1 GGUF file>`` with its defaults (on a CPU
the model runs in a worker process; ``--server-args`` adds flags), warms it up, then for
each ``--concurrency`` sends ``--num-prompts`` streaming requests with vLLM's own client
(``vllm bench serve``, the random dataset, ``--input-len`` in / ``--output-len`` out, EOS
ignored) while py-spy samples both processes (non-blocking, ``--rate`` Hz, idle threads
left out). Per concurrency it prints output tokens/s, each process's CPU seconds per
request (from ``/proc``: every thread, native work included) and each process's samples
by stage, the stage being the first rule of ``STAGES`` that names a frame of the sample's
stack. Writes JSON.

py-spy is installed into ``benchmarks/.peers/tools`` the first time (never into the
package's venv). Left out: vLLM's server (``serve_vs_vllm.py`` measures both),
non-streaming requests, the ``/v1/responses`` endpoint, prompts with real text.

    python benchmarks/serve_profile.py [--concurrency 1 8 32] [--num-prompts 64]
        [--endpoint chat|completions] [--server-args "..."] [--out ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(0, HERE)
import install  # noqa: E402  (benchmarks/peers/install.py)
import serve_vs_vllm as served  # noqa: E402

TOOLS = os.path.join(install.PEERS, "tools")
PY_SPY = os.path.join(TOOLS, "bin", "py-spy")
# (stage, substrings of a frame that put a sample in it), first match wins: the model's
# step before what calls it, the text work before the HTTP around it.
STAGES = [
    ("model step", ("model_runner.py", "execute_model", "cpu/graph.py", "torch/")),
    ("sampling", ("sampler.py", "sampling_step.py", "rejection_sampler.py")),
    ("detokenize", ("incremental_text.py", "detokeniz", "decode_tokens", "convert_ids")),
    ("tokenize & template", ("tokeniz", "chat_template", "apply_chat_template", "jinja")),
    ("stream chunks & JSON", ("streaming.py", "openai_format.py", "choice.py", "json/")),
    ("scheduling", ("scheduler.py", "kv_cache_manager", "block_pool")),
    ("IPC with the worker", ("multiproc.py", "pickle", "connection.py", "shared_memory")),
    ("engine loop", ("async_engine.py", "engine/core.py", "outputs.py")),
    ("request validation", ("validation.py", "protocol.py", "pydantic", "request_body.py")),
    ("HTTP & event loop", ("uvicorn", "starlette", "fastapi", "h11", "asyncio", "anyio")),
]


def ensure_py_spy() -> str:
    if not os.path.exists(PY_SPY):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--prefix", TOOLS, "py-spy"], check=True
        )
    return PY_SPY


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def worker_pid(server_pid: int) -> int | None:
    """The model's worker: the server's descendant with the most CPU time so far."""
    pids, todo = [], children(server_pid)
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children(pid)
    pids = [p for p in pids if os.path.exists(f"/proc/{p}/stat")]
    return max(pids, key=cpu_seconds, default=None)


def stage_of(stack: str) -> str:
    for stage, marks in STAGES:
        if any(mark in stack for mark in marks):
            return stage
    return "other"


def stages(raw_path: str) -> dict[str, int]:
    """py-spy's raw (collapsed) samples summed by stage."""
    counts: collections.Counter[str] = collections.Counter()
    if not os.path.exists(raw_path):
        return {}
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if n.isdigit():
                counts[stage_of(stack)] += int(n)
    return dict(counts.most_common())


def profile_load(pids: dict[str, int], port: int, args, concurrency: int, tmp: str) -> dict:
    """One timed load at ``concurrency``, both processes sampled."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    spies = {
        name: subprocess.Popen(
            [
                PY_SPY,
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--nonblocking",
                "--rate",
                str(args.rate),
                "--output",
                os.path.join(tmp, f"{name}-{concurrency}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for name, pid in pids.items()
    }
    try:
        result = served.bench_serve(
            port, args.endpoint, args, concurrency, args.num_prompts, f"profile-c{concurrency}"
        )
    finally:
        for spy in spies.values():
            spy.send_signal(2)  # py-spy writes its file on SIGINT
        for spy in spies.values():
            spy.wait(60)
    after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    done = max(result["completed"] or 0, 1)
    return {
        "output_throughput": result["output_throughput"],
        "completed": result["completed"],
        "failed": result["failed"],
        "p50_tpot_ms": result["p50_tpot_ms"],
        "cpu_s_per_request": {n: (after[n] - before[n]) / done for n in pids},
        "wall_s": result["duration"],
        "stages": {n: stages(os.path.join(tmp, f"{n}-{concurrency}.txt")) for n in pids},
    }


def print_report(results: dict, args) -> None:
    print(f"\n### served path, {args.endpoint}: {args.num_prompts} streaming requests, "
          f"{args.input_len} in / {args.output_len} out ({args.dtype})\n")  # fmt: skip
    print("| concurrency | out tok/s | TPOT p50 ms | API CPU s/req | worker CPU s/req |")
    print("|---|---|---|---|---|")
    for c, r in results["loads"].items():
        cpu = r["cpu_s_per_request"]
        print(f"| {c} | {r['output_throughput']:.1f} | {r['p50_tpot_ms']:.1f} "
              f"| {cpu.get('api', 0):.3f} | {cpu.get('worker', 0):.3f} |")  # fmt: skip
    for c, r in results["loads"].items():
        for name, counts in r["stages"].items():
            total = sum(counts.values()) or 1
            shares = ", ".join(f"{s} {n / total:.0%}" for s, n in counts.items())
            print(f"\nconcurrency {c}, {name} process samples: {shares}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--endpoint", choices=sorted(served.ENDPOINTS), default="chat")
    p.add_argument("--dtype", choices=sorted(served.TORCH_DTYPES), default="bf16")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--server-args", default="", help="more flags for compile-runtime serve")
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_profile.json"))
    args = p.parse_args()
    install.setup(["vllm", "hf"])
    ensure_py_spy()
    results: dict = {"args": vars(args), "loads": {}}
    tmp = os.path.join(install.PEERS, "logs", "serve-profile")
    os.makedirs(tmp, exist_ok=True)
    extra = shlex.split(args.server_args)
    with served.running_server("ours", args.dtype, extra) as (proc, port, _):
        pids = {"api": proc.pid}
        for c in args.concurrency:
            served.bench_serve(port, args.endpoint, args, c, max(16, c), "profile-warmup")
            worker = worker_pid(proc.pid)
            if worker is not None:
                pids["worker"] = worker
            time.sleep(1)
            results["loads"][str(c)] = profile_load(pids, port, args, c, tmp)
            served.log(f"concurrency {c}: {results['loads'][str(c)]['output_throughput']:.1f}")
    print_report(results, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
