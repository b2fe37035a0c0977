"""One engine on every core, or the cores split between ranks or engines: pipeline
parallelism (PP=2, one stage of 15 layers a core, two steps out at once), tensor
parallelism (TP=2) and data parallelism (DP=2, one engine a core) against one engine with
2 threads, on the same work in one run.

Two models, fp32, greedy, EOS an ordinary token: SmolLM2-135M-Instruct (the HF directory
``vs_vllm.py --setup`` builds), whose 9 heads do not divide over 2 ranks, so no TP; and
the same shape with 8 heads of 72 (4 KV heads) and random weights, built here, where TP=2
runs. Each configuration in its own process (``peers/worker.py``), the configurations
interleaved (one model's at a time), best of ``--repeats``, 2 GiB of KV cache for each
engine and rank: output tokens per second and the wall time of each
call, on ``vs_vllm.py``'s workloads (``mixed``: 64 requests of 8..200 prompt and 8..128
new tokens; ``batch1``; ``batch16``). Every configuration's tokens are compared with its
model's one-engine tokens.

    python benchmarks/parallel.py [--workloads mixed batch1 batch16] [--repeats 2]
        [--out benchmarks/results/parallel.json]
    python benchmarks/parallel.py --served [--out benchmarks/results/parallel_served.json]

``--served``: the same configurations behind ``serve`` (``benchmarks/serve.py``'s 16
streaming clients over its 64 mixed requests, on its ~33M Llama, whose 8 heads split):
tokens/s, time to first token and inter-token latency, each configuration once.

Left out: served load (the same engines behind ``serve``), several machines, more than 2
cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from decode_replay import cpu_name
from vs_vllm import FULL, WORKER, Worker, install

from compile_runtime.table import format_table

ONE = "one engine, 2 threads"
SMOLLM2 = "SmolLM2-135M"
EIGHT_HEADS = "SmolLM2 shape, 8 heads (random)"
# (model, configuration) -> LLM options. TP=2 on SmolLM2 itself: its 9 heads do not divide.
CONFIGS = {
    (SMOLLM2, ONE): {},
    (SMOLLM2, "PP=2 (1 thread per stage)"): {"pipeline_parallel_size": 2},
    (SMOLLM2, "DP=2 (1 thread per engine)"): {"data_parallel_size": 2},
    (EIGHT_HEADS, ONE): {},
    (EIGHT_HEADS, "PP=2 (1 thread per stage)"): {"pipeline_parallel_size": 2},
    (EIGHT_HEADS, "TP=2 (1 thread per rank)"): {"tensor_parallel_size": 2},
}


# The same KV cache for every engine and rank (each one's default share of the free RAM
# would differ with the start order, and six resident engines would not fit in 24 GiB).
KV = {"kv_cache_bytes": 2 * 2**30}


def eight_head_model() -> str:
    """SmolLM2's shape and tokenizer with 8 heads of 72 and 4 KV heads, random weights."""
    import shutil

    import repo_root  # noqa: F401  (testing/ on the path)

    from testing.model_dirs import make_model_dir

    path = os.path.join(os.path.dirname(install.HF_DIR), "smollm2-shape-8-heads")
    with open(os.path.join(install.HF_DIR, "config.json")) as f:
        config = json.load(f)
    shape = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "vocab_size", "max_position_embeddings", "rms_norm_eps",
                                    "tie_word_embeddings", "rope_parameters")}  # fmt: skip
    make_model_dir(path, with_tokenizer=False, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=72, **shape)  # fmt: skip
    for name in os.listdir(install.HF_DIR):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(install.HF_DIR, name), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    names = [w.name for w in FULL]
    parser.add_argument(
        "--workloads", nargs="+", choices=names, default=["mixed", "batch1", "batch16"]
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--served", action="store_true", help="served load instead")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/parallel.json "
                        "(parallel_served.json with --served)")  # fmt: skip
    args = parser.parse_args(argv)
    results = os.path.join("benchmarks", "results")
    if args.served:
        return served_load(args.out or os.path.join(results, "parallel_served.json"))
    args.out = args.out or os.path.join(results, "parallel.json")
    if not os.path.isdir(install.HF_DIR):
        sys.exit(f"{install.HF_DIR} is missing: run `python benchmarks/vs_vllm.py --setup` first")
    workloads = [w for w in FULL if w.name in args.workloads]
    models = {SMOLLM2: install.HF_DIR, EIGHT_HEADS: eight_head_model()}
    best: dict[tuple, tuple[float, float]] = {}
    equal: dict[tuple, bool] = {}
    for model, path in models.items():  # one model's processes resident at a time (RAM)
        workers = {}
        try:
            for (m, label), options in CONFIGS.items():
                if m == model:
                    workers[m, label] = Worker("ours", "fp32", path, {**KV, **options}, WORKER,
                                               log_name=f"parallel-{len(workers)}")  # fmt: skip
            for w in workloads:
                for repeat in range(args.repeats + 1):  # round 0 warms up
                    requests = w.requests(f"round{repeat}")
                    reference = None
                    for key, worker in workers.items():
                        tokens, seconds = worker.run(requests)
                        reference = reference if reference is not None else tokens
                        same = tokens == reference
                        equal[key, w.name] = equal.get((key, w.name), True) and same
                        if repeat:
                            tps = w.output_tokens() / seconds
                            if tps > best.get((key, w.name), (0.0, 0.0))[0]:
                                best[key, w.name] = (tps, seconds)
        finally:
            for worker in workers.values():
                worker.close()
    rows = []
    for w in workloads:
        for model, label in CONFIGS:
            base = best[(model, ONE), w.name][0]
            tps, seconds = best[(model, label), w.name]
            rows.append([w.name, model, label, f"{tps:.1f}", f"{tps / base:.2f}x",
                         f"{seconds:.2f}", "yes" if equal[(model, label), w.name] else "NO"])  # fmt: skip
    print(f"# {cpu_name()}, {os.cpu_count()} cores, fp32; " + "; ".join(
        f"{w.name}: {w.describe()}" for w in workloads))  # fmt: skip
    print(format_table(["workload", "model", "configuration", "out tok/s", "vs one engine",
                        "call s", "tokens equal"], rows))  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_name(), "rows": rows}, f, indent=2)
    return 0 if all(equal.values()) else 1


