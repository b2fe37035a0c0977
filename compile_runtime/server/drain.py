"""Stopping the server without cutting anyone off: SIGTERM (or Ctrl-C) drains it.

On the first signal the engine takes no new request (a 503 "the server is shutting down",
``/health`` 503) while the port stays open, so a client gets an answer rather than a
refused connection; the running requests finish, for at most ``shutdown_timeout`` seconds,
after which the rest are aborted (a stream ends with finish_reason "abort"). Then uvicorn
closes the connections and the process exits 0. A second Ctrl-C exits at once. An engine
that stopped for good (its workers died past the restart budget) ends the process too.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import uvicorn

from compile_runtime.server.handlers import Server


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, server: Server, shutdown_timeout: float):
        super().__init__(config)
        self.server = server
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        server.on_failed = self.exit_now

    def exit_now(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler. Unlike uvicorn's own, it does not raise the signal
        again after the shutdown: a drained server exits 0."""
        if self.draining:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        if self.server.engine is not None:
            self.server.engine.shutdown(self.shutdown_timeout)
        self.should_exit = True
