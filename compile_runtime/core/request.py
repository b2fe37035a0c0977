"""One generation request as the scheduler tracks it: what it must satisfy to be queued, and
when it stops.

Admission (``AdmissionLimits``): prompt ids and logit bias ids inside the vocabulary, prompt +
max_tokens within max_model_len and within the whole KV cache, and with chunked prefill off
within one step's budget (after a preemption, prompt + outputs are prefilled in one step).
Each error names the request and the fix. The scheduler checks every request of a call
before it queues any (all or nothing), so no step fails on one.

Stopping: once a request has ``min_tokens`` outputs, an EOS id (unless ``ignore_eos``) or a
stop token id stops it; ``max_tokens`` outputs end it. A step that verified drafts can give a
request several tokens: the ones after a token that stops it are dropped. Drafts never reach
past ``max_tokens``: the step verifying them emits at least one token more.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.lora.request import LoRARequest


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
    # Prefix caching: content hashes of its full blocks so far (core/kv_blocks.py), and
    # how many of its leading blocks are in the cache (found there or put there by it).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Speculative decoding: draft tokens to verify in its next step (proposed by the runner).
    spec_token_ids: list[int] = field(default_factory=list)
    # What stopped it, as vLLM reports it: a stop token id or a stop string; None for EOS,
    # max_tokens or an abort.
    stop_reason: int | str | None = None
    # The LoRA adapter it runs under (None: the base model).
    lora_request: LoRARequest | None = None
    # Pipeline parallelism: in a step whose tokens have not come back yet, and how many of
    # its tokens the ranks that do not sample hold (the rest travel in its next step).
    in_flight: bool = False
    num_tokens_on_workers: int = 0

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


def append_until_stop(
    req: Request, tokens: list[int], logprobs: list | None
) -> RequestStatus | None:
    """Append ``tokens`` to ``req``'s outputs up to the first that stops it; the ones after it
    are deleted from ``tokens`` and ``logprobs`` too (the caller's lists, in place)."""
    params, outputs = req.sampling_params, req.output_token_ids
    for kept, token in enumerate(tokens, 1):
        outputs.append(token)
        # How the token ends the request (None: it goes on); inline, as every step asks.
        status = None
        num_out = len(outputs)
        if num_out >= params.min_tokens:
            if token in req.eos_token_ids and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                req.stop_reason = token
                status = RequestStatus.FINISHED_STOPPED
        if status is None and num_out >= params.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            del tokens[kept:]
            if logprobs is not None:
                del logprobs[kept:]
            return status
    return None


def ended_by_stop_token(req: Request) -> bool:
    """Whether ``req`` ended at a stop token (an EOS id or one of ``stop_token_ids``): its
    last output. Its text is left out of the output text (kept with
    ``include_stop_str_in_output``), as vLLM does; the id stays in the token ids."""
    if req.status is not RequestStatus.FINISHED_STOPPED or not req.output_token_ids:
        return False
    last, params = req.output_token_ids[-1], req.sampling_params
    return last in params.stop_token_ids or (last in req.eos_token_ids and not params.ignore_eos)


def capped_drafts(req: Request, proposed: list[int]) -> list[int]:
    """The drafts ``req`` may verify next step: never past max_tokens."""
    room = req.sampling_params.max_tokens - len(req.output_token_ids) - 1
    return proposed[: max(room, 0)]


def check_scheduler_sizes(
    sizes: dict[str, int | None],
    long_prefill_token_threshold: int | None,
    enable_chunked_prefill: bool,
) -> None:
    """ValueError for a scheduler size below 1 (None: unchecked) or a chunk threshold
    without chunked prefill."""
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if long_prefill_token_threshold is not None:
        if long_prefill_token_threshold < 1:
            raise ValueError(
                f"long_prefill_token_threshold must be at least 1 or None, "
                f"got {long_prefill_token_threshold}"
            )
        if not enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold cuts prompts into chunks; it needs "
                "enable_chunked_prefill=True"
            )


@dataclass(frozen=True)
class AdmissionLimits:
    block_size: int
    num_blocks: int  # the pool's blocks, the null block included
    num_usable_blocks: int  # those a request can hold
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int | None = None  # None: unchecked
    vocab_size: int | None = None  # None: unchecked
    has_grammars: bool = False  # structured outputs can be served
    serves_lora: bool = False  # LoRA adapters can be served

    def check(self, request: Request) -> None:
        """Raise ValueError, naming the request and the fix, for what a step could not run."""
        rid = request.req_id
        if request.sampling_params.structured_outputs is not None and not self.has_grammars:
            raise ValueError(
                "structured_outputs needs the model's tokenizer, and this engine has none"
            )
        if request.lora_request is not None and not self.serves_lora:
            raise ValueError(
                f"request {rid!r} names LoRA adapter {request.lora_request.lora_name!r}, but "
                "this engine serves none; start it with enable_lora=True (--enable-lora)"
            )
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {rid!r} has an empty prompt; give it at least one token")
        if self.vocab_size is not None:
            self._check_token_ids(request)
        max_tokens = request.sampling_params.max_tokens
        total = len(prompt) + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} "
                f"exceeds max_model_len={self.max_model_len}; shorten the prompt, lower "
                "max_tokens or start the engine with a larger max_model_len"
            )
        blocks_needed = -(-total // self.block_size)
        if blocks_needed > self.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} can never fit in the KV cache: prompt "
                f"{len(prompt)} + max_tokens {max_tokens} = {total} tokens "
                f"need {blocks_needed} blocks of {self.block_size} tokens, but the cache has "
                f"{self.num_usable_blocks} usable blocks (num_blocks="
                f"{self.num_blocks}, block 0 reserved); lower max_tokens, shorten "
                f"the prompt or give the cache more blocks"
            )
        if not self.enable_chunked_prefill and total > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: prompt {len(prompt)} + "
                f"max_tokens {max_tokens} = {total} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} with chunked prefill disabled; enable "
                f"chunked prefill or raise max_num_batched_tokens"
            )

    def _check_token_ids(self, request: Request) -> None:
        rid, prompt, vocab = request.req_id, request.prompt_token_ids, self.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {rid!r}: prompt token id {bad} (position {prompt.index(bad)}) is "
                f"outside the vocabulary [0, {vocab}); pass ids the model's tokenizer produces"
            )
        bad = next((t for t in request.sampling_params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {rid!r}: logit_bias token id {bad} is outside the vocabulary "
                f"[0, {vocab}); remove it from SamplingParams.logit_bias"
            )
