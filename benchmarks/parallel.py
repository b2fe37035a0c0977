"""One engine on every core, or the cores split between ranks or engines: pipeline
parallelism (PP=2, one stage of 15 layers a core, two steps out at once), tensor
parallelism (TP=2) and data parallelism (DP=2, one engine a core) against one engine with
2 threads, on the same work in one run.

Two models, fp32, greedy, EOS an ordinary token: SmolLM2-135M-Instruct (the HF directory
``vs_vllm.py --setup`` builds), whose 9 heads do not divide over 2 ranks, so no TP; and
the same shape with 8 heads of 72 (4 KV heads) and random weights, built here, where TP=2
runs. Each configuration in its own process (``peers/worker.py``), the configurations
interleaved, best of ``--repeats``: output tokens per second and the wall time of each
call, on ``vs_vllm.py``'s workloads (``mixed``: 64 requests of 8..200 prompt and 8..128
new tokens; ``batch1``; ``batch16``). Every configuration's tokens are compared with its
model's one-engine tokens.

    python benchmarks/parallel.py [--workloads mixed batch1 batch16] [--repeats 2]
        [--out benchmarks/results/parallel.json]

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
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "parallel.json"))
    args = parser.parse_args(argv)
    if not os.path.isdir(install.HF_DIR):
        sys.exit(f"{install.HF_DIR} is missing: run `python benchmarks/vs_vllm.py --setup` first")
    workloads = [w for w in FULL if w.name in args.workloads]
    models = {SMOLLM2: install.HF_DIR, EIGHT_HEADS: eight_head_model()}
    workers = {}
    try:
        for (model, label), options in CONFIGS.items():
            workers[model, label] = Worker("ours", "fp32", models[model], options, WORKER,
                                           log_name=f"parallel-{len(workers)}")  # fmt: skip
        best: dict[tuple, tuple[float, float]] = {}
        equal: dict[tuple, bool] = {}
        for w in workloads:
            for repeat in range(args.repeats + 1):  # round 0 warms up
                requests = w.requests(f"round{repeat}")
                reference = {}
                for key, worker in workers.items():
                    tokens, seconds = worker.run(requests)
                    same = reference.setdefault(key[0], tokens) == tokens
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


if __name__ == "__main__":
    sys.exit(main())
