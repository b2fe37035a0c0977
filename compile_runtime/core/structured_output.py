"""Structured outputs on the scheduler's side: each constrained request's grammar (xgrammar),
the token bitmask of each of its logits rows in a step, and its matcher advanced by what it
got.

A constraint is checked when the request is admitted (a bad schema is a ValueError naming
it) and compiled against the tokenizer in a worker thread, cached by constraint, so a slow
schema delays its own request's start, never the running batch. A request whose grammar is
still compiling waits in the queue. Each step, for every scheduled request that samples,
the matcher fills one bitmask row per logits row: the next token, and with speculative
decoding each draft position (the matcher steps through the drafts and back). The runner
masks the logits with them (``grammar_bitmask.py``), so greedy, sampling, penalties and
draft verification all see only allowed tokens. The tokens a request keeps advance its
matcher; a grammar that has ended (it accepted the stop token) ends its request as "stop",
and a kept token outside the grammar (a bug) aborts it with an error logged.
Requests without a constraint cost nothing here.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from compile_runtime.core.request import Request, RequestStatus
from compile_runtime.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")

# Compiled grammars kept for reuse (least recently used dropped past it): every distinct
# constraint a client sends would otherwise stay in memory for the engine's life.
GRAMMAR_CACHE_BYTES = 256 * 2**20


def _schema_text(params: StructuredOutputsParams) -> str:
    schema = params.json_schema
    return schema if isinstance(schema, str) else json.dumps(schema)


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def check_constraint(params: StructuredOutputsParams) -> None:
    """ValueError naming what is wrong with the constraint (parsed without a tokenizer)."""
    import xgrammar as xgr

    try:
        if params.json_schema is not None:
            text = _schema_text(params)
            json.loads(text)
            xgr.Grammar.from_json_schema(text)
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        elif params.grammar is not None:
            xgr.Grammar.from_ebnf(params.grammar)
        elif params.choice is not None:
            xgr.Grammar.from_ebnf(_choice_grammar(params.choice))
    except Exception as e:  # noqa: BLE001 - xgrammar's and json's errors, one message
        what = next(n for n in ("json_schema", "regex", "grammar", "choice") if getattr(params, n))
        name = "json" if what == "json_schema" else what
        reason = _LOG_PREFIX.sub("", str(e)).strip()  # xgrammar's "[time] file.cc:line: "
        raise ValueError(f"structured_outputs.{name} is not valid: {reason}") from None


class StructuredOutputManager:
    """The grammars of the scheduler's constrained requests (xgrammar loaded on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling: dict[str, Future] = {}
        self._matchers: dict[str, Any] = {}
        # Constrained requests, compiling or compiled: the scheduler asks only about these.
        self.requests: set[str] = set()

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def compile_ahead(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` into the compiler's cache in the caller's thread (the server's,
        under its own time bound), so that the request's compile here is a cache hit and no
        slow grammar holds the scheduler."""
        self._compile(params)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:  # compile_ahead runs in other threads
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
        compiler = self._compiler
        if params.json_schema is not None:
            compiled = compiler.compile_json_schema(_schema_text(params))
        elif params.json_object:
            compiled = compiler.compile_builtin_json_grammar()
        elif params.regex is not None:
            compiled = compiler.compile_regex(params.regex)
        elif params.choice is not None:
            compiled = compiler.compile_grammar(_choice_grammar(params.choice))
        else:
            compiled = compiler.compile_grammar(params.grammar)
        return xgr.GrammarMatcher(compiled)

    def start(self, request: Request) -> None:
        """Compile the request's constraint in the worker thread (cached by constraint)."""
        params = request.sampling_params.structured_outputs
        if params is not None and request.req_id not in self._matchers:
            self.requests.add(request.req_id)
            self._compiling[request.req_id] = self._pool.submit(self._compile, params)

    def ready(self, request: Request, wait: bool = False) -> bool:
        """Whether the request may be scheduled: unconstrained, or its grammar compiled
        (``wait``: block until it is, when there is nothing else to run)."""
        future = self._compiling.get(request.req_id)
        if future is None:
            return True
        if not (wait or future.done()):
            return False
        del self._compiling[request.req_id]
        matcher = self._matchers[request.req_id] = future.result()
        for token in request.output_token_ids:  # tokens it had before (none, usually)
            matcher.accept_token(token)
        return True

    def is_constrained(self, req_id: str) -> bool:
        return req_id in self._matchers

    def bitmask(self, req_id: str, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), words] int32: the allowed tokens at the next position and at
        each draft's, as if the drafts before it were accepted (an invalid draft ends the
        walk; the rows after it repeat its row, whatever the verifier decides of them)."""
        import xgrammar as xgr

        matcher = self._matchers[req_id]
        rows = xgr.allocate_token_bitmask(1 + len(drafts), self.vocab_size)
        accepted = 0
        for i in range(1 + len(drafts)):
            if i > accepted:  # the draft before this row was not accepted
                rows[i] = rows[accepted]
                continue
            matcher.fill_next_token_bitmask(rows, i)
            if i < len(drafts) and matcher.accept_token(drafts[i]):
                accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return rows.numpy()

    def bitmasks(self, out: Any, requests: dict[str, Request]) -> dict[str, np.ndarray]:
        """The bitmasks of a step (``out``: a SchedulerOutput) for each constrained request
        that samples in it: its whole known sequence computed by the step's end."""
        masks = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = requests[req_id]
            if req_id in self._matchers and req.num_computed_tokens + n >= req.num_tokens:
                drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
                masks[req_id] = self.bitmask(req_id, drafts)
        return masks

    def accept(self, req_id: str, tokens: list[int]) -> RequestStatus | None:
        """Advance the request's matcher by the tokens it kept: STOPPED when its grammar
        ended, ABORTED (logged) for a token outside it, never a quiet wrong answer."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return None
        for token in tokens:
            if not matcher.accept_token(token):
                logger.error(
                    "request %s: token %d is outside its grammar; aborting it", req_id, token
                )
                return RequestStatus.FINISHED_ABORTED
        return RequestStatus.FINISHED_STOPPED if matcher.is_terminated() else None

    def free(self, req_id: str) -> None:
        self.requests.discard(req_id)
        self._matchers.pop(req_id, None)
        future = self._compiling.pop(req_id, None)
        if future is not None:
            future.cancel()
