"""One engine on every core, or the cores split between engines: data parallelism (DP=2,
one thread per engine) against one engine with 2 threads, on the same work in one run.

SmolLM2-135M-Instruct (the HF directory ``vs_vllm.py --setup`` builds), fp32, greedy,
EOS an ordinary token, each configuration in its own process (``peers/worker.py``), the
configurations interleaved, best of ``--repeats``: output tokens per second and the wall
time of each call, on ``vs_vllm.py``'s workloads (``mixed``: 64 requests of 8..200
prompt and 8..128 new tokens; ``batch1``; ``batch16``). Every configuration's tokens are
compared with the one-engine tokens (they must be equal).

    python benchmarks/parallel.py [--workloads mixed batch1 batch16] [--repeats 2]
        [--out benchmarks/results/parallel.json]

Left out: tensor parallelism (SmolLM2's 9 heads do not divide over 2 ranks), served load
(the same engines behind ``serve``), pipeline parallelism (not built yet), more than 2
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

# TP=2 is not among them: SmolLM2's 9 attention heads do not divide over 2 ranks.
CONFIGS = {
    "one engine, 2 threads": {},
    "DP=2 (1 thread per engine)": {"data_parallel_size": 2},
}


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
    workers = {}
    try:
        for label, options in CONFIGS.items():
            workers[label] = Worker("ours", "fp32", install.HF_DIR, options, WORKER,
                                    log_name=f"parallel-{len(workers)}")  # fmt: skip
        best: dict[tuple[str, str], tuple[float, float]] = {}
        equal: dict[tuple[str, str], bool] = {}
        for w in workloads:
            for repeat in range(args.repeats + 1):  # round 0 warms up
                requests = w.requests(f"round{repeat}")
                reference = None
                for label, worker in workers.items():
                    tokens, seconds = worker.run(requests)
                    reference = reference if reference is not None else tokens
                    equal[label, w.name] = equal.get((label, w.name), True) and tokens == reference
                    if repeat:
                        tps = w.output_tokens() / seconds
                        if tps > best.get((label, w.name), (0.0, 0.0))[0]:
                            best[label, w.name] = (tps, seconds)
    finally:
        for worker in workers.values():
            worker.close()
    rows = []
    for w in workloads:
        base = best["one engine, 2 threads", w.name][0]
        for label in CONFIGS:
            tps, seconds = best[label, w.name]
            rows.append([w.name, label, f"{tps:.1f}", f"{tps / base:.2f}x", f"{seconds:.2f}",
                         "yes" if equal[label, w.name] else "NO"])  # fmt: skip
    print(f"# {cpu_name()}, {os.cpu_count()} cores, fp32; " + "; ".join(
        f"{w.name}: {w.describe()}" for w in workloads))  # fmt: skip
    print(format_table(["workload", "configuration", "out tok/s", "vs one engine",
                        "call s", "tokens equal"], rows))  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_name(), "rows": rows}, f, indent=2)
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
