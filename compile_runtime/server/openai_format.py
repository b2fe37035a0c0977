"""The OpenAI response bodies: the envelope (one id per call), each endpoint's choice and
stream-chunk shapes, usage and completion logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from compile_runtime.server.choice import Choice

Envelope = Callable[..., dict]


def envelope(prefix: str, model_name: str) -> Envelope:
    """``make(object, choices, usage=None)``: a response body with this call's id."""
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def make(obj: str, choices_json: list[dict], usage: dict | None = None) -> dict:
        out = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": choices_json,
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


def completion_logprobs(choice: Choice, tokenizer: Any, echo: bool = False) -> dict | None:
    """OpenAI's logprobs object; with ``echo`` the prompt's tokens come first (the first
    without a logprob: nothing precedes it)."""
    if not choice.logprobs:
        return None

    def text(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    token_ids, entries = list(choice.token_ids), list(choice.logprobs)
    if echo:
        token_ids = choice.stream.request.prompt_token_ids + token_ids
        entries = (choice.stream.prompt_logprobs or []) + entries
    return {
        "tokens": [text(t) for t in token_ids],
        "token_logprobs": [None if lp is None else lp[0] for lp in entries],
        "top_logprobs": [None if lp is None else {text(t): v for t, v in lp[1]} for lp in entries],
        "text_offset": [],
    }


def prompt_text(prompt: Any, prompts: list[list[int]], index: int, tokenizer: Any) -> str:
    """Prompt ``index`` as the client sent it (text), or its ids decoded (``echo``)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[index], str):
        return prompt[index]
    ids = prompts[index]
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def completion_choice(choice: Choice, text: str, logprobs: dict | None) -> dict:
    return {
        "index": choice.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
        "token_ids": choice.token_ids,
    }


def completion_chunk_choice(choice: Choice, piece: str, finish: str | None) -> dict:
    return {"index": choice.index, "text": piece, "logprobs": None,
            "finish_reason": finish, "token_ids": choice.new_token_ids()}  # fmt: skip


def chat_choice(choice: Choice) -> dict:
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text},
        "finish_reason": choice.finish_reason,
        "logprobs": None,
    }


def chat_chunk_choice(choice: Choice, piece: str, finish: str | None, first: bool) -> dict:
    """A chat delta; a choice's first one names the role."""
    choice.new_token_ids()
    delta: dict[str, Any] = {"content": piece}
    if first:
        delta["role"] = "assistant"
    return {"index": choice.index, "delta": delta, "finish_reason": finish}
