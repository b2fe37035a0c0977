"""What a request must satisfy before the scheduler queues it, so no step fails on it.

Prompt ids and logit bias ids inside the vocabulary, prompt + max_tokens within
max_model_len and within the whole KV cache, and with chunked prefill off within
one step's budget (after a preemption, prompt + outputs are prefilled in one step).
Each error names the request and the fix. The scheduler checks every request of a
call before it queues any (all or nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from compile_runtime.core.request import Request


@dataclass(frozen=True)
class AdmissionLimits:
    block_size: int
    num_blocks: int  # the pool's blocks, the null block included
    num_usable_blocks: int  # those a request can hold
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int | None = None  # None: unchecked
    vocab_size: int | None = None  # None: unchecked

    def check(self, request: Request) -> None:
        """Raise ValueError, naming the request and the fix, for what a step could not run."""
        rid = request.req_id
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
