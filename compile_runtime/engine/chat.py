"""A conversation through the model's chat template, as the token ids of the prompt that
asks for the assistant's answer (``LLM.chat`` and the server's chat completions)."""

from __future__ import annotations

from typing import Any


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


def message_text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (their text joined)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def chat_prompt_ids(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """``messages`` (``{"role": ..., "content": ...}``, assistant ``tool_calls`` and ``tool``
    messages too) rendered and tokenized by the template; ``tools`` go to it as well."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model has no chat template (tokenizer_config.json chat_template); "
            "send a plain prompt instead (LLM.generate, /v1/completions)"
        )
    plain = [{**m, "content": message_text(m.get("content") or "")} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **({"tools": tools} if tools else {}),
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - a template error is the messages' problem
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
