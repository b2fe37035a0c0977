"""Restarting the model's workers after they died, within a budget.

A worker process can die under a running server (killed, out of memory, a crash in a C
kernel). The online engine fails the requests it was running, then asks ``WorkerRestarts``
to start the workers again: the compiled programs load from the warm compile cache, so a
restart takes seconds. Each attempt counts against ``max_restarts`` over the process's
life; a failed attempt is retried after a doubling wait. Past the budget the engine stays
dead and the server exits non-zero, so that a supervisor (systemd, Kubernetes) starts a
fresh process instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class WorkerDeath:
    cause: str  # the executor's words: which rank, killed by what
    failed_requests: int  # requests that were running or queued on the dead workers
    restart_seconds: float | None = None  # from the death to serving again; None: never


class WorkerRestarts:
    def __init__(
        self,
        restart: Callable[[], None] | None,
        max_restarts: int = 3,
        backoff_s: float = 1.0,
    ):
        """``restart``: starts the workers again (``LLM.restart_workers``); None: never
        restart (an engine in this process has no workers to lose)."""
        self.restart = restart
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.attempts = 0  # over the process's life, failed ones included
        self.deaths: list[WorkerDeath] = []

    @property
    def can_restart(self) -> bool:
        return self.restart is not None and self.attempts < self.max_restarts

    @property
    def restarted(self) -> int:
        return sum(d.restart_seconds is not None for d in self.deaths)

    def recover(self, death: WorkerDeath) -> bool:
        """Start the workers again after ``death`` (recorded in ``deaths``); False once the
        budget is spent."""
        died_at = time.monotonic()
        tries = 0
        while self.can_restart:
            if tries:
                time.sleep(self.backoff_s * 2 ** (tries - 1))
            tries += 1
            self.attempts += 1
            logger.warning(
                "restarting the workers (restart %d of at most %d): %s",
                self.attempts, self.max_restarts, death.cause,
            )  # fmt: skip
            try:
                self.restart()
            except Exception:
                logger.exception("restart %d failed", self.attempts)
                continue
            death.restart_seconds = time.monotonic() - died_at
            logger.warning("the workers serve again after %.1f s", death.restart_seconds)
            return True
        return False
