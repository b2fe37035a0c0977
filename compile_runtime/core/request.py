"""One generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from compile_runtime.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet, or preempted and queued again
    RUNNING = "running"
    FINISHED_LENGTH = "finished_length"  # reached max_tokens
    FINISHED_STOPPED = "finished_stopped"  # sampled EOS or a stop token
    FINISHED_ABORTED = "finished_aborted"  # its step failed; see Scheduler.abort_requests

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Set by the scheduler on add_request; lower = older = higher priority.
    arrival_index: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Reset to 0 on preemption.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Prefix caching: content hashes of its full blocks so far (core/prefix_cache.py), and
    # how many of its leading blocks are in the cache (found there or put there by it).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Speculative decoding: draft tokens to verify in its next step (proposed by the runner).
    spec_token_ids: list[int] = field(default_factory=list)
    # What stopped it, as vLLM reports it: a stop token id or a stop string; None for EOS,
    # max_tokens or an abort.
    stop_reason: int | str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """'length' (max_tokens reached), 'stop' (EOS or stop token), 'abort', or None."""
        return {
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self.status)
