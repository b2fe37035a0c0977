"""Run the server: uvicorn on the app until SIGTERM has drained it (``drain.py``, exit 0)
or the engine stopped for good (its workers died past ``--max-worker-restarts``, exit 1)."""

from __future__ import annotations

import argparse
import logging
import sys

from compile_runtime.engine.llm import LLM
from compile_runtime.server.lora_modules import parse_lora_module, runtime_updating_from_env

logger = logging.getLogger(__name__)


# How long a thread holding the GIL in Python code keeps it while another waits (Python's
# default 5 ms): the event loop waits at most this long behind a worker thread.
SWITCH_INTERVAL_S = 0.001


def serve(args: argparse.Namespace, llm: LLM) -> int:
    import uvicorn

    from compile_runtime.server.api_keys import api_keys
    from compile_runtime.server.app import build_app
    from compile_runtime.server.drain import DrainingServer
    from compile_runtime.server.handlers import Server
    from compile_runtime.server.request_limits import RequestLimits

    server = Server(
        llm,
        model_name=args.served_model_name or args.model,
        model_path=args.model,
        max_waiting=args.max_waiting,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        lora_modules=[parse_lora_module(m) for m in args.lora_modules or []],
        runtime_lora_updating=args.allow_runtime_lora_updating or runtime_updating_from_env(),
        max_worker_restarts=args.max_worker_restarts,
        trust_request_chat_template=args.trust_request_chat_template,
        lora_root=args.lora_root,
    )
    if not args.disable_access_log:  # one INFO line per request (access_log.py)
        logging.getLogger("compile_runtime.server.access").setLevel(logging.INFO)
    limits = RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_prompts=args.max_prompts_per_request,
        max_choices=args.max_choices_per_request,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        prepare_seconds=args.max_prepare_seconds,
    )
    keys = api_keys(args.api_key)
    if not keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "serving on %s without --api-key: anyone who reaches port %d can use the model",
            args.host, args.port,
        )  # fmt: skip
    app = build_app(server, api_keys=keys, allowed_origins=args.allowed_origins, limits=limits)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # After the drain nothing runs; this bounds waiting on clients that keep connections open.
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10
    )
    print(
        f"# {llm.startup.summary()}\n# serving {server.model_name!r} on "
        f"http://{args.host}:{args.port}/v1{' (API key required)' if keys else ''}",
        flush=True,
    )
    DrainingServer(config, server, args.shutdown_timeout).run()
    if server.failed:
        logger.error("exiting: %s", server.engine.dead_reason if server.engine else "no engine")
        return 1
    return 0
