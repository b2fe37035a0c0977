"""The OpenAI response bodies: the envelope (one id per call), each endpoint's choice and
stream-chunk shapes (with vLLM's ``stop_reason`` and ``token_ids``) and usage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from compile_runtime.server import logprobs
from compile_runtime.server.choice import Choice

Envelope = Callable[..., dict]


def envelope(prefix: str, model_name: str) -> Envelope:
    """``make(object, choices, usage=None)``: a response body with this call's id."""
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def make(obj: str, choices_json: list[dict], usage: dict | None = None, **extra) -> dict:
        out = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": choices_json,
            **extra,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    return make


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def prompt_text(prompt: Any, prompts: list[list[int]], index: int, tokenizer: Any) -> str:
    """Prompt ``index`` as the client sent it (text), or its ids decoded (``echo``)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[index], str):
        return prompt[index]
    ids = prompts[index]
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def completion_choice(choice: Choice, text: str, lps: dict | None, **extra) -> dict:
    return {
        "index": choice.index,
        "text": text,
        "logprobs": lps,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids,
        **extra,
    }


def completion_chunk_choice(
    choice: Choice, piece: str, finish: str | None, tokenizer: Any, k: int | None
) -> dict:
    """A text piece and the tokens since the last chunk (with their logprobs when asked)."""
    ids, entries = choice.new_tokens()
    lps = None
    if k is not None:
        lps, choice.text_offset = logprobs.completion_logprobs(
            ids, entries, tokenizer, k, choice.text_offset
        )
    return {"index": choice.index, "text": piece, "logprobs": lps, "finish_reason": finish,
            "stop_reason": choice.stop_reason if finish else None, "token_ids": ids}  # fmt: skip


def chat_choice(
    choice: Choice, tokenizer: Any, k: int | None, message: dict, finish: str | None
) -> dict:
    lps = None
    if k is not None:
        lps = logprobs.chat_logprobs(choice.token_ids, choice.logprobs, tokenizer, k)
    return {
        "index": choice.index,
        "message": message,
        "logprobs": lps,
        "finish_reason": finish,
        "stop_reason": choice.stop_reason,
        "token_ids": choice.token_ids,
    }


def chat_chunk_choice(
    choice: Choice, piece: str, finish: str | None, first: bool, tokenizer: Any, k: int | None
) -> dict:
    """A chat delta and its tokens' logprobs; a choice's first one names the role."""
    ids, entries = choice.new_tokens()
    delta: dict[str, Any] = {"content": piece}
    if first:
        delta["role"] = "assistant"
    lps = None if k is None else logprobs.chat_logprobs(ids, entries, tokenizer, k)
    return {"index": choice.index, "delta": delta, "logprobs": lps, "finish_reason": finish,
            "stop_reason": choice.stop_reason if finish else None, "token_ids": ids}  # fmt: skip
