"""The engine core: the one owner of the scheduler, shared by offline ``LLM`` and the server.

It knows nothing of who waits for the tokens: ``step()`` schedules, runs the model on every
rank through the executor, advances the scheduler and returns what each request got.
Under pipeline parallelism up to one step per stage is out at once (a batch queue): each
``step()`` tops the queue up, then waits for the oldest step's tokens, so every stage has
a step to run while the last one samples. Each queued step takes an even share of the
requests, and a request is in one step at a time.
Requests are made, checked, added and aborted here, between steps (an abort frees the
request's KV blocks at once; the worker drops its state at the next step).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from compile_runtime.config import EngineConfig
from compile_runtime.core.request import Request, RequestStatus, ended_by_stop_token
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.core.stats import PrefixCacheStats, SpecDecodeStats
from compile_runtime.core.structured_output import StructuredOutputManager
from compile_runtime.executor import Executor, ExecutorError
from compile_runtime.lora.adapter import AdapterChecker
from compile_runtime.lora.request import LoRARequest


class StepFailedError(RuntimeError):
    """A step raised: the requests it ran (``failed_req_ids``) were aborted, their blocks freed,
    and the engine goes on. An offline call aborts the rest of its requests too and names them
    (``aborted_req_ids``)."""

    def __init__(
        self,
        message: str,
        failed_req_ids: list[str],
        cause: BaseException,
        aborted_req_ids: list[str] | None = None,
    ):
        super().__init__(message)
        self.failed_req_ids = failed_req_ids
        self.cause = cause
        self.aborted_req_ids = aborted_req_ids if aborted_req_ids is not None else failed_req_ids


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
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Any,
        vocab_size: int | None,
        eos_token_ids: list[int],
    ):
        """Adapters (LoRA) are checked against the model's config, ``config.hf_config``."""
        sizes = config.runner_config
        self._grammars = (
            StructuredOutputManager(tokenizer, vocab_size, eos_token_ids)
            if tokenizer is not None and vocab_size
            else None
        )
        self.runner_config = sizes
        self.pipeline_depth = config.pipeline_parallel_size  # steps out at once
        self.eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self._start(executor)
        self.adapters = AdapterChecker(sizes, config.hf_config) if sizes.enable_lora else None
        self._ids = itertools.count()

    def _start(self, executor: Executor) -> None:
        sizes = self.runner_config
        self.executor = executor
        self.in_flight: deque[SchedulerOutput] = deque()
        self.scheduler = Scheduler(
            num_blocks=executor.num_blocks,
            block_size=sizes.block_size,
            max_num_seqs=sizes.max_num_seqs,
            max_num_batched_tokens=sizes.max_num_batched_tokens,
            max_model_len=sizes.max_model_len,
            vocab_size=self._vocab_size,
            enable_prefix_caching=sizes.enable_prefix_caching,
            structured_outputs=self._grammars,
            max_loras=sizes.max_loras if sizes.enable_lora else None,
            pipelined=self.pipeline_depth > 1,
        )

    def reset(self, executor: Executor) -> None:
        """Run on ``executor`` with nothing scheduled and an empty KV cache (a restart after
        the old executor's workers died: their cache is gone, so no prefix may be reused);
        the running totals of the prefix cache and speculative decoding carry over."""
        old = self.scheduler
        old.abort_requests(list(old.requests))  # frees their grammar states
        self._start(executor)
        self.scheduler.prefix_cache_stats = old.prefix_cache_stats
        self.scheduler.spec_decode_stats = old.spec_decode_stats

    def check_workers(self) -> None:
        """``ExecutorError`` when a worker is gone (checked while idle, not only in a step)."""
        self.executor.check_alive()

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """A request with a fresh id and this model's EOS ids, not yet checked or queued."""
        return Request(
            req_id=str(next(self._ids)),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            lora_request=lora_request,
        )

    def check(self, request: Request) -> None:
        """ValueError naming what is wrong with ``request`` (nothing is queued); its LoRA
        adapter read and checked against the model (``LoRAAdapterError``)."""
        self.scheduler.check_request(request)
        if request.lora_request is not None and self.adapters is not None:
            self.adapters.check(request.lora_request)

    def add(self, requests: list[Request]) -> None:
        self.scheduler.add_requests(requests)

    def abort(self, req_ids: list[str]) -> list[Request]:
        """Drop unfinished requests now: their blocks are free before this returns."""
        return self.scheduler.abort_requests(req_ids)

    def abort_all(self) -> list[str]:
        """Drop every unfinished request; their ids."""
        return [r.req_id for r in self.scheduler.abort_requests(list(self.scheduler.requests))]

    def stop(self, stops: dict[str, str]) -> list[Request]:
        """End requests whose text reached a stop string (``req_id -> the string``): finished
        as "stop", their blocks free before this returns."""
        stopped = self.scheduler.finish_requests(list(stops), RequestStatus.FINISHED_STOPPED)
        for req in stopped:
            req.stop_reason = stops[req.req_id]
        return stopped

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    @property
    def schedulers(self) -> list[Scheduler]:
        """Its one scheduler (a data-parallel core has one per engine)."""
        return [self.scheduler]

    @property
    def num_blocks_in_use(self) -> int:
        pool = self.scheduler.block_pool
        return pool.num_usable - pool.num_free

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache since start-up, and found there."""
        return self.scheduler.prefix_cache_stats

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.spec_decode_stats

    def step(self, scheduled: SchedulerOutput | None = None) -> StepOutput:
        """One scheduler step through the model (``scheduled``: this step's plan, when the
        caller scheduled it already: data-parallel lockstep). A failing step aborts the
        requests it ran and raises ``StepFailedError``; ``ExecutorError`` (the workers are
        gone) and interrupts pass through (an interrupt after aborting the step's requests)."""
        start = time.perf_counter()
        so = scheduled
        try:
            if so is None and self.pipeline_depth > 1:
                so = self._fill_pipeline()
                if so is None:  # nothing to run
                    return StepOutput(seconds=time.perf_counter() - start)
            else:
                so = self.scheduler.schedule() if so is None else so
                self.executor.execute_model(so)
            out = self.executor.sample_tokens()
            finished = self.scheduler.update_from_output(so, out)
        except BaseException as e:
            queued, self.in_flight = list(self.in_flight), deque()  # never to be read
            if isinstance(e, ExecutorError):
                raise
            failed = list(so.num_scheduled_tokens) if so is not None else []
            for step in queued:
                failed += step.num_scheduled_tokens
                self.scheduler.abort_requests([], step)
            self.scheduler.abort_requests(failed, so)
            if not isinstance(e, Exception):  # the caller interrupted: theirs to handle
                raise
            raise StepFailedError(
                f"step failed on request(s) {', '.join(failed) or '(none: scheduling)'}: "
                f"{type(e).__name__}: {e}",
                failed,
                e,
            ) from e
        return self._step_output(so, out, finished, start)

    def _fill_pipeline(self) -> SchedulerOutput | None:
        """Schedule and send steps until ``pipeline_depth`` are out or no request is left to
        schedule; the oldest (None when none is out)."""
        scheduler = self.scheduler
        while len(self.in_flight) < self.pipeline_depth and scheduler.has_schedulable():
            share = -(-len(scheduler.requests) // self.pipeline_depth)
            so = scheduler.schedule(max_requests=share)
            self.in_flight.append(so)  # before sending: a failed send aborts its requests too
            self.executor.execute_model(so)
            if not so.num_scheduled_tokens:  # out of blocks, adapter slots or grammars
                break
        return self.in_flight.popleft() if self.in_flight else None

    def _step_output(
        self, so: SchedulerOutput, out: ModelRunnerOutput, finished: list[Request], start: float
    ) -> StepOutput:
        counts, drafts = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens
        tokens = []
        for req_id, ids, lps in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
            for i, token in enumerate(ids):
                tokens.append((req_id, token, lps[i] if lps is not None else None))
        decode_only = bool(counts)  # every request computes 1 token + its drafts
        for r, n in counts.items():  # a loop: a generator's frames cost a decode step calls
            if n != 1 + len(drafts.get(r, ())):
                decode_only = False
                break
        return StepOutput(
            tokens=tokens,
            finished=finished,
            decode_only=decode_only,
            num_scheduled_tokens=sum(counts.values()),
            seconds=time.perf_counter() - start,
            runtime_mode=out.runtime_mode,
            unreplayed_reason=out.unreplayed_reason,
            prompt_logprobs=out.prompt_logprobs,
        )