SERVED = {
    ONE: [],
    "PP=2": ["--pipeline-parallel-size", "2"],
    "TP=2": ["--tensor-parallel-size", "2"],
    "DP=2": ["--data-parallel-size", "2"],
}


def served_load(out: str) -> int:
    """Each configuration behind ``serve`` under ``serve.py``'s streaming clients."""
    import tempfile

    import repo_root  # noqa: F401  (testing/ on the path)
    from llama_33m import MODEL
    from serve import pct, served
    from vs_transformers import mixed_workload

    from testing.model_dirs import make_model_dir

    (row,) = mixed_workload(64).rows
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as root:
        os.environ.setdefault("COMPILE_RUNTIME_CACHE_DIR", os.path.join(root, "cache"))
        model_dir = make_model_dir(os.path.join(root, "model"), arch="llama", **MODEL)
        base = None
        for label, flags in SERVED.items():
            r = served(model_dir, row.requests, 16, 900.0, flags)
            base = base or r["tok_s"]
            failed += r["failed"]
            rows.append([label, f"{r['tok_s']:.1f}", f"{r['tok_s'] / base:.2f}x",
                         f"{pct(r['ttft'], 50) * 1e3:.0f}", f"{pct(r['itl'], 50) * 1e3:.1f}",
                         f"{pct(r['itl'], 99) * 1e3:.1f}", r["failed"]])  # fmt: skip
    print(f"# {cpu_name()}, {os.cpu_count()} cores; served, 16 streaming clients, 64 requests")
    print(format_table(["configuration", "tok/s", "vs one engine", "TTFT p50 ms",
                        "ITL p50 ms", "ITL p99 ms", "failed"], rows))  # fmt: skip
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"cpu": cpu_name(), "served": rows}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
