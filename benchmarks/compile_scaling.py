"""Compile work vs depth: our trace-once + piece dedup against stock torch.compile.

For models of several depths, each in a fresh process with an empty Inductor
cache (a cold start): seconds to the first output, Inductor compilations,
Dynamo traces over 20 token counts, and seconds for all 20 sizes.

Every row does the same work: all 20 sizes compiled. Stock ``dynamic=False``
compiles one graph per size, more than Dynamo's default recompile limit (8),
after which it would run the rest eagerly; so the stock rows raise the limit
above the number of sizes, count the frames Dynamo gave up on, and fail if
there is any.

    python benchmarks/compile_scaling.py [--layers 2 8 32] [--out benchmarks/results/compile_scaling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import repo_root  # noqa: F401  (testing/ on the path)
from fresh_process import run_child

TOKEN_COUNTS = [16, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 17, 24, 31, 32, 33, 48, 64, 100, 128]
# Above one graph per size, so stock dynamic=False never falls back to eager.
STOCK_RECOMPILE_LIMIT = 2 * len(TOKEN_COUNTS)
VARIANTS = ["piecewise", "piecewise-nodedup", "stock-dynamic-none", "stock-dynamic-false"]


def run_variant(variant: str, num_layers: int) -> dict:
    """Runs in a child process: build, compile, run all token counts, report counts."""
    import torch
    from torch._dynamo.utils import counters

    import compile_runtime as cr
    from testing.transformer import build_transformer

    counter = cr.compilation_counter
    traces = {"n": 0}
    if variant.startswith("piecewise"):
        config = cr.CompilationConfig(backend="inductor", dedupe_pieces=variant == "piecewise")
        model = build_transformer(config, num_layers=num_layers)
    else:
        from torch._inductor.compile_fx import compile_fx

        def counting_inductor(gm, example_inputs):
            traces["n"] += 1
            return compile_fx(gm, example_inputs)

        eager = build_transformer(cr.CompilationConfig(mode="NONE"), num_layers=num_layers)
        model = torch.compile(
            eager,
            backend=counting_inductor,
            dynamic=None if variant == "stock-dynamic-none" else False,
        )
    if not variant.startswith("piecewise"):
        torch._dynamo.config.recompile_limit = STOCK_RECOMPILE_LIMIT

    def step(n: int):
        return model(torch.randint(0, 128, (n,)), torch.arange(n))

    with torch.no_grad():
        start = time.perf_counter()
        step(TOKEN_COUNTS[0])
        first = time.perf_counter() - start
        for n in TOKEN_COUNTS[1:]:
            step(n)
        total = time.perf_counter() - start
    given_up = counters["frames"]["total"] - counters["frames"]["ok"]
    if given_up:
        raise SystemExit(
            f"{variant}, {num_layers} layers: Dynamo gave up on {given_up} frame(s), which then ran "
            "eagerly (not the same work as the other rows); run with TORCH_LOGS=recompiles,"
            "graph_breaks to see why, and raise STOCK_RECOMPILE_LIMIT if it is the recompile limit"
        )
    if variant.startswith("piecewise"):
        traces["n"] = counter.num_graphs_seen
        inductor = counter.num_inductor_compiles
    else:
        inductor = traces["n"]  # one Inductor compile per Dynamo graph
    return {
        "variant": variant,
        "layers": num_layers,
        "first_call_s": round(first, 2),
        "all_20_sizes_s": round(total, 2),
        "dynamo_traces": traces["n"],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "inductor_compiles": inductor,
        "eager_fallback_frames": given_up,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--out", default="benchmarks/results/compile_scaling.json")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_variant(args.child[0], int(args.child[1]))))
        return

    rows = []
    for layers in args.layers:
        for variant in args.variants:
            rows.append(run_child(__file__, variant, str(layers)))
            print(rows[-1], file=sys.stderr)

    print(
        "| layers | variant | first call s | 20 sizes s | Dynamo traces | Inductor compiles "
        "| eager fallback frames |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layers']} | {r['variant']} | {r['first_call_s']} | {r['all_20_sizes_s']} | "
            f"{r['dynamo_traces']} | {r['inductor_compiles']} | {r['eager_fallback_frames']} |"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "token_counts": TOKEN_COUNTS,
                "stock_recompile_limit": STOCK_RECOMPILE_LIMIT,
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
