"""The online engine: one step loop per process, requests joining and leaving while it runs.

A background thread owns the ``EngineCore`` (scheduler, executor): it takes new
requests, aborts and stops (a caller's text reached a stop string: the request ends as
"stop") from an inbox between steps, runs a step whenever anything is unfinished and
sleeps otherwise, and hands each request's tokens to its ``RequestStream`` as they are
sampled; every end of a request reaches the ``finish_hooks`` once, with its reason.
Callers live on an asyncio loop: they ``submit`` a request and iterate its stream; leaving
the iteration early (a client that went away) aborts the request, which frees its KV
blocks at the next turn of the loop. Requests waiting for their first step are counted, and
past ``max_waiting`` a new one is refused (``EngineOverloadedError``) instead of
queueing without bound. When the executor's workers die (mid-step, or found dead while
idle), every request on them ends with an ``ErrorEvent`` naming the cause, new ones are
refused (``EngineDeadError``) while ``WorkerRestarts`` starts the workers again, and the
loop goes on; past the restart budget it stops for good and calls ``on_fatal``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from compile_runtime.core.request import Request
from compile_runtime.engine.core import EngineCore, StepFailedError, StepOutput
from compile_runtime.engine.worker_restarts import WorkerDeath, WorkerRestarts
from compile_runtime.executor import ExecutorError

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; try again later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (its executor failed or it was shut down)."""


@dataclass
class TokenEvent:
    token: int
    logprobs: object = None
    stop_token: bool = False  # the stop token that ends the request: not in the text


@dataclass
class FinishEvent:
    reason: str  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, as vLLM reports


@dataclass
class ErrorEvent:
    message: str


Event = TokenEvent | FinishEvent | ErrorEvent


