"""What ``LLM.generate`` and ``LLM.chat`` return, shaped as vLLM's outputs, and the call's stats.

``RequestOutput.outputs[i]`` is one ``CompletionOutput`` per sample (``n``), as in vLLM.
A logprobs entry is ``(chosen token's logprob, [(token id, logprob), ...top k])``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compile_runtime.core.stats import PrefixCacheStats, SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str | None  # None with detokenize=False (or a model without a tokenizer)
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs, when asked for
    logprobs: list | None
    finish_reason: str | None  # "stop", "length" or "abort"
    # What stopped it: the stop string or stop token id; None for EOS, length or abort.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # Per prompt token: None for the first, then (logprob, top-k) given the tokens before it.
    prompt_logprobs: list | None = None
    first_token_seconds: float | None = None  # from generate() start to the first token


@dataclass
class GenerateStats:
    steps: int = 0
    output_tokens: int = 0
    # Tokens run through the model: prompt tokens not found in the prefix cache (again after a
    # preemption), plus one per decode.
    scheduled_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: list[float] = field(default_factory=list)
    # Wall time of each step in which every scheduled request decoded (one token + drafts).
    decode_step_seconds: list[float] = field(default_factory=list)
    # Prompt tokens of this call looked up in the prefix cache, and found there.
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Draft tokens of this call proposed and accepted (speculative decoding).
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0
