"""Tensor parallelism: start-up time, throughput and per-step overhead, TP=1 vs TP=N, in one run.

A Llama-shaped model (random weights, built locally). For each setting:
start-up seconds (LLM() from call to return: worker spawn, imports, load,
compile), cold (empty compile caches, ours and Inductor's) and warm (our
cache filled by the cold start); output tokens/s for a batch of prompts; the
median decode-step latency at batch 1 and at the full batch; and the
executor's round trip for an empty step (one broadcast + reply, no model
work). Every setting must produce the same greedy tokens as the first.

    python benchmarks/tp.py [--tp 1 2] [--backends mp ray] [--config inductor|eager|none]
                            [--device cpu|cuda] [--out benchmarks/results/tp.json]

On 2 CPU cores TP=2 cannot be faster (the two ranks share the cores that
TP=1 already uses); the point there is correctness and the overhead per
step. On a machine with N GPUs, ``--device cuda --tp 1 2 4`` gives GPU
numbers (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import repo_root  # noqa: F401  (testing/ on the path)
from llama_33m import MODEL, prompts

CONFIGS = {
    "none": {"mode": "NONE"},
    "eager": {"backend": "eager"},
    "inductor": {"backend": "inductor"},
}


def empty_step_ms(llm, iters: int = 200) -> float:
    """Median round trip of a step that schedules nothing: pure executor overhead."""
    from compile_runtime.core.scheduler_output import SchedulerOutput

    times = []
    for _ in range(iters):
        start = time.perf_counter()
        llm.executor.execute_model(SchedulerOutput())
        llm.executor.sample_tokens()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def start(model_dir: str, tp: int, backend: str, cache_dir: str, args: argparse.Namespace):
    import compile_runtime as cr

    begin = time.perf_counter()
    llm = cr.LLM(
        model_dir,
        {**CONFIGS[args.config], "cache_dir": cache_dir},
        device=args.device,
        max_num_seqs=args.batch,
        max_num_batched_tokens=512,
        max_model_len=256,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
    )
    return llm, time.perf_counter() - begin


def bench(model_dir: str, tp: int, backend: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as inductor:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor  # workers inherit it
        llm, cold = start(model_dir, tp, backend, cache_dir, args)
        cold_compile = llm.startup.first_forward
        llm.shutdown()
        llm, warm = start(model_dir, tp, backend, cache_dir, args)
        row = {
            "tp": tp,
            "executor": backend,
            "cold_start_s": round(cold, 2),
            "cold_compile_s": round(cold_compile, 2),
            "warm_start_s": round(warm, 2),
        }
        try:
            row.update(measure(llm, args))
        finally:
            llm.shutdown()
    return row


def measure(llm, args: argparse.Namespace) -> dict:
    import compile_runtime as cr

    params = cr.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = MODEL["vocab_size"]
    row: dict = {}
    first = llm.generate(prompts(2, 8, vocab), params, use_tqdm=False)  # warm-up
    llm.generate(prompts(1, 16, vocab), params, use_tqdm=False)
    row["decode_ms_b1"] = round(1000 * statistics.median(llm.last_stats.decode_step_seconds), 2)
    outputs = llm.generate(prompts(args.batch, 16, vocab), params, use_tqdm=False)
    stats = llm.last_stats
    row[f"decode_ms_b{args.batch}"] = round(1000 * statistics.median(stats.decode_step_seconds), 2)
    row["tokens_per_s"] = round(stats.tokens_per_second, 1)
    row["empty_step_ms"] = round(empty_step_ms(llm), 3)
    row["tokens"] = [o.outputs[0].token_ids for o in first + outputs]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--backends", nargs="+", default=["mp"], choices=["mp", "ray"])
    parser.add_argument("--config", default="inductor", choices=list(CONFIGS))
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model-dir", default=".demo/llama-33m")
    parser.add_argument("--out", default="benchmarks/results/tp.json")
    args = parser.parse_args()

    from compile_runtime.table import format_table
    from testing.model_dirs import make_model_dir

    model_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    settings = [(1, "uni")] if 1 in args.tp else []
    settings += [(tp, b) for tp in args.tp if tp > 1 for b in args.backends]
    if "ray" in args.backends:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    rows = [bench(model_dir, tp, backend, args) for tp, backend in settings]
    reference = rows[0]["tokens"]
    for r in rows:
        r["same_tokens_as_first"] = r.pop("tokens") == reference
    cols = list(rows[0])
    print(f"model: {MODEL}, config: {args.config}, device: {args.device or 'default'}")
    print(format_table(cols, [[r[c] for c in cols] for r in rows]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": MODEL, "config": args.config, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
