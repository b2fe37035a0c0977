"""The request bodies the server takes, as vLLM's OpenAI server takes them: OpenAI's fields,
vLLM's sampling extras and the structured-output spellings (``structured.py`` maps them to
one constraint). Fields outside these are kept (``model_extra``) for ``unsupported.py`` to
judge: a 400 where the engine cannot honour one, else a warning.

These models check every field's type, nested parts included, and the ranges of the
floats (finite, in vLLM's ranges: penalties, temperature, top_p, logit_bias); text that is
not Unicode (a lone surrogate) anywhere in a body is a 400 naming the field. The other
ranges are checked once, by ``SamplingParams``; the sizes of output constraints by
``validation.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from compile_runtime.server import validation

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency, as vLLM's
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class OpenAIModel(BaseModel):
    # No NaN or Infinity in any float field.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A whole request body: its text checked once, nested parts included."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        validation.check_encodable(data)
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class SamplingExtras(OpenAIModel):
    """vLLM's sampling extras and output constraints: chat, completions and Responses."""

    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the output must match (at most one; structured.py): vLLM's, vLLM's older.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        validation.check_stop(v)
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        validation.check_count(v, validation.MAX_STOP_TOKEN_IDS, "stop token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        validation.check_count(v, validation.MAX_LOGIT_BIAS, "logit_bias entries")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            validation.check_structured(v, "structured_outputs")
        return v

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v: Any) -> Any:
        if v is not None:
            validation.check_schema(v, "guided_json")
        return v

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _guided_text(cls, v: str | None) -> str | None:
        if v is not None:
            validation.check_pattern(v, "the pattern")
        return v

    @field_validator("guided_choice")
    @classmethod
    def _guided_choice(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            validation.check_choices(v, "")
        return v


class SamplingFields(SamplingExtras):
    model: str | None = None  # None: the served model, as vLLM takes it
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)  # only best_of == n is served (unsupported.py)
    response_format: dict[str, Any] | None = None  # OpenAI's output constraint

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            validation.check_response_format(v, "response_format")
        return v

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


class CompletionRequest(SamplingFields, RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    add_special_tokens: bool = True


class ContentPart(OpenAIModel):
    """One part of a message's content; only text parts are served (``engine_inputs.py``)."""

    type: str = "text"
    text: str | None = None

    @model_validator(mode="after")
    def _text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text, a string")
        return self


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message; fields past these go to the template."""

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatTemplateFields(OpenAIModel):
    """How messages go through the chat template (chat completions and ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # only False: the template adds them


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, as vLLM takes it
    chat_template: str | None = None  # only with --trust-request-chat-template

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is not None:
            validation.check_tools(v)
        return v

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        validation.check_count(v, validation.MAX_MESSAGES, "messages")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is not None:
            validation.check_tool_choice(v)
        return v


class ResponsesRequest(SamplingExtras, RequestBody):
    """``POST /v1/responses``: OpenAI's Responses fields (``responses.py`` runs them as a chat
    completion) and vLLM's sampling extras (``SamplingExtras``)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None

    @field_validator("text")
    @classmethod
    def _text(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (v or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise ValueError("text.format must be an object such as {'type': 'text'}")
            validation.check_response_format(fmt, "text.format", flat=True)
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is not None:
            validation.check_tools(v, responses=True)
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, list):
            validation.check_count(v, validation.MAX_MESSAGES, "input items")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is not None:
            validation.check_tool_choice(v, responses=True)
        return v

    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # no reasoning models here: taken, unused
    include: list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        validation.check_count(v, validation.MAX_METADATA, "metadata pairs")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        validation.check_count(v, validation.MAX_INCLUDE, "include values")
        return v


class TokenizeRequest(ChatTemplateFields, RequestBody):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    return_token_strs: bool | None = False

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        validation.check_count(v, validation.MAX_MESSAGES, "messages")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v is not None:
            validation.check_tools(v)
        return v


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, v: list[int]) -> list[int]:
        validation.check_count(v, validation.MAX_DETOKENIZE_TOKENS, "tokens")
        return v


class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None
