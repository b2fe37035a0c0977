"""``compile-runtime tune``: measure the CPU linear kernels for a model now, and show the table.

    compile-runtime tune --model DIR [--dtype D] [--quantization Q] [--num-threads N]
                         [--budget-s S] [--cache-dir DIR] [--json]

An engine does this by itself at its first start on a machine (``compile_runtime/cpu/kernel_tuning.py``);
``tune`` measures again (after a change of machine load, threads or BIOS settings) and
replaces the saved table, so the next start reads the new one.
``register(sub)`` adds it to the top-level parser (compile_runtime/cli/main.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from compile_runtime.cli.argtypes import positive_int
from compile_runtime.cpu.kernel_tuning import BUDGET_S, TuningTable, tune_linear_kernels
from compile_runtime.models.dtype import DTYPE_CHOICES
from compile_runtime.table import format_table


def kernel_spans(table: TuningTable, shape: str) -> str:
    """A shape's choices as row ranges, e.g. ``1-8 gemv, 16-256 onednn``."""
    spans: list[tuple[int, int, str]] = []
    for rows, kernel in zip(table.buckets, table.shapes[shape].kernels, strict=True):
        if spans and spans[-1][2] == kernel:
            spans[-1] = (spans[-1][0], rows, kernel)
        else:
            spans.append((rows, rows, kernel))
    return ", ".join(f"{a}-{b} {k}" if a != b else f"{a} {k}" for a, b, k in spans)


def describe(table: TuningTable) -> str:
    """The table as the CLI prints it: one row per shape, then how it was measured."""
    rows = [
        [shape, choice.weights, kernel_spans(table, shape)]
        for shape, choice in table.shapes.items()
    ]
    measured = (
        f"measured in {table.seconds:.2f} s ({table.timings} timed passes)"
        if table.timings
        else f"read from the cache (measured in {table.seconds:.2f} s)"
    )
    partial = "" if table.complete else "; the budget ran out: larger rows keep the built-in choice"
    return (
        format_table(
            ["weight", "weights", "kernel by rows (bucket: calls up to that many rows)"], rows
        )
        + f"\n# {table.cpu}, {table.threads} threads, torch {table.torch_version}: {measured}{partial}"
    )


def cmd_tune(args: argparse.Namespace) -> int:
    from compile_runtime.config import CompilationConfig
    from compile_runtime.cpu.threads import set_num_threads
    from compile_runtime.engine.engine_config import decide_engine_config
    from compile_runtime.models.registry import load_model

    options = {"device": "cpu", "num_threads": args.num_threads, "quantization": args.quantization}
    config = decide_engine_config(args.model, None, args.dtype, options)
    set_num_threads(config.runner_config, torch.device("cpu"), 1)
    model = load_model(
        config.model_dir,
        CompilationConfig(),
        dtype=config.dtype,
        device="cpu",
        hf_config=config.hf_config,
        quantization=config.runner_config.quantization,
    )
    table = tune_linear_kernels(model, root=args.cache_dir, budget_s=args.budget_s, remeasure=True)
    if table is None:
        print(f"{args.model}: no float linear weight (quantized weights have one kernel)")
        return 0
    print(json.dumps(table.to_json(), indent=1) if args.json else describe(table))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="time the CPU linear kernels for a model; save the choices")
    p.add_argument("--model", required=True, help="model directory or GGUF file")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none", "int8"])
    p.add_argument("--num-threads", type=positive_int, default=None, help="default: free cores")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds at most")
    p.add_argument("--cache-dir", default=None, help="cache root (default as the engine's)")
    p.add_argument("--json", action="store_true", help="the whole table, timings included")
    p.set_defaults(func=cmd_tune)
