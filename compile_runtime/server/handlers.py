"""``Server``: the online engine behind the routes, and the one way a call's requests reach
it (``submit``): every request of a call is checked (in a worker thread: a constraint's
check compiles it) before any is queued (a bad one is a 400 naming the field), past
``max_waiting`` queued requests a call is a 503. The endpoints are ``completions.py`` and
``chat_completions.py``; the blocking work of preparing a request runs in ``pool``
(``worker_pool.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from compile_runtime.engine.llm import LLM
from compile_runtime.engine.worker_restarts import WorkerRestarts
from compile_runtime.lora.request import LoRARequest
from compile_runtime.server import tool_parsers
from compile_runtime.server.access_log import TokenCounts
from compile_runtime.server.api_error import APIError
from compile_runtime.server.choice import Choice
from compile_runtime.server.engine_inputs import check_length
from compile_runtime.server.grammar_process import GrammarProcesses, tokenizer_info_json
from compile_runtime.server.lora_modules import ServedAdapters
from compile_runtime.server.metrics import ServerMetrics
from compile_runtime.server.response_store import ResponseStore
from compile_runtime.server.worker_pool import NICENESS, WorkerPool


class Server:
    def __init__(
        self,
        llm: LLM,
        *,
        model_name: str,
        model_path: str | None = None,
        max_waiting: int = 256,
        tool_call_parser: str | None = None,
        lora_modules: list[tuple[str, str]] | None = None,
        runtime_lora_updating: bool = False,
        max_worker_restarts: int = 3,
        trust_request_chat_template: bool = False,
        lora_root: str | None = None,
    ):
        """``lora_modules``: (name, directory) of each adapter served from the start;
        ``max_worker_restarts``: how often dead workers are started again before the server
        gives up (``failed``) and exits non-zero; ``trust_request_chat_template``: a request
        may bring its own chat template; ``lora_root``: the directory every adapter loaded at
        run time must be inside."""
        self.llm = llm
        self.trust_request_chat_template = trust_request_chat_template
        self.pool = WorkerPool()
        self.compile_pool = WorkerPool(workers=2, niceness=NICENESS)  # grammars (no GIL)
        self.grammars: GrammarProcesses | None = None  # each compiled in a child first
        self.tool_parser = tool_parsers.tool_call_parser(tool_call_parser)  # "auto" tool calls
        self.model_name = model_name
        self.model_path = model_path or model_name
        self.max_waiting = max_waiting
        self.engine: AsyncEngine | None = None
        self.max_worker_restarts = max_worker_restarts
        self.failed = False  # the engine stopped for good: the process must exit non-zero
        self.on_failed: Callable[[], None] | None = None  # from the engine's thread
        self.metrics: ServerMetrics | None = None
        self.created = int(time.time())
        self.adapters = ServedAdapters(model_name, llm.core, runtime_lora_updating, lora_root)
        self.responses = ResponseStore()  # /v1/responses kept for previous_response_id
        for name, path in lora_modules or []:
            try:
                self.adapters.add(name, path, trusted=True)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None

    @property
    def max_model_len(self) -> int:
        return self.llm.runner_config.max_model_len

    def start(self) -> None:
        if self.max_worker_restarts > 0:
            self.llm.keep_standby_workers()
        restarts = WorkerRestarts(self.llm.restart_workers, self.max_worker_restarts)
        self.engine = AsyncEngine(
            self.llm.core, max_waiting=self.max_waiting, restarts=restarts, on_fatal=self._fatal
        )
        self.metrics = ServerMetrics(self.engine)

    def _fatal(self) -> None:
        self.failed = True
        if self.on_failed is not None:
            self.on_failed()

    def stop(self) -> None:
        self.pool.shutdown()
        self.compile_pool.shutdown()
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
        self.llm.shutdown()

    async def compile_constraint(self, constraint: Any, param: str | None) -> None:
        """Compile an output constraint's grammar against the tokenizer ahead of the engine
        (into the cache its own compile then hits): first in a child process killed at the
        time bound (``grammar_process.py``), so that a grammar too slow to compile is this
        request's 400 and stops using the CPU, never a stall of the scheduler."""
        manager = getattr(getattr(self.llm.core, "scheduler", None), "structured_outputs", None)
        if constraint is None or manager is None:
            return
        if self.grammars is None:
            self.grammars = GrammarProcesses(lambda: tokenizer_info_json(manager))
        await self.grammars.check(constraint, param, self.pool.timeout_s)
        await self.compile_pool.run(
            manager.compile_ahead, constraint, what="compiling the output constraint",
            param=param,
        )  # fmt: skip

    def _check(self, requests: list, fields: tuple[str, str]) -> None:
        """The engine's checks of a call's requests (a constraint is compiled to check it)."""
        for r in requests:
            try:
                self.llm.core.check(r)
            except ValueError as e:  # the engine names its request: the user sent no id
                message = str(e).replace(f"request {r.req_id!r}: ", "")
                message = message.replace(f"request {r.req_id!r} ", "the request ")
                param = "logit_bias" if message.startswith("logit_bias") else fields[0]
                raise APIError(400, message, param) from None

    async def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        fields: tuple[str, str],  # the request's names of the prompt and of max_tokens
        tokens: TokenCounts,
        lora_request: LoRARequest | None = None,
    ) -> list[Choice]:
        """Check every request of the call, then queue them all (or none)."""
        for p in prompts:
            check_length(len(p), params[0].max_tokens, self.max_model_len, *fields)
        engine = self.engine
        requests = [
            self.llm.core.make_request(p, sp, lora_request) for p in prompts for sp in params
        ]
        await self.pool.run(self._check, requests, fields, what="checking the request",
                            param=fields[0])  # fmt: skip
        tokens.prompt = sum(len(p) for p in prompts) * len(params)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(tokens.prompt)
        choices = []
        try:
            for i, r in enumerate(requests):
                sp = r.sampling_params
                text = (self.llm.tokenizer, sp.stop, sp.include_stop_str_in_output,
                        sp.skip_special_tokens)  # fmt: skip
                choices.append(Choice(*text, index=i, stream=engine.submit(r)))
        except (EngineOverloadedError, EngineDeadError) as e:
            for c in choices:
                engine.abort(c.stream.request.req_id)
            raise APIError(503, str(e)) from None
        tokens.choices = choices
        return choices
