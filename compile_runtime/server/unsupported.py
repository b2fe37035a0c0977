"""The fields of a request that ``protocol.py`` does not model, judged: one the engine cannot
honour (beam search, best_of, suffix, the legacy functions API...) is a 400 naming it,
never dropped in silence; one that changes nothing here (``user``, ``store``...) is taken; any other is
taken with one warning naming them all, as vLLM's server does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from compile_runtime.server.api_error import APIError
from compile_runtime.server.protocol import OpenAIModel, SamplingFields

logger = logging.getLogger(__name__)

# Metadata for the caller's own bookkeeping, or settings this server already meets.
HARMLESS = frozenset(
    {
        "user",
        "store",
        "metadata",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "request_id",
        "return_token_ids",  # token_ids are always in the choices
        "stream_interval",
        "guided_decoding_backend",  # xgrammar enforces every constraint
    }
)


def _set(value: Any, body: SamplingFields) -> bool:
    return bool(value)


def _not(*neutral: Any) -> Callable[[Any, SamplingFields], bool]:
    return lambda value, body: value is not None and value not in neutral


LEGACY_TOOLS = "the legacy functions API is not supported; send tools and tool_choice"
BEAM = "beam search is not supported"
NOT_TEXT = "only text is supported"

# field -> (does this value ask for something the engine cannot do?, why)
UNSUPPORTED: dict[str, tuple[Callable[[Any, SamplingFields], bool], str]] = {
    "functions": (_set, LEGACY_TOOLS),
    "function_call": (_not("none"), LEGACY_TOOLS),
    "guided_whitespace_pattern": (_set, "a whitespace pattern for JSON is not supported"),
    "use_beam_search": (_set, BEAM),
    "length_penalty": (_not(1, 1.0), BEAM),
    "suffix": (_set, "suffix (insertion) is not supported"),
    "echo": (_set, "echo is not supported on chat completions"),
    "allowed_token_ids": (_set, "allowed_token_ids is not supported"),
    "bad_words": (_set, "bad_words is not supported"),
    "logprob_token_ids": (_set, "logprobs of chosen token ids are not supported"),
    "truncate_prompt_tokens": (_set, "prompt truncation is not supported"),
    "spaces_between_special_tokens": (_not(True), "only true is supported"),
    "return_tokens_as_token_ids": (_set, "only token text is supported"),
    "prompt_embeds": (_set, "prompt embeddings are not supported"),
    "chat_template": (_set, "a per-request chat template is not taken; the model's own is used"),
    "documents": (_set, "documents for the chat template are not supported"),
    "priority": (_not(0), "priority scheduling is not supported"),
    "cache_salt": (_set, "prefix cache isolation is not supported"),
    "audio": (_set, NOT_TEXT),
    "modalities": (_not(["text"]), NOT_TEXT),
    "prediction": (_set, "predicted outputs are not supported"),
    "reasoning_effort": (_set, "reasoning controls are not supported"),
    "web_search_options": (_set, "web search is not supported"),
}


def check_fields(body: SamplingFields) -> None:
    """A 400 for the first field the engine cannot honour, else warn of unknown ones."""
    if body.prompt_logprobs and body.stream:  # vLLM's rule and words (0 is taken)
        message = "`prompt_logprobs` are not available when `stream=True`."
        raise APIError(400, message, "prompt_logprobs")
    if body.best_of is not None and body.best_of > body.num_choices:
        message = "best_of > n (returning the best of more samples) is not supported; set it to n"
        raise APIError(400, f"best_of: {message}", "best_of")
    extra = body.model_extra or {}
    for name, value in extra.items():
        rule = UNSUPPORTED.get(name)
        if rule is not None and rule[0](value, body):
            raise APIError(400, f"{name}: {rule[1]}", name)
    ignored = [n for n in extra if n not in HARMLESS and n not in UNSUPPORTED]
    for name, value in body:
        if isinstance(value, OpenAIModel) and value.model_extra:
            ignored += [f"{name}.{n}" for n in value.model_extra]
    if ignored:
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(ignored)
        )
