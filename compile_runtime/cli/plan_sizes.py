"""``compile-runtime plan-sizes``.

    compile-runtime plan-sizes --workload FILE --max-graphs K [--max-size N] [--json]

``register(sub)`` adds it to the top-level parser (compile_runtime/cli/main.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from compile_runtime.cli.argtypes import positive_int
from compile_runtime.planner.sizes import DEFAULT_MAX_CAPTURE_SIZE, plan_report
from compile_runtime.planner.workload import load_workload
from compile_runtime.table import format_table

# ---- plan-sizes ---------------------------------------------------------------


def cmd_plan_sizes(args: argparse.Namespace) -> int:
    workload = load_workload(args.workload)
    histogram = workload.combined()
    report = plan_report(histogram, args.max_graphs, args.max_size)
    if not report.sizes:
        raise ValueError(
            f"every step in {args.workload!r} has more than --max-size {args.max_size} tokens: "
            "nothing to plan; raise --max-size"
        )
    sizes = report.sizes
    spec = f"auto:{args.workload}:{args.max_graphs}"
    config_json = json.dumps({"cudagraph_capture_sizes": sizes})
    if args.json:
        data: dict[str, Any] = report.to_dict()
        data.update(
            workload=args.workload,
            steps={"mixed": sum(workload.mixed.values()), "decode": sum(workload.decode.values())},
            config={"cudagraph_capture_sizes": sizes},
            auto_spec=spec,
        )
        print(json.dumps(data, indent=1))
        return 0

    seen = sorted(histogram)
    print(
        f"workload {args.workload}: {workload.num_steps} steps ({sum(workload.decode.values())} "
        f"uniform decode, {sum(workload.mixed.values())} mixed), {workload.num_tokens} tokens, "
        f"{len(seen)} distinct token counts from {seen[0]} to {seen[-1]}"
    )
    print(
        "planned over decode and mixed steps together: one list of capture sizes serves both "
        "kinds of graph"
    )
    print(
        f"every step of <= {sizes[-1]} tokens gets a graph; steps above --max-size "
        f"{args.max_size} run without one (no padding, no graph): "
        f"{report.plan.uncovered_steps} steps ({1 - report.plan.coverage:.1%})"
    )
    print()
    rows = [
        [
            r.name,
            r.num_sizes,
            r.sizes[-1] if r.sizes else "-",
            f"{r.coverage:.1%}",
            round(r.padded_per_step, 3),
            f"{r.waste_fraction:.2%}",
        ]
        for r in report.rows()
    ]
    headers = ["ladder", "graphs", "largest", "steps in graphs", "padded tokens/step", "waste"]
    print(format_table(headers, rows))
    print()
    print(f"chosen sizes ({len(sizes)}): {sizes}")
    print()
    print("use them:")
    print(f"  CompilationConfig(cudagraph_capture_sizes={sizes})")
    print(f"  -O '{config_json}'")
    print("or plan at start-up from this file:")
    print(f'  CompilationConfig(cudagraph_capture_sizes="{spec}")')
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan-sizes",
        help="choose CUDA graph capture sizes from a recorded workload",
        description=(
            "Choose the K capture sizes that minimise the expected padded tokens per step over "
            "a recorded workload (exact dynamic program). Every step of at most --max-size "
            "tokens gets a graph; larger steps run without one and are reported as uncovered."
        ),
    )
    plan.add_argument(
        "--workload", required=True, metavar="FILE", help="generate --record-workload output"
    )
    plan.add_argument(
        "--max-graphs", required=True, type=positive_int, metavar="K", help="number of sizes"
    )
    plan.add_argument(
        "--max-size",
        type=positive_int,
        default=DEFAULT_MAX_CAPTURE_SIZE,
        metavar="N",
        help=f"no size above N tokens (default {DEFAULT_MAX_CAPTURE_SIZE}, the default ladder's top)",
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=cmd_plan_sizes)
