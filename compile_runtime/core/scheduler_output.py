"""What the scheduler tells the runner each step, and what the runner answers.

Only differences travel: new requests in full, running ones by how many
tokens to compute and which blocks were added, finished ones by id. The
scheduler checks each answer against its step (``check_runner_output``) before
it changes any state.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from compile_runtime.core.request import Request, RequestStatus
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.lora.request import LoRARequest


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    # Every token known so far: the prompt, plus tokens generated before a
    # preemption (those are recomputed as if they were prompt).
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    # Tokens generated before a preemption: penalties and min_tokens count them.
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    lora_request: LoRARequest | None = None

    @classmethod
    def of(cls, req: Request) -> NewRequestData:
        """What the runner needs of a request joining the batch (again, after preemption)."""
        return cls(
            req_id=req.req_id,
            prompt_token_ids=req.all_token_ids,
            sampling_params=req.sampling_params,
            block_ids=list(req.block_ids),
            num_computed_tokens=req.num_computed_tokens,
            output_token_ids=list(req.output_token_ids),
            eos_token_ids=req.eos_token_ids,
            lora_request=req.lora_request,
        )


@dataclass
class CachedRequestData:
    """Running requests the runner already holds, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipelined engines: each request's tokens sampled since the ranks last saw it (the
    # ranks that did not sample them append them).
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # req_id -> tokens to compute this step (prefill chunk, or 1 + drafts for a decode).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> tokens it had computed before this step. The scheduler keeps the only count
    # (rejected drafts and preemptions included); the runner keeps none.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> draft tokens to verify after its last token (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that ended or were preempted since the last step: drop their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> [1 + drafts, vocab / 32] int32 token bitmask of each logits row of a
    # constrained request that samples this step (structured outputs).
    grammar_bitmask: dict[str, np.ndarray] = field(default_factory=dict)
    # Data-parallel engines in lockstep (engine/data_parallel.py): what every engine agreed
    # for this step, so their graphs line up: the token count each pads to, whether the
    # step is a uniform decode on every engine, whether every engine splits it into
    # micro-batches. None: this engine decides alone.
    dp_num_tokens: int | None = None
    dp_uniform_decode: bool | None = None
    dp_microbatch: bool | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class ModelRunnerOutput:
    """Per request scheduled this step, in ``req_ids`` order."""

    req_ids: list[str] = field(default_factory=list)
    # The tokens a request got this step: one after its prompt or a decode, up to 1 + its
    # drafts with speculative decoding (accepted drafts, then one sampled token); empty
    # while a prompt is still being prefilled in chunks (nothing to sample yet).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per token: (chosen token logprob, [(token, logprob), ...] top-k), when asked for.
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] = field(default_factory=list)
    runtime_mode: str | None = None  # the CUDA graph mode the step ran in (for metrics)
    # Why a step ran without a graph when graphs are on (above the largest size, ...).
    unreplayed_reason: str | None = None
    # req_id -> draft tokens proposed for its next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> (first prompt position, logprobs of the prompt tokens from there) for the
    # prompt positions this step computed, when the request asked for prompt logprobs.
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)


def check_runner_output(
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    requests: Mapping[str, Request],
    ended: Collection[str] = (),
) -> None:
    """Raise ValueError unless the runner's answer fits the step: every scheduled request is
    running, one whose prompt the step completes got tokens (at most 1 + its drafts), one
    still mid-prefill got none. ``requests``: the scheduler's, as before the step;
    ``ended``: requests that ended while the step ran (pipelined), not checked."""
    sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
    spec = scheduler_output.scheduled_spec_decode_tokens
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        if req_id in ended:
            continue
        req = requests.get(req_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {req_id!r} in the scheduler output is not running")
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        completes_prompt = req.num_computed_tokens + n >= num_tokens
        tokens = sampled.get(req_id) or []
        if completes_prompt and not tokens:
            raise ValueError(
                f"request {req_id!r} finished its prefill this step but the runner "
                "returned no sampled token for it"
            )
        if not completes_prompt and tokens:
            raise ValueError(
                f"request {req_id!r} is mid-prefill ({req.num_computed_tokens + n} of "
                f"{num_tokens} tokens) but the runner sampled tokens {tokens} for it"
            )
        if len(tokens) > 1 + len(spec.get(req_id, ())):
            raise ValueError(
                f"request {req_id!r} got {len(tokens)} tokens from a step that verified "
                f"{len(spec.get(req_id, ()))} drafts (at most drafts + 1)"
            )
