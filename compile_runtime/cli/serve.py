"""``compile-runtime serve``: its flags, and the engine it starts behind the HTTP server.

Nothing here imports the server's web framework until the command runs, so the other
commands work where fastapi and uvicorn are not installed."""

from __future__ import annotations

import argparse
import os

from compile_runtime.cli.argtypes import float_in, int_at_least, positive_int, string_list
from compile_runtime.cli.engine_flags import add_engine_arguments, engine_from_args
from compile_runtime.platforms.select import platform_for
from compile_runtime.server.request_limits import RequestLimits
from compile_runtime.server.tool_parsers import PARSERS


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server on a model directory")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model")
    add_engine_arguments(serve, model_required=False)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int_at_least(0), default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients ask for (default: DIR)"
    )
    serve.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="requests waiting for their first step before new ones get a 503",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="answer tool_choice='auto' (and tools without a tool_choice): the model's own "
        "tool-call syntax parsed out of its text into tool_calls (needs --tool-call-parser)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the model family's tool-call format: hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen 2-3, SmolLM3), llama3_json (Llama 3.1-3.3)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (a request's model field), each name=PEFT directory "
        'or JSON {"name": ..., "path": ...} (needs --enable-lora)',
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or set "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    serve.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="the directory every adapter loaded at run time (/v1/load_lora_adapter) must be "
        "inside, symlinks resolved; without it, loading by path at run time is refused",
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat template (chat_template, or in "
        "chat_template_kwargs); default: only the model's own template renders",
    )
    serve.add_argument(
        "--disable-access-log",
        action="store_true",
        help="no INFO line per request (method, path, status, tokens, seconds)",
    )
    serve.add_argument(
        "--max-worker-restarts",
        type=int_at_least(0),
        default=3,
        help="times the model's worker processes are started again after dying (the requests "
        "on them fail with a 500), in standby processes kept imported for it (one per rank, "
        "idle); past that the server exits non-zero for a supervisor; 0 keeps no standby",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float_in(0.0, float("inf")),
        default=60.0,
        help="seconds SIGTERM lets running requests finish (new ones get a 503) before the "
        "rest are aborted",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (repeat for several keys; "
        "default: $VLLM_API_KEY or $COMPILE_RUNTIME_API_KEY, else no key)",
    )
    serve.add_argument(
        "--allowed-origins",
        type=string_list,
        default=[],
        help='browser origins CORS lets in, as JSON (["https://a.example"]) or comma-separated; '
        "default: none (CORS off)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=RequestLimits.max_body_bytes,
        help="bigger request bodies get a 413",
    )
    serve.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=RequestLimits.max_prompts,
        help="prompts one /v1/completions call may send",
    )
    serve.add_argument(
        "--max-choices-per-request",
        type=positive_int,
        default=RequestLimits.max_choices,
        help="prompts x n one call may ask for",
    )
    serve.add_argument(
        "--max-body-bytes-in-flight",
        type=positive_int,
        default=RequestLimits.max_body_bytes_in_flight,
        help="bytes of large request bodies (1 MiB or more) handled at once; past it a large "
        "body waits, then gets a 503",
    )
    serve.add_argument(
        "--max-prepare-seconds",
        type=float_in(0.0, float("inf"), low_open=True),
        default=RequestLimits.prepare_seconds,
        help="seconds each step of preparing a request (tokenizing, the chat template, "
        "checking an output constraint, loading an adapter) may take before the request gets "
        "a 400",
    )
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from compile_runtime.device import default_device
    from compile_runtime.server.run import serve

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"serve {args.model_tag} --model {args.model}: give the model once")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ValueError("serve needs a model: compile-runtime serve MODEL (or --model MODEL)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise ValueError(f"--lora-root {args.lora_root}: not a directory")

    platform = platform_for(args.device or default_device())
    if args.distributed_executor_backend is None and platform.serves_from_worker:
        # The model in a worker process, so the step loop does not share this process's GIL
        # with HTTP, JSON and detokenizing: it serves more tokens/s than running it here
        # (benchmarks/serve_vs_vllm.py; the README's served table gives both).
        args.distributed_executor_backend = "mp"
    return serve(args, engine_from_args(args))
