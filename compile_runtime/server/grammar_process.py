"""Output constraints' grammars compiled first in child processes, so that the time bound on
compiling one really stops the work: a grammar that takes longer than
``--max-prepare-seconds`` to compile (a JSON schema of thousands of properties can keep a
core busy for minutes) has its process killed, and its request is a 400 naming the field
and the flag. A constraint that compiled in time is then compiled in the server's own
process (where the engine finds it in xgrammar's cache), and its digest is remembered
(the last ``KNOWN`` of them), so that the same constraint again skips the child.

``PROCESSES`` children, started on the first constraint and kept (each imports xgrammar,
hence torch: a few seconds) with the tokenizer's vocabulary, at a lower CPU priority
(``worker_pool.NICENESS``); a killed one is replaced in the background. A request that
waited for a free child past the bound is a 503 (retry). The children read jobs as JSON
lines on stdin and answer one line each on stdout; one exits when its stdin closes (the
server is gone).

    python -m compile_runtime.server.grammar_process   # a child, as the server starts it
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from compile_runtime.server.api_error import APIError

logger = logging.getLogger(__name__)

PROCESSES = 2
KNOWN = 1024
START_SECONDS = 120.0  # a child's start (imports) is not the request's to pay for
NICENESS = 10  # as worker_pool.NICENESS (not imported: the child imports nothing of the server)


def job_of(params: Any) -> tuple[str, str] | None:
    """(kind, text) of what the engine compiles for ``params`` (a ``StructuredOutputsParams``),
    or None for the built-in JSON grammar (always quick)."""
    from compile_runtime.core.structured_output import _choice_grammar, _schema_text

    if params.json_schema is not None:
        return "json", _schema_text(params)
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "grammar", _choice_grammar(params.choice)
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


class Child:
    """One child process: ``compile`` sends it a job and waits for its answer."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(cls, tokenizer_info: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "compile_runtime.server.grammar_process",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )  # fmt: skip
        child = cls(proc)
        try:
            answer = await child._ask({"tokenizer_info": tokenizer_info})
        except BaseException:
            child.kill()
            raise
        if not answer.get("ready"):
            child.kill()
            raise RuntimeError(f"the grammar process did not start: {answer.get('error')}")
        return child

    async def _ask(self, message: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise ConnectionError(f"the grammar process exited ({self.proc.returncode})")
        return json.loads(line)

    async def compile(self, kind: str, text: str) -> str | None:
        """None when it compiled, else xgrammar's complaint."""
        answer = await self._ask({"kind": kind, "text": text})
        return None if answer.get("ok") else str(answer.get("error"))

    def kill(self) -> None:
        """From any thread (the server's shutdown runs in one)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)


class GrammarProcesses:
    """The children of one server; ``tokenizer_info``: xgrammar's ``TokenizerInfo`` as JSON,
    built on first need (in a worker thread: it reads the whole vocabulary)."""

    def __init__(self, tokenizer_info: Callable[[], str], processes: int = PROCESSES):
        self.processes = processes
        self._tokenizer_info = tokenizer_info
        self._info: str | None = None
        self._idle: list[Child] = []
        self._freed: asyncio.Condition | None = None
        self._running = 0  # started or starting, idle or busy
        self._busy = 0  # taken by a request
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._children: set[Child] = set()  # idle and busy, to kill at shutdown
        self._closed = False
        self.unavailable: str | None = None  # why no child could start: compiled in-process

    @property
    def known(self) -> int:
        return len(self._known)

    async def _spawn(self) -> None:
        """Start one child into the idle list (``_running`` counts it already)."""
        try:
            if self._info is None:
                self._info = await asyncio.to_thread(self._tokenizer_info)
            child = await Child.start(self._info)
        except Exception:
            self._running -= 1
            await self._notify()  # whoever waits for it learns it will not come
            raise
        except BaseException:
            self._running -= 1
            raise
        self._children.add(child)
        if self._closed:
            child.kill()
            return
        self._idle.append(child)
        await self._notify()

    async def _notify(self) -> None:
        assert self._freed is not None
        async with self._freed:
            self._freed.notify_all()

    def _drop(self, child: Child) -> None:
        child.kill()
        self._children.discard(child)
        self._running -= 1
        self._busy -= 1
        self._reap(child)

    def _reap(self, child: Child) -> None:
        """Wait for a killed child in the background (its pipes closed, no zombie)."""
        task = asyncio.ensure_future(child.proc.wait())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replace(self) -> None:
        """One more child starts in the background (one was killed, or on first use)."""
        if self._closed:
            return
        self._running += 1
        task = asyncio.ensure_future(self._spawn())
        self._tasks.add(task)
        task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("the grammar process did not start: %s", task.exception())

    async def _take(self, timeout: float) -> Child | None:
        if self._freed is None:
            self._freed = asyncio.Condition()
        if not self._idle and self._running < self.processes:
            first = self._running == 0
            self._running += 1
            await asyncio.wait_for(self._spawn(), START_SECONDS)
            for _ in range(self.processes - self._running if first else 0):
                self._replace()  # the others start now, warm for the next requests
        # A child that is starting is the server's to wait for, not the request's: the
        # request's bound counts only while every child is busy with others.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._freed:
            while not self._idle:
                starting = self._running > self._busy
                left = (START_SECONDS if starting else 0.0) + deadline - loop.time()
                if left <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), left)
                if self._running == 0:  # every start failed
                    raise RuntimeError("no grammar process could start")
            self._busy += 1
            return self._idle.pop()

    async def check(self, params: Any, param: str | None, timeout_s: float) -> None:
        """Compile ``params`` in a child within ``timeout_s``: a 400 past it (the child is
        killed), a 503 when no child was free that long."""
        job = job_of(params)
        if job is None:
            return
        key = hashlib.sha256(f"{job[0]}\0{job[1]}".encode("utf-8", "surrogatepass")).digest()
        if key in self._known:
            self._known.move_to_end(key)
            return
        if self.unavailable is not None:
            return
        try:
            child = await self._take(timeout_s)
        except Exception as e:  # noqa: BLE001 - no child: the in-process bound still holds
            self.unavailable = f"{type(e).__name__}: {e}"
            logger.warning(
                "output constraints are compiled without a process to stop them at the time "
                "bound: the grammar process did not start (%s)", self.unavailable,
            )  # fmt: skip
            return
        if child is None:
            raise APIError(503, "the server is busy compiling other output constraints; retry")
        where = f"{param}: " if param else ""
        try:
            error = await asyncio.wait_for(child.compile(*job), timeout_s)
        except TimeoutError:
            self._drop(child)
            self._replace()
            raise APIError(
                400,
                f"{where}compiling the output constraint took more than {timeout_s:g} s, the "
                "most this server gives one request (--max-prepare-seconds); send a smaller "
                "constraint",
                param,
            ) from None
        except BaseException as e:  # the child died, or the request was cancelled mid-job
            self._drop(child)
            self._replace()
            if isinstance(e, ConnectionError | OSError | ValueError):
                raise APIError(
                    400, f"{where}the output constraint could not be compiled", param
                ) from None
            raise
        self._busy -= 1
        self._idle.append(child)
        await self._notify()
        if error is not None:
            raise APIError(400, f"{where}the output constraint is not valid: {error}", param)
        self._known[key] = None
        while len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def shutdown(self) -> None:
        """Kill every child, idle or busy (from any thread)."""
        self._closed = True
        for child in list(self._children):
            child.kill()

    async def close(self) -> None:
        """``shutdown``, then wait until every child and start is over."""
        self.shutdown()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(c.proc.wait() for c in self._children))


def tokenizer_info_json(manager: Any) -> str:
    """xgrammar's ``TokenizerInfo`` of a ``StructuredOutputManager``'s tokenizer, as the
    manager builds it, in JSON."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(
        manager.tokenizer, vocab_size=manager.vocab_size, stop_token_ids=manager.stop_token_ids
    )
    return info.serialize_json()


def main() -> int:
    """A child: the tokenizer's info on the first line, then one job a line."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the answers
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, NICENESS)
    with contextlib.suppress(OSError, AttributeError, TypeError):  # Linux: die with the server
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, signal.SIGKILL)

    def answer(message: dict) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    try:
        import xgrammar as xgr

        first = sys.stdin.buffer.readline()
        if not first:
            return 0
        info = xgr.TokenizerInfo.deserialize_json(json.loads(first)["tokenizer_info"])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    except Exception as e:  # noqa: BLE001 - told to the server
        answer({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    answer({"ready": True})
    compile_by_kind = {
        "json": compiler.compile_json_schema,
        "regex": compiler.compile_regex,
        "grammar": compiler.compile_grammar,
    }
    for line in sys.stdin.buffer:
        job = json.loads(line)
        try:
            compile_by_kind[job["kind"]](job["text"])
            answer({"ok": True})
        except Exception as e:  # noqa: BLE001 - the request's to report
            answer({"ok": False, "error": str(e)[:500]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
