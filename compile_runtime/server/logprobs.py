"""Logprobs in OpenAI's shapes, from the engine's per-token ``(chosen logprob, [(id, logprob),
...] top k)``: completions' ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``,
chat's ``content`` entries, and vLLM's ``prompt_logprobs``. The chosen token is always among
a position's top logprobs (added after the top k when it is not one of them), as OpenAI and
vLLM answer; ``-inf`` is sent as -9999.0, as they send it (JSON has no infinity)."""

from __future__ import annotations

from typing import Any

Entry = tuple[float, list[tuple[int, float]]] | None


def finite(logprob: float) -> float:
    return max(logprob, -9999.0)


def token_text(token: int, tokenizer: Any) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def ranked(token: int, entry: Entry, k: int) -> list[tuple[int, float]]:
    """The top ``k`` of a position, then the chosen token when it is not among them."""
    chosen, top = entry
    top = top[:k]
    if all(t != token for t, _ in top):
        top = [*top, (token, chosen)]
    return top


def completion_logprobs(
    token_ids: list[int], entries: list[Entry], tokenizer: Any, k: int, offset: int = 0
) -> tuple[dict, int]:
    """``/v1/completions``' logprobs of these tokens, their ``text_offset`` counted from
    ``offset`` (characters of the tokens before them); and where the next token's starts."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(token, tokenizer)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:  # the prompt's first token: nothing before it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite(entry[0]))
        out["top_logprobs"].append(
            {token_text(t, tokenizer): finite(lp) for t, lp in ranked(token, entry, k)}
        )
    return out, offset


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": finite(logprob),
            "bytes": list(text.encode("utf-8", errors="replace"))}  # fmt: skip


def chat_logprobs(token_ids: list[int], entries: list[Entry], tokenizer: Any, k: int) -> dict:
    """``/v1/chat/completions``' ``logprobs``: one ``content`` entry per token, with its top
    ``k`` (none for ``top_logprobs`` 0, as OpenAI answers)."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        item = _chat_entry(token_text(token, tokenizer), entry[0])
        top = ranked(token, entry, k) if k > 0 else []
        item["top_logprobs"] = [_chat_entry(token_text(t, tokenizer), lp) for t, lp in top]
        content.append(item)
    return {"content": content}


def prompt_logprobs(prompt: list[int], entries: list[Entry] | None, tokenizer: Any, k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), ``{token id:
    {"logprob", "rank", "decoded_token"}}`` of its top ``k`` and the token itself (its rank
    None when it is not among them: the engine does not rank past k)."""
    out: list[dict | None] = []
    for pos, token in enumerate(prompt):
        entry = entries[pos] if entries is not None and pos < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        ranks = {t: i + 1 for i, (t, _) in enumerate(entry[1][:k])}
        out.append(
            {
                str(t): {
                    "logprob": finite(lp),
                    "rank": ranks.get(t),
                    "decoded_token": token_text(t, tokenizer),
                }  # fmt: skip
                for t, lp in ranked(token, entry, k)
            }
        )
    return out
