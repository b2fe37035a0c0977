"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's tokenizer (and chat template)
over HTTP, so a client can count and align tokens as the server will (``vllm bench serve``
aligns its prompts with them)."""

from __future__ import annotations

from typing import Any

from compile_runtime.server.api_error import APIError
from compile_runtime.server.engine_inputs import (
    chat_token_ids,
    check_text_length,
    text_bound,
)
from compile_runtime.server.protocol import DetokenizeRequest, TokenizeRequest


def _tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", None)
    return tokenizer


def tokenize(
    body: TokenizeRequest, tokenizer: Any, served: Any, max_model_len: int, trust: bool = False
) -> dict:
    """``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` when asked); ``served``:
    the models asked for by name (``lora_modules.ServedAdapters``); ``trust``: the request
    may bring its own chat template. Text longer than ``max_model_len`` tokens can hold is
    refused; the caller runs this in a worker thread."""
    served.resolve(body.model)
    tok = _tokenizer(tokenizer)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        check_text_length(len(body.prompt), text_bound(tok, max_model_len), "prompt")
        ids = tok(body.prompt, add_special_tokens=add_special)["input_ids"]
    else:
        ids = chat_token_ids(body, tok, body.tools, max_model_len, trust)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


def detokenize(body: DetokenizeRequest, tokenizer: Any, served: Any) -> dict:
    """``{"prompt": text}`` of the token ids."""
    served.resolve(body.model)
    tok = _tokenizer(tokenizer)
    vocab_size = len(tok)
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": tok.decode(body.tokens)}
