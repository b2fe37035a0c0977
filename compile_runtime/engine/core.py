"""The engine's step loop body, shared by offline ``LLM.generate`` and the online server.

``EngineCore`` owns the scheduler and the executor and knows nothing of who
waits for the tokens: ``step()`` schedules, runs the model on every rank,
advances the scheduler and returns what each request got this step. Requests
are added and aborted between steps (an abort frees the request's KV blocks at
once; the runner drops its state at the next step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from compile_runtime.executor import Executor, ExecutorError
from compile_runtime.core.request import Request, RequestStatus
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.core.stop_rules import ended_by_stop_token


class StepError(RuntimeError):
    """A step raised; the requests it ran were aborted (blocks freed), the others go on."""

    def __init__(self, message: str, failed_req_ids: list[str], cause: BaseException):
        super().__init__(message)
        self.failed_req_ids = failed_req_ids
        self.cause = cause


@dataclass
class StepOutput:
    # (request id, sampled token, logprobs or None) for every token a request got, in order.
    tokens: list[tuple[str, int, object]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    decode_only: bool = False  # every scheduled request decoded (one token + its drafts)
    num_scheduled_tokens: int = 0
    seconds: float = 0.0
    runtime_mode: str | None = None  # the CUDA graph mode the step ran in (rank 0)
    unreplayed_reason: str | None = None  # why no graph ran, when graphs are on
    # req_id -> (first prompt position, logprobs of the prompt tokens from there).
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)

    def stop_token_positions(self) -> set[int]:
        """Which of ``tokens`` are the stop token that ended their request (text left out)."""
        ended = {r.req_id for r in self.finished if ended_by_stop_token(r)}
        last = {req_id: i for i, (req_id, _, _) in enumerate(self.tokens) if req_id in ended}
        return set(last.values())


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor

    def check(self, request: Request) -> None:
        """ValueError naming what is wrong with ``request`` (nothing is queued)."""
        self.scheduler.check_request(request)

    def add(self, requests: list[Request]) -> None:
        self.scheduler.add_requests(requests)

    def abort(self, req_ids: list[str]) -> list[Request]:
        """Drop unfinished requests now: their blocks are free before this returns."""
        return self.scheduler.abort_requests(req_ids)

    def stop(self, stops: dict[str, str]) -> list[Request]:
        """End requests whose text reached a stop string (``req_id -> the string``): finished
        as "stop", their blocks free before this returns."""
        stopped = self.scheduler.finish_requests(list(stops), RequestStatus.FINISHED_STOPPED)
        for req in stopped:
            req.stop_reason = stops[req.req_id]
        return stopped

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_blocks_in_use(self) -> int:
        pool = self.scheduler.block_pool
        return pool.num_usable - pool.num_free

    def step(self) -> StepOutput:
        """One scheduler step through the model. A failing step aborts the requests it ran and
        raises ``StepError``; ``ExecutorError`` (the workers are gone) and interrupts pass
        through (an interrupt after aborting the step's requests)."""
        start = time.perf_counter()
        so = None
        try:
            so = self.scheduler.schedule()
            self.executor.execute_model(so)
            out = self.executor.sample_tokens()
            finished = self.scheduler.update_from_output(so, out)
        except BaseException as e:
            if isinstance(e, ExecutorError):
                raise
            failed = list(so.num_scheduled_tokens) if so is not None else []
            self.scheduler.abort_requests(failed, so)
            if not isinstance(e, Exception):  # the caller interrupted: theirs to handle
                raise
            raise StepError(
                f"step failed on request(s) {', '.join(failed) or '(none: scheduling)'}: "
                f"{type(e).__name__}: {e}",
                failed,
                e,
            ) from e
        counts, drafts = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
        tokens = []
        for req_id, ids, lps in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
            for i, token in enumerate(ids):
                tokens.append((req_id, token, lps[i] if lps is not None else None))
        return StepOutput(
            tokens=tokens,
            finished=finished,
            decode_only=bool(counts)
            and all(n == 1 + len(drafts.get(r, ())) for r, n in counts.items()),
            num_scheduled_tokens=sum(counts.values()),
            seconds=time.perf_counter() - start,
            runtime_mode=out.runtime_mode,
            unreplayed_reason=out.unreplayed_reason,
            prompt_logprobs=out.prompt_logprobs,
        )
