"""Offline generation: throughput and per-step decode latency, eager vs compiled, in one run.

A Llama-shaped model of ~33M parameters (random weights, built locally).
For each configuration: output tokens/s for a batch of 32 prompts, and the
median decode-step latency at batch 1, 8 and 32.

    python benchmarks/generate.py [--configs eager stock piecewise] [--out benchmarks/results/generate.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from llama_33m import MODEL, prompts

import compile_runtime as cr
from compile_runtime.tiny_models import make_model_dir

CONFIGS = {
    "eager": {"mode": "NONE"},
    "stock": {"mode": "STOCK_TORCH_COMPILE"},
    "piecewise": {"mode": "PIECEWISE", "backend": "inductor"},
}


def bench(model_dir: str, name: str, max_tokens: int, cache_dir: str) -> dict:
    start = time.perf_counter()
    config = {**CONFIGS[name], "cache_dir": cache_dir}
    llm = cr.LLM(model_dir, config, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256)
    startup = time.perf_counter() - start
    params = cr.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(2, 8, MODEL["vocab_size"]), params, progress=False)  # warm-up
    row = {"config": name, "startup_s": round(startup, 2)}
    for batch in (1, 8, 32):
        llm.generate(prompts(batch, 16, MODEL["vocab_size"]), params, progress=False)
        stats = llm.last_stats
        row[f"decode_ms_b{batch}"] = round(1000 * statistics.median(stats.decode_step_seconds), 2)
        if batch == 32:
            row["tokens_per_s_b32"] = round(stats.tokens_per_second, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=".demo/llama-33m")
    parser.add_argument("--out", default="benchmarks/results/generate.json")
    args = parser.parse_args()
    model_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    # A fresh compile cache: start-up includes compiling (Inductor's own cache may be warm).
    with tempfile.TemporaryDirectory() as cache_dir:
        rows = [bench(model_dir, name, args.max_tokens, cache_dir) for name in args.configs]
    cols = [
        "config",
        "startup_s",
        "tokens_per_s_b32",
        "decode_ms_b1",
        "decode_ms_b8",
        "decode_ms_b32",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": MODEL, "max_tokens": args.max_tokens, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
