"""``compile-runtime plan-sizes`` and ``compile-runtime check``.

    compile-runtime plan-sizes --workload FILE --max-graphs K [--max-size N] [--json]
    compile-runtime check --model DIR [-O JSON] [--tokens N] [--dtype D] [--json]

``register(sub)`` adds both to the top-level parser (compile_runtime/cli.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from compile_runtime.planner.sizes import DEFAULT_MAX_CAPTURE_SIZE
from compile_runtime.table import format_table


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


# ---- plan-sizes ---------------------------------------------------------------


def cmd_plan_sizes(args: argparse.Namespace) -> int:
    from compile_runtime.planner.sizes import plan_report
    from compile_runtime.planner.workload import load_workload

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


# ---- check ---------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from compile_runtime.config import parse_config
    from compile_runtime.verify import check_model_dir

    report = check_model_dir(
        args.model,
        parse_config(args.compilation_config),
        num_tokens=args.tokens,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        seed=args.seed,
        atol=args.atol,
        rtol=args.rtol,
        use_transformers=args.use_transformers,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.format())
    return 0 if report.ok else 1


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
        "--max-graphs", required=True, type=_positive_int, metavar="K", help="number of sizes"
    )
    plan.add_argument(
        "--max-size",
        type=_positive_int,
        default=DEFAULT_MAX_CAPTURE_SIZE,
        metavar="N",
        help=f"no size above N tokens (default {DEFAULT_MAX_CAPTURE_SIZE}, the default ladder's top)",
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=cmd_plan_sizes)

    check = sub.add_parser(
        "check",
        help="verify a compiled model piece by piece against eager",
        description=(
            "Run one batch through the compiled model and, piece by piece, through each piece's "
            "eager FX graph with the same inputs; print the error of every piece and the first "
            "one over the tolerance. Exit status 1 when a piece fails."
        ),
    )
    check.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    check.add_argument("-O", "--compilation-config", default=None, help="CompilationConfig as JSON")
    check.add_argument("--tokens", type=_positive_int, default=16, help="tokens in the batch")
    check.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--atol", type=_positive_float, default=None, help="default: per dtype")
    check.add_argument("--rtol", type=_positive_float, default=None, help="default: per dtype")
    check.add_argument("--use-transformers", action="store_true", help="run through the adapter")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)
