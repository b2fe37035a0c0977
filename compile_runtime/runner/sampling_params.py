"""How to sample one request: the user-facing knobs of generation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """Per-request sampling settings. ``temperature == 0`` means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
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
