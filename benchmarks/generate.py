"""Offline generation: throughput and per-step decode latency, eager vs compiled, in one run.

A Llama-shaped model of ~33M parameters (random weights, built locally).
For each configuration: output tokens/s for a batch of 32 prompts, and the
median decode-step latency at batch 1, 8 and 32.

Start-up is what ``LLM(...)`` takes; stock ``torch.compile`` keeps compiling
after it (its guards fail on the first real steps with attention metadata,
or on new token counts), inside the timed runs. So every phase (start-up,
warm-up, batch 1, 8, 32) also counts its compile work: Dynamo graphs
compiled, Dynamo frames it gave up on (they run eagerly from then on: a
recompile limit or an unsupported construct), and our own traces and piece
compilations. "compiles after start-up" sums the later phases: for a
configuration that is not 0, the later tokens/s include compile time (the
medians mostly do not). Each configuration starts with Dynamo's caches reset,
so none inherits another's compiled frames or recompile budget.

    python benchmarks/generate.py [--configs eager stock piecewise] [--max-tokens 32]
                                  [--out benchmarks/results/generate.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import repo_root  # noqa: F401  (testing/ on the path)
import torch
from llama_33m import MODEL, prompts
from torch._dynamo.utils import counters

import compile_runtime as cr
from testing.model_dirs import make_model_dir

CONFIGS = {
    "eager": {"mode": "NONE"},
    "stock": {"mode": "STOCK_TORCH_COMPILE"},
    "piecewise": {"mode": "PIECEWISE", "backend": "inductor"},
}
BATCHES = (1, 8, 32)


def compile_counts() -> dict[str, int]:
    """Process-wide totals of compile work; a phase reports the difference."""
    ours = cr.compilation_counter
    return {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "dynamo_frames_given_up": counters["frames"]["total"] - counters["frames"]["ok"],
        "our_traces": ours.num_graphs_seen,
        "piece_compilations": ours.num_backend_compilations,
    }


class Phases:
    """Seconds and compile work of each named phase of one configuration."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def run(self, name: str, fn, *args, **kwargs):
        before, start = compile_counts(), time.perf_counter()
        result = fn(*args, **kwargs)
        seconds, after = time.perf_counter() - start, compile_counts()
        self.rows[name] = {"seconds": round(seconds, 2)} | {k: after[k] - before[k] for k in after}
        return result


def bench(model_dir: str, name: str, max_tokens: int, cache_dir: str) -> tuple[dict, dict]:
    torch._dynamo.reset()
    phases = Phases()
    config = {**CONFIGS[name], "cache_dir": cache_dir}
    llm = phases.run(
        "start-up",
        cr.LLM,
        model_dir,
        config,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=256,
    )
    params = cr.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = MODEL["vocab_size"]
    phases.run("warm-up", llm.generate, prompts(2, 8, vocab), params, use_tqdm=False)
    row = {"config": name, "startup_s": phases.rows["start-up"]["seconds"]}
    for batch in BATCHES:
        phases.run(
            f"batch {batch}", llm.generate, prompts(batch, 16, vocab), params, use_tqdm=False
        )
        stats = llm.last_stats
        row[f"decode_ms_b{batch}"] = round(1000 * statistics.median(stats.decode_step_seconds), 2)
        if batch == 32:
            row["tokens_per_s_b32"] = round(stats.tokens_per_second, 1)
    later = [p for phase, p in phases.rows.items() if phase != "start-up"]
    row["compiles_after_startup"] = sum(p["dynamo_graphs"] + p["piece_compilations"] for p in later)
    row["frames_given_up"] = sum(p["dynamo_frames_given_up"] for p in phases.rows.values())
    return row, phases.rows


def print_table(cols: list[str], rows: list[dict]) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


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
    rows, phases = [], {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in args.configs:
            row, phases[name] = bench(model_dir, name, args.max_tokens, cache_dir)
            rows.append(row)
    print_table(
        [
            "config",
            "startup_s",
            "compiles_after_startup",
            "frames_given_up",
            "tokens_per_s_b32",
            "decode_ms_b1",
            "decode_ms_b8",
            "decode_ms_b32",
        ],
        rows,
    )
    print()
    phase_rows = [{"config": c, "phase": p, **v} for c, ps in phases.items() for p, v in ps.items()]
    print_table(
        [
            "config",
            "phase",
            "seconds",
            "dynamo_graphs",
            "dynamo_frames_given_up",
            "our_traces",
            "piece_compilations",
        ],
        phase_rows,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"model": MODEL, "max_tokens": args.max_tokens, "rows": rows, "phases": phases},
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
