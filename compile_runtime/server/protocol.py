"""The request bodies the server takes, as vLLM's OpenAI server takes them: OpenAI's fields,
vLLM's sampling extras and the structured-output spellings (``structured.py`` maps them to
one constraint). Fields outside these are kept (``model_extra``) for ``unsupported.py`` to
judge: a 400 where the engine cannot honour one, else a warning.

A value's range is checked once, by ``SamplingParams``; these models check types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class SamplingFields(OpenAIModel):
    model: str | None = None  # None: the served model, as vLLM takes it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # What the output must match (at most one; structured.py): OpenAI's, vLLM's, vLLM's older.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def want_usage(self) -> bool:
        """Usage in the stream: a last chunk (``include_usage``) or every chunk."""
        o = self.stream_options
        return o is not None and bool(o.include_usage or o.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    add_special_tokens: bool = True


class ChatMessage(OpenAIModel):
    """One message; fields past these (``tool_calls``, ``tool_call_id``) go to the template."""

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatTemplateFields(OpenAIModel):
    """How messages go through the chat template (chat completions and ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # only False: the template adds them


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, as vLLM takes it


class ResponsesRequest(OpenAIModel):
    """``POST /v1/responses``: OpenAI's Responses fields (``responses.py`` runs them as a chat
    completion); vLLM's sampling extras pass through to it."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # no reasoning models here: taken, unused
    include: list[str] | None = None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None
