"""Run the server: uvicorn on the app, SIGTERM drains running requests, then exits."""

from __future__ import annotations

import argparse
import logging

from compile_runtime.engine.llm import LLM
from compile_runtime.server.lora_modules import parse_lora_module, runtime_updating_from_env

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace, llm: LLM) -> int:
    import uvicorn

    from compile_runtime.server.app import build_app
    from compile_runtime.server.handlers import Server

    server = Server(
        llm,
        model_name=args.served_model_name or args.model,
        model_path=args.model,
        max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        lora_modules=[parse_lora_module(m) for m in args.lora_modules or []],
        runtime_lora_updating=args.allow_runtime_lora_updating or runtime_updating_from_env(),
    )
    if not args.disable_access_log:  # one INFO line per request (access_log.py)
        logging.getLogger("compile_runtime.server.access").setLevel(logging.INFO)
    app = build_app(server)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=None,  # SIGTERM: stop accepting, let running requests finish
    )
    print(
        f"# {llm.startup.summary()}\n# serving {server.model_name!r} on "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.Server(config).run()
    return 0