class RequestStream:
    """One request's events, pushed from the engine thread, read on the caller's loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.waiting = True  # counted in AsyncEngine.num_waiting until its first event
        # Per prompt token (None for the first), when the request asked for prompt logprobs;
        # complete once the first token arrives (written by the engine thread before it).
        self.prompt_logprobs: list | None = None

    def push(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


StepHook = Callable[[StepOutput, "AsyncEngine"], None]
FinishHook = Callable[[RequestStream, str], None]  # (stream, finish reason), once a request


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        *,
        max_waiting: int = 256,
        restarts: WorkerRestarts | None = None,
        on_fatal: Callable[[], None] | None = None,
    ):
        """``restarts``: how dead workers are started again (None: never); ``on_fatal``:
        called from the loop's thread once it stopped for good (the server exits)."""
        self.core = core
        self.restarts = restarts or WorkerRestarts(None)
        self.on_fatal = on_fatal
        self.max_waiting = max_waiting
        self.streams: dict[str, RequestStream] = {}  # engine thread only (after the inbox)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._num_waiting = 0  # submitted, not yet given a token or finished (under _lock)
        self._stopping = False
        self._dead: str | None = None
        self.step_hooks: list[StepHook] = []
        self.token_hooks: list[Callable[[RequestStream, float], None]] = []
        self.finish_hooks: list[FinishHook] = []  # every end: step, stop string, abort
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any thread; streams are read on an asyncio loop) ------------------

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def submit(self, request: Request) -> RequestStream:
        """Queue a checked request; its events arrive on the returned stream."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping:
            raise EngineOverloadedError("the server is shutting down")
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                raise EngineOverloadedError(
                    f"{self._num_waiting} requests are waiting (max_waiting={self.max_waiting})"
                )
            self._num_waiting += 1
        stream = RequestStream(request, asyncio.get_running_loop())
        self._inbox.put(("add", stream))
        self._wake.set()
        return stream

    def abort(self, req_id: str) -> None:
        self._inbox.put(("abort", req_id))
        self._wake.set()

    def stop(self, req_id: str, stop_string: str) -> None:
        """End a request whose text reached ``stop_string``: finished as "stop", not aborted."""
        self._inbox.put(("stop", (req_id, stop_string)))
        self._wake.set()

    async def events(self, stream: RequestStream) -> AsyncIterator[Event]:
        """The stream's events up to its finish; leaving early aborts the request."""
        done = False
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if not isinstance(event, TokenEvent):
                    done = True
                    return
        finally:
            if not done:
                self.abort(stream.request.req_id)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def dead_reason(self) -> str | None:
        """Why no request is taken now (the workers died, or restart), None while serving."""
        return self._dead

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish what is running (no new requests), then stop the loop; what still runs
        after ``timeout`` seconds is aborted."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("still running after %s s: aborting the rest", timeout)
            self._inbox.put(("abort_all", None))
            self._wake.set()
            self._thread.join()

    # ---- engine thread ------------------------------------------------------------------

    def _not_waiting(self, stream: RequestStream) -> None:
        if stream.waiting:
            stream.waiting = False
            with self._lock:
                self._num_waiting -= 1

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                stream = item
                self.streams[stream.request.req_id] = stream
                self.core.add([stream.request])
                continue
            if kind == "abort_all":
                for req_id in list(self.streams):
                    self._end(req_id, None)
                continue
            self._end(*(item if kind == "stop" else (item, None)))

    def _end(self, req_id: str, stop_string: str | None) -> None:
        """Abort a request, or stop it at ``stop_string``; a finished one is left alone."""
        stream = self.streams.pop(req_id, None)
        if stream is None:
            return
        if stop_string is None:
            self.core.abort([req_id])
            event = FinishEvent("abort")
        else:
            self.core.stop({req_id: stop_string})
            event = FinishEvent("stop", stop_string)
        self._not_waiting(stream)
        self._finished(stream, event.reason)
        stream.push(event)

    def _finished(self, stream: RequestStream, reason: str) -> None:
        for hook in self.finish_hooks:
            hook(stream, reason)

    def _run(self) -> None:
        try:
            while not self._serve():
                pass
        except BaseException as e:  # a bug of ours: nothing can be served any more
            self._fail_streams(f"the engine loop stopped: {type(e).__name__}: {e}")
            logger.exception("engine loop stopped")
            if self.on_fatal is not None:
                self.on_fatal()

    def _serve(self) -> bool:
        """Run steps until shut down or past the restart budget (True), or until the
        workers died and came back (False)."""
        try:
            while True:
                self._drain_inbox()
                if not self.core.has_unfinished():
                    if self._stopping:
                        return True
                    self._wake.wait(0.1)  # and a worker death is seen within 0.1 s
                    self._wake.clear()
                    self.core.check_workers()
                    continue
                try:
                    out = self.core.step()
                except StepFailedError as e:
                    logger.error("%s", e)
                    for req_id in e.failed_req_ids:
                        stream = self.streams.pop(req_id, None)
                        if stream is not None:
                            self._not_waiting(stream)
                            stream.push(ErrorEvent(str(e)))
                    continue
                self._deliver(out)
        except ExecutorError as e:
            death = WorkerDeath(str(e), len(self.streams))
            restart = not self._stopping and self.restarts.can_restart
            then = "the server restarts them" if restart else "they are not restarted"
            self._fail_streams(f"the model's workers died ({e}); {then}")
            logger.error("the model's workers died: %s", e)
            self.restarts.deaths.append(death)
            if restart and self.restarts.recover(death):
                self._dead = None
                return False
            self._dead = f"the model's workers died and were not restarted: {e}"
            if self.on_fatal is not None:
                self.on_fatal()
            return True

    def _fail_streams(self, message: str) -> None:
        """End every request with ``message``; new ones are refused until ``_dead`` clears."""
        self._dead = message
        for stream in self.streams.values():
            self._not_waiting(stream)
            stream.push(ErrorEvent(message))
        self.streams.clear()

    def _deliver(self, out: StepOutput) -> None:
        """Hand the step's events to their streams: one wake-up of each caller loop per step,
        not one per token."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Event]]] = {}
        self._collect_events(out, batches)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        for hook in self.step_hooks:
            hook(out, self)

    def _collect_events(self, out: StepOutput, batches: dict) -> None:
        now = time.perf_counter()
        for req_id, (first, lps) in out.prompt_logprobs.items():
            stream = self.streams.get(req_id)
            if stream is not None:
                if stream.prompt_logprobs is None:
                    stream.prompt_logprobs = [None] * len(stream.request.prompt_token_ids)
                stream.prompt_logprobs[first : first + len(lps)] = lps
        stop_tokens = out.stop_token_positions()
        for i, (req_id, token, logprobs) in enumerate(out.tokens):
            stream = self.streams.get(req_id)
            if stream is None:
                continue
            self._not_waiting(stream)
            for hook in self.token_hooks:
                hook(stream, now)
            if stream.first_token_at is None:
                stream.first_token_at = now
            stream.last_token_at = now
            event = TokenEvent(token, logprobs, i in stop_tokens)
            batches.setdefault(stream.loop, []).append((stream, event))
        for request in out.finished:
            stream = self.streams.pop(request.req_id, None)
            if stream is not None:
                self._not_waiting(stream)
                event = FinishEvent(request.finish_reason or "stop", request.stop_reason)
                self._finished(stream, event.reason)
                batches.setdefault(stream.loop, []).append((stream, event))


def _put_all(items: list[tuple[RequestStream, Event]]) -> None:
    for stream, event in items:
        stream.queue.put_nowait(event)
