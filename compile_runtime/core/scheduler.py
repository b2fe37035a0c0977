"""Continuous batching over a paged KV cache.

Each step has a token budget (max_num_batched_tokens). Running requests are
served first, oldest first: a decode costs one token (plus its draft tokens
under speculative decoding: the runner proposes them, the scheduler caps them
at max_tokens and the budget, and counts only the accepted ones as computed),
a prompt still being prefilled takes what is left of it (up to the budget). Then waiting requests
join in FIFO order while there is budget and room for another sequence; a
long prompt is cut to the remaining budget and finished over later steps
(chunked prefill).

When the cache runs out of blocks for a running request, the most recently
arrived running request is preempted: its blocks go back to the pool, its
progress is forgotten, and it waits at the front of the queue. When it runs
again its prompt and the tokens it had generated are recomputed as one
prompt. Older requests therefore always make progress, and a request that
fits in the cache on its own always finishes.

With prefix caching (on by default), a joining request first takes the longest run of
its full blocks already in the cache (kv_blocks.py) and is scheduled for the rest, at
least its last token. Full blocks enter the cache once computed and stay, evictable,
after their request ends. Every layer keeps every block (sliding-window layers too).

Admission is all or nothing: ``add_requests`` checks every request (``AdmissionLimits``
and the stop rules are request.py's) before it queues any. A failed step's requests are
aborted: their blocks freed, and the runner told to drop them at the next step.

Protocol per step: ``out = schedule()``, the runner executes ``out``, then
``update_from_output(out, runner_output)``. The scheduler keeps the only count of each
request's computed tokens and sends it with every scheduled request. The runner drops
``out.finished_req_ids`` before adding ``out.scheduled_new_reqs`` (a request preempted in
this schedule() may come back as new later). Pipelined (``pipelined=True``), several
steps are out at once: a request in one is not scheduled again until its tokens are back.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

from compile_runtime.core.kv_blocks import BlockPool, cache_computed_blocks, find_cached_prefix
from compile_runtime.core.request import (
    AdmissionLimits,
    Request,
    RequestStatus,
    append_until_stop,
    capped_drafts,
    check_scheduler_sizes,
)
from compile_runtime.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    check_runner_output,
)
from compile_runtime.core.stats import PrefixCacheStats, SpecDecodeStats
from compile_runtime.core.structured_output import StructuredOutputManager, check_constraint

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        enable_prefix_caching: bool = True,
        structured_outputs: StructuredOutputManager | None = None,
        max_loras: int | None = None,
        pipelined: bool = False,
    ) -> None:
        """``pipelined``: steps overlap, and the ranks that do not sample get each request's new
        tokens in its next step. ``max_model_len`` and ``vocab_size`` (None: unchecked) bound
        what add_request admits; ``structured_outputs`` holds constrained requests' grammars
        (None: none admitted); ``max_loras``: distinct LoRA adapters the running requests may use at once (None:
        requests with an adapter are refused)."""
        check_scheduler_sizes(
            dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                 max_num_batched_tokens=max_num_batched_tokens, vocab_size=vocab_size),
            long_prefill_token_threshold,
            enable_chunked_prefill,
        )  # fmt: skip
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.admission = AdmissionLimits(
            block_size=block_size,
            num_blocks=self.block_pool.num_blocks,
            num_usable_blocks=self.block_pool.num_usable,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            has_grammars=structured_outputs is not None,
            serves_lora=max_loras is not None,
        )
        self.enable_prefix_caching = enable_prefix_caching
        self.structured_outputs = structured_outputs
        self.max_loras = max_loras
        self.pipelined = pipelined
        self.prefix_cache_stats = PrefixCacheStats()
        self.spec_decode_stats = SpecDecodeStats()

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Kept sorted by arrival_index, so the tail is always the preemption victim.
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self._next_arrival = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """Queue ``requests`` in order, or none of them: every one is checked first."""
        ids = [r.req_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} repeat; give every request its own id")
        for request in requests:
            self.check_request(request)
        for request in requests:
            request.arrival_index = self._next_arrival
            self._next_arrival += 1
            request.status = RequestStatus.WAITING
            self.requests[request.req_id] = request
            self.waiting.append(request)
            if request.sampling_params.structured_outputs is not None:
                self.structured_outputs.start(request)  # check_request: a manager exists

    def check_request(self, request: Request) -> None:
        """Raise ValueError, naming the request and the fix, for what a step could not run."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in the scheduler")
        self.admission.check(request)
        if request.sampling_params.structured_outputs is not None:
            check_constraint(request.sampling_params.structured_outputs)

    def abort_requests(
        self, req_ids: list[str], failed_step: SchedulerOutput | None = None
    ) -> list[Request]:
        """Drop unfinished requests (their step failed): free their blocks, forget them.

        The next step's ``finished_req_ids`` tell the runner to drop them, whatever
        state the failure left them in, and repeat what ``failed_step`` told it to
        drop (the runner may never have received it). Unknown ids are ignored.
        """
        if failed_step is not None:
            self._finished_req_ids |= failed_step.finished_req_ids
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """End unfinished requests now with ``status`` (an abort, or a stop string the text
        reached): free their blocks, forget them; the runner drops them at the next step."""
        finished = []
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free_blocks(req)
            if self.structured_outputs is not None and req_id in self.structured_outputs.requests:
                self.structured_outputs.free(req_id)
            req.status = status
            self._finished_req_ids.add(req_id)
            finished.append(req)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Whether a request runs outside every step still out (pipelined), or waits with room."""
        room = self.waiting and len(self.running) < self.max_num_seqs
        return bool(room) or any(not r.in_flight for r in self.running)

    # ---------------------------------------------------------------- schedule

    def schedule(self, max_requests: int | None = None) -> SchedulerOutput:
        """The next step; ``max_requests`` caps its requests (a share of a pipeline's)."""
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        room = max_requests if max_requests is not None else self.max_num_seqs

        i = 0
        while i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < room:
            req = self.running[i]
            if req.in_flight:
                i += 1
                continue
            # _num_tokens_to_compute and _allocate_or_preempt inlined for a decode's few calls.
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            num_new = num_tokens - req.num_computed_tokens + len(req.spec_token_ids)
            if self.long_prefill_token_threshold is not None:
                num_new = min(num_new, self.long_prefill_token_threshold)
            num_new = min(num_new, budget)
            block_size = self.block_size
            if -(-(req.num_computed_tokens + num_new) // block_size) <= len(req.block_ids):
                new_blocks = []  # room in its blocks: nothing to allocate
            else:
                new_blocks = self._allocate_or_preempt(req, num_new, out)
                if new_blocks is None:  # req was the newest left and preempted itself
                    break
            out.scheduled_cached_reqs.req_ids.append(req.req_id)
            out.scheduled_cached_reqs.new_block_ids.append(new_blocks)
            out.scheduled_cached_reqs.num_computed_tokens.append(req.num_computed_tokens)
            if self.pipelined:
                new_tokens = req.all_token_ids[req.num_tokens_on_workers :]
                out.scheduled_cached_reqs.new_token_ids.append(new_tokens)
            req.num_tokens_on_workers, req.in_flight = num_tokens, self.pipelined
            out.num_scheduled_tokens[req.req_id] = num_new
            out.num_computed_tokens[req.req_id] = req.num_computed_tokens
            # Drafts that did not fit the budget wait for the next proposal.
            num_drafts = num_new - (num_tokens - req.num_computed_tokens)
            if num_drafts > 0:
                out.scheduled_spec_decode_tokens[req.req_id] = req.spec_token_ids[:num_drafts]
            req.spec_token_ids = []
            budget -= num_new
            i += 1
        preempted_any = self.num_preemptions > preemptions_before

        # Under memory pressure nobody new joins this step. A request whose grammar still
        # compiles is passed over, keeping its place (the rest go on); only with nothing else
        # to run does the last of the queue wait for its grammar.
        grammars = self.structured_outputs  # None unless a constrained request is queued or running
        if grammars is not None and not grammars.requests:
            grammars = None
        adapters = set()
        if self.waiting:
            for r in self.running:
                if r.lora_request:
                    adapters.add(r.lora_request.lora_int_id)
        w = 0  # the queue position looked at
        while (
            not preempted_any
            and w < len(self.waiting)
            and len(self.running) < self.max_num_seqs
            and budget > 0
            and len(out.num_scheduled_tokens) < room
        ):
            req = self.waiting[w]
            if grammars is not None:
                idle = not self.running and w == len(self.waiting) - 1
                if not grammars.ready(req, wait=idle):
                    w += 1
                    continue
            lora_id = req.lora_request.lora_int_id if req.lora_request else None
            if (
                lora_id is not None
                and lora_id not in adapters
                and len(adapters) >= (self.max_loras or 0)
            ):  # every slot is taken by running requests: it waits, keeping its place
                w += 1
                continue
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.block_size
            num_new = self._num_tokens_to_compute(req, num_cached)
            if not self.enable_chunked_prefill and num_new > budget:
                break  # FIFO: wait for a step with room rather than letting others pass
            num_new = min(num_new, budget)
            needed = _cdiv(num_cached + num_new, self.block_size) - len(cached)
            if needed > self.block_pool.num_free_after_touch(cached):
                break
            self.block_pool.touch(cached)
            blocks = self.block_pool.allocate(needed)
            assert blocks is not None  # checked just above
            del self.waiting[w]
            if self.enable_prefix_caching:
                self.prefix_cache_stats.queries += req.num_tokens
                self.prefix_cache_stats.hits += num_cached
            req.block_ids = cached + blocks
            req.num_cached_blocks = len(cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if lora_id is not None:
                adapters.add(lora_id)
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            out.scheduled_new_reqs.append(NewRequestData.of(req))
            req.num_tokens_on_workers, req.in_flight = req.num_tokens, self.pipelined
            out.num_scheduled_tokens[req.req_id] = num_new
            out.num_computed_tokens[req.req_id] = req.num_computed_tokens
            budget -= num_new
        if grammars is not None:
            out.grammar_bitmask = grammars.bitmasks(out, self.requests)
        return out

    def _num_tokens_to_compute(self, req: Request, num_computed: int | None = None) -> int:
        """1 (+ drafts) for a decode; the rest of the prompt (maybe capped) while prefilling."""
        if num_computed is None:
            num_computed = req.num_computed_tokens
        n = req.num_tokens - num_computed + len(req.spec_token_ids)
        if self.long_prefill_token_threshold is not None:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def _cached_prefix(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        return find_cached_prefix(self.block_pool, req, self.block_size)

    def _free_blocks(self, req: Request) -> None:
        """Give back req's blocks, last first: its tail is evicted before the shared head."""
        self.block_pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0

    def _allocate_or_preempt(
        self, req: Request, num_new: int, out: SchedulerOutput
    ) -> list[int] | None:
        """Blocks added to req for num_new more tokens, preempting newer requests
        until they fit. None when req itself had to be preempted."""
        needed = _cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)
        while True:
            blocks = self.block_pool.allocate(max(needed, 0))
            if blocks is not None:
                req.block_ids.extend(blocks)
                return blocks
            victim = next(r for r in reversed(self.running) if not r.in_flight)  # req is not
            self._preempt(victim, out)
            if victim is req:
                return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        logger.debug("preempting %s (%d tokens computed)", req.req_id, req.num_computed_tokens)
        self._free_blocks(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.finished_req_ids.add(req.req_id)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance every scheduled request; return those that finished this step.

        A request's tokens after one that stops it are dropped, and deleted from
        ``runner_output`` too, so whoever reads it next sees what the request got.
        """
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        logprobs = dict(zip(runner_output.req_ids, runner_output.logprobs, strict=False))
        spec = scheduler_output.scheduled_spec_decode_tokens
        # Pipelined: requests aborted or stopped while their step ran get nothing more.
        ended = scheduler_output.num_scheduled_tokens.keys() - self.requests.keys()
        check_runner_output(scheduler_output, runner_output, self.requests, ended)
        grammars = self.structured_outputs  # None unless a constrained request is queued or running
        if grammars is not None and not grammars.requests:
            grammars = None
        block_size = self.block_size
        finished: list[Request] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if req_id in ended:
                continue
            req = self.requests[req_id]
            req.in_flight = False
            tokens = sampled.get(req_id) or []
            drafts = spec.get(req_id, ())
            if drafts:
                self.spec_decode_stats.record(len(drafts), len(tokens) - 1)
            # Tokens after a stop are dropped, from the runner's output too.
            status = append_until_stop(req, tokens, logprobs.get(req_id))
            if grammars is not None and tokens:
                grammar = grammars.accept(req_id, tokens)  # ended, or broken
                if grammar is RequestStatus.FINISHED_ABORTED or status is None:
                    status = grammar or status
            # Rejected drafts' KV is not computed: those slots are written again later.
            num_rejected = len(drafts) + 1 - len(tokens) if tokens else 0
            req.num_computed_tokens = min(
                req.num_computed_tokens + n - num_rejected,
                len(req.prompt_token_ids) + len(req.output_token_ids),
            )
            # Only when a block filled up (cache_computed_blocks' own first check).
            if (
                self.enable_prefix_caching
                and req.num_computed_tokens // block_size > req.num_cached_blocks
            ):
                cache_computed_blocks(self.block_pool, req, block_size)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
            elif tokens:
                proposed = runner_output.draft_token_ids.get(req_id)
                req.spec_token_ids = capped_drafts(req, proposed) if proposed else []
        return finished

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if self.structured_outputs is not None and req.req_id in self.structured_outputs.requests:
            self.structured_outputs.free(req.req_id)
        req.status = status
        self.running.remove(req)
        self._free_blocks(req)
        del self.requests[req.req_id]
        self._finished_req_ids.add(req.req_id)
