"""Start-up time: cold (empty caches) vs warm (our compile cache filled), in one run.

Each start is a fresh process with an empty Inductor cache, so a warm start
is what another machine sees after `compile-runtime cache import`: only our
cache helps. Seconds are split into Dynamo tracing (everything before our
backend is called), compiling or loading pieces (our backend), and total
(first forward, imports excluded).

    python benchmarks/startup.py [--layers 2 16] [--out benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from fresh_process import run_child


def child(cache_dir: str, num_layers: int) -> dict:
    import torch

    import compile_runtime as cr
    from compile_runtime.compiler.decorator import compiled_model
    from compile_runtime.testing.transformer import build_transformer

    config = cr.CompilationConfig(backend="inductor", cache_dir=cache_dir)
    model = build_transformer(
        config,
        num_layers=num_layers,
        hidden=256,
        num_heads=8,
        num_kv_heads=4,
        intermediate=512,
        vocab=1024,
    )
    ids = torch.randint(0, 1024, (32,))
    with torch.no_grad():
        start = time.perf_counter()
        model(ids, torch.arange(32))
        total = time.perf_counter() - start
    record = compiled_model(model)
    c = cr.compilation_counter
    return {
        "total_s": round(total, 2),
        "backend_s": round(record.result.seconds, 2),
        "trace_s": round(total - record.result.seconds, 2),
        "inductor_compiles": c.num_inductor_compiles,
        "artifacts_loaded": c.num_compiled_artifacts_loaded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--out", default="benchmarks/results/startup.json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return

    from compile_runtime.table import format_table

    rows = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as cache:
            for start in ("cold", "warm"):
                r = run_child(__file__, cache, str(layers))
                rows.append({"layers": layers, "start": start, **r})
                print(rows[-1], file=sys.stderr)
    headers = [
        "layers",
        "start",
        "trace_s",
        "backend_s",
        "total_s",
        "inductor_compiles",
        "artifacts_loaded",
    ]
    print(format_table(headers, [[r[h] for h in headers] for r in rows]))
    for layers in args.layers:
        cold, warm = (
            next(r for r in rows if r["layers"] == layers and r["start"] == s)
            for s in ("cold", "warm")
        )
        print(f"{layers} layers: warm/cold total = {warm['total_s'] / cold['total_s']:.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
