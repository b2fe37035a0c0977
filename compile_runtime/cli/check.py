"""``compile-runtime check``: verify a compiled model directory piece by piece.

    compile-runtime check --model DIR [-O JSON] [--tokens N] [--dtype D] [--json]
    compile-runtime check --capture-safety --model DIR [--use-transformers] [--json]

``register(sub)`` adds it to the top-level parser (compile_runtime/cli/main.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from compile_runtime.cli.argtypes import non_negative_float, positive_int
from compile_runtime.config import parse_config
from compile_runtime.models.gguf import model_directory
from compile_runtime.verify.capture import check_capture_model_dir
from compile_runtime.verify.model_dir import check_model_dir


def cmd_check(args: argparse.Namespace) -> int:
    if args.capture_safety:
        return cmd_capture_safety(args)
    report = check_model_dir(
        model_directory(args.model),
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


def cmd_capture_safety(args: argparse.Namespace) -> int:
    report = check_capture_model_dir(
        model_directory(args.model),
        parse_config(args.compilation_config),
        num_tokens=args.tokens,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        use_transformers=args.use_transformers,
    )
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return 0 if report.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "check",
        help="verify a compiled model piece by piece against eager",
        description=(
            "Run one batch through the compiled model and, piece by piece, through each piece's "
            "eager FX graph with the same inputs; print the error of every piece and the first "
            "one over the tolerance. Exit status 1 when a piece fails. With --capture-safety, "
            "check instead what would break a CUDA graph (host syncs, data-dependent shapes "
            "and sizes, CPU tensors, graph breaks): exit status 1 on a finding."
        ),
    )
    check.add_argument(
        "--model", required=True, help="model directory (config.json + safetensors) or .gguf file"
    )
    check.add_argument("-O", "--compilation-config", default=None, help="CompilationConfig as JSON")
    check.add_argument("--tokens", type=positive_int, default=16, help="tokens in the batch")
    check.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--atol", type=non_negative_float, default=None, help="default: per dtype")
    check.add_argument("--rtol", type=non_negative_float, default=None, help="default: per dtype")
    check.add_argument("--use-transformers", action="store_true", help="run through the adapter")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument(
        "--capture-safety",
        action="store_true",
        help="check the pieces for what breaks CUDA graph capture, on any device",
    )
    check.set_defaults(func=cmd_check)
