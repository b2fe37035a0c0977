"""What an OpenAI request asks of the engine: its prompts as token ids and one
``SamplingParams`` per choice, every field checked here so a bad one is a 400."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from compile_runtime.engine.chat import ChatTemplateError, chat_prompt_ids
from compile_runtime.runner.sampling_params import SamplingParams
from compile_runtime.server.errors import APIError
from compile_runtime.server.protocol import ChatMessage, SamplingFields

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(
    body: SamplingFields,
    model_name: str,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """One per choice (``n``); a seed goes up by one from each choice to the next."""
    if body.model != model_name:
        raise APIError(400, f"model {body.model!r} is not served here; use {model_name!r}", "model")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
    try:
        return [
            SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_tokens=max_tokens,
                seed=None if body.seed is None else body.seed + i,
                frequency_penalty=body.frequency_penalty,
                presence_penalty=body.presence_penalty,
                repetition_penalty=body.repetition_penalty,
                min_tokens=body.min_tokens,
                logit_bias=bias,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                ignore_eos=body.ignore_eos,
            )
            for i in range(body.n)
        ]
    except ValidationError as e:
        raise APIError(400, str(e).splitlines()[-1].strip()) from None


def prompt_token_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """A completion's prompt (text, ids, or a list of either) as a list of id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
            out.append(tokenizer(p)["input_ids"])
        else:
            out.append(list(p))
    return out


def chat_token_ids(messages: list[ChatMessage], tokenizer: Any) -> list[int]:
    """The messages through the model's chat template, ready for the assistant's answer."""
    plain = [m.model_dump(exclude_none=True) for m in messages]
    try:
        return chat_prompt_ids(plain, tokenizer)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages") from None
