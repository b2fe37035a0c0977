"""What an OpenAI request asks of the engine: its prompts as token ids and one
``SamplingParams`` per choice, every field checked here so a bad one is a 400 that names
the field as the user sent it (``max_completion_tokens``, not the engine's ``max_tokens``)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from compile_runtime.core.sampling_params import SamplingParams, StructuredOutputsParams
from compile_runtime.engine.chat import ChatTemplateError, chat_prompt_ids
from compile_runtime.server.api_error import APIError
from compile_runtime.server.chat_template import template_arguments
from compile_runtime.server.protocol import ChatCompletionRequest, SamplingFields, TokenizeRequest
from compile_runtime.server.structured import GUIDED, ConstraintError, constraint_of

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions

# Request fields that are SamplingParams' own when set (None: the engine's default).
OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "stop_token_ids")  # fmt: skip
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED)


def sampling_params(
    body: SamplingFields,
    max_tokens: int,
    max_field: str,
    logprobs: int | None,
    logprobs_field: str,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> list[SamplingParams]:
    """One per choice (``n``); a seed goes up by one from each choice to the next."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(
                400, f"logit_bias: key {key!r} is not a token id", "logit_bias"
            ) from None
    fields = {name: getattr(body, name) for name in OPTIONAL if getattr(body, name) is not None}
    try:
        return [
            SamplingParams(
                **fields,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                seed=None if body.seed is None else body.seed + i,
                stop=body.stop_strings(),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                ignore_eos=body.ignore_eos,
                logit_bias=bias,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs,
            )
            for i in range(body.num_choices)
        ]
    except ValidationError as e:
        renamed = {"max_tokens": max_field, "logprobs": logprobs_field}
        raise _as_api_error(e, renamed, body) from None


def _as_api_error(e: ValidationError, renamed: dict[str, str], body: SamplingFields) -> APIError:
    """SamplingParams' complaint, in the request's field names."""
    first = e.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    if first["loc"]:
        param = renamed.get(str(first["loc"][0]), str(first["loc"][0]))
        return APIError(400, f"{param}: {message} (got {first['input']!r})", param)
    # A rule across fields (min_tokens > max_tokens): the first field its message names.
    named = [
        (m.start(), f) for f in type(body).model_fields if (m := re.search(rf"\b{f}\b", message))
    ]
    param = renamed.get(min(named)[1], min(named)[1]) if named else None
    return APIError(400, message, param)


def check_length(
    prompt_len: int, max_tokens: int, max_model_len: int, prompt_field: str, max_field: str
) -> None:
    """A prompt, or prompt plus output, past ``max_model_len``: a 400 naming the field."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{prompt_field}: the prompt is {prompt_len} tokens, and this model's maximum "
            f"context length (max_model_len) is {max_model_len} tokens for prompt and output "
            "together; "
            "shorten the prompt",
            prompt_field,
        )
    if prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"{max_field}: {max_tokens} output tokens after a prompt of {prompt_len} make "
            f"{prompt_len + max_tokens}, past this model's maximum context length "
            f"(max_model_len) of {max_model_len} tokens; lower {max_field} to "
            f"{max_model_len - prompt_len} or less, or shorten the prompt",
            max_field,
        )


_LONGEST: dict[int, int] = {}


def text_bound(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a text of at most ``max_model_len`` tokens can have (each token
    is at most the vocabulary's longest): longer text is refused before it is tokenized."""
    key = id(tokenizer)
    if key not in _LONGEST:
        _LONGEST[key] = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return max_model_len * _LONGEST[key]


def check_text_length(chars: int, bound: int | None, field: str) -> None:
    if bound is not None and chars > bound:
        raise APIError(
            400,
            f"{field}: the text is {chars} characters, more than this model's maximum context "
            "length (max_model_len) can hold whatever its tokens; shorten the prompt",
            field,
        )


def prompt_token_ids(
    prompt: Any, tokenizer: Any, add_special_tokens: bool = True, max_model_len: int | None = None
) -> list[list[int]]:
    """A completion's prompt (text, ids, or a list of either) as a list of id lists; text
    longer than ``max_model_len`` tokens can hold is refused before it is tokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer: send token ids", "prompt")
            if max_model_len is not None:
                check_text_length(len(p), text_bound(tokenizer, max_model_len), "prompt")
            out.append(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"])
        else:
            out.append(list(p))
    return out


def chat_token_ids(
    body: ChatCompletionRequest | TokenizeRequest,
    tokenizer: Any,
    tools: list[dict[str, Any]] | None = None,
    max_model_len: int | None = None,
    trust_template: bool = False,
) -> list[int]:
    """The messages through the model's chat template (text parts only), ``tools`` too;
    ``trust_template``: the request may bring its own template."""
    chars = 0
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            chars += len(m.content)
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                where = f"messages.{i}.content.{j}"
                message = f"{where}: a {part.type!r} part; only text is supported"
                raise APIError(400, message, where)
            chars += len(part.text or "")
    if max_model_len is not None and tokenizer is not None:
        check_text_length(chars, text_bound(tokenizer, max_model_len), "messages")
    kwargs, overrides = template_arguments(
        body.chat_template_kwargs, body.chat_template, tokenizer, trust_template
    )
    add_generation_prompt = overrides.get("add_generation_prompt", body.add_generation_prompt)
    continue_final = overrides.get("continue_final_message", body.continue_final_message)
    if continue_final and add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message: it continues the last message, so it needs "
            "add_generation_prompt=false",
            "continue_final_message",
        )
    if body.add_special_tokens:
        raise APIError(
            400,
            "add_special_tokens: true is not supported with messages; the chat template adds "
            "the special tokens",
            "add_special_tokens",
        )
    if continue_final:
        kwargs["continue_final_message"] = True
    plain = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        return chat_prompt_ids(
            plain,
            tokenizer,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=kwargs,
            tools=tools,
        )
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", "messages") from None


def constraint_field(body: SamplingFields) -> str | None:
    """The field the request's output constraint came from."""
    return next((f for f in STRUCTURED_FIELDS if getattr(body, f, None) is not None), None)


def output_constraint(body: SamplingFields) -> StructuredOutputsParams | None:
    """What the output must match, from whichever spelling the request used (structured.py)."""
    try:
        return constraint_of(body.model_dump(include=set(STRUCTURED_FIELDS), exclude_none=True))
    except ConstraintError as e:
        raise APIError(400, str(e), e.param) from None
