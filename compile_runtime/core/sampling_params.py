"""How to sample one request: the user-facing knobs of generation."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StructuredOutputsParams(BaseModel):
    """One constraint on a request's output, as vLLM's ``StructuredOutputsParams``: a JSON
    schema, any JSON object, a regular expression, one of some strings, or an EBNF grammar.
    xgrammar enforces it token by token (core/structured_output.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # A JSON schema (a dict, or its text); ``json=`` as vLLM spells it.
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, as vLLM takes it)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [
            name
            for name in ("json_schema", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice is empty; give at least one string")
        return self


class SamplingParams(BaseModel):
    """Per-request sampling settings, named as vLLM names them. ``temperature == 0`` is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(default=1, ge=1)  # outputs per prompt (independent samples)
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off (vLLM's -1 is taken as 0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Tokens below min_p x the most likely token's probability are dropped (0 = off).
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # > 1 discourages repeats
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    # The range torch.Generator.manual_seed takes.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    logprobs: int | None = Field(default=None, ge=0)  # top-k logprobs to return
    # Logprobs of every prompt token after the first (and the top-k at each position): the
    # prompt is computed in full for them, never taken from the prefix cache.
    prompt_logprobs: int | None = Field(default=None, ge=0)
    # Text without the tokenizer's special tokens (<|im_end|>, </s>); token ids keep them.
    skip_special_tokens: bool = True
    # Strings that end the output when its text reaches one (the text stops before it unless
    # include_stop_str_in_output); the request finishes as "stop", its stop_reason the string.
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only (text None; stop strings need text)
    # The output must match this constraint (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("top_k", mode="before")
    @classmethod
    def _minus_one_is_off(cls, v: Any) -> Any:
        return 0 if v == -1 else v

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _stop_strings_need_text(self) -> SamplingParams:
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={self.stop!r} needs the text, but detokenize=False; use stop_token_ids "
                "with detokenize=False, or detokenize=True"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop has an empty string, which would stop at once; remove it")
        return self

    @model_validator(mode="after")
    def _min_not_above_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is larger than max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_argmax(self) -> bool:
        """The token is the argmax of the raw logits: greedy, no knob that changes them.

        The runner skips building sampling tensors for a batch of such requests.
        """
        return (
            self.greedy
            and self.logprobs is None
            and self.min_tokens == 0
            and not self.logit_bias
            and self.repetition_penalty == 1.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
        )
