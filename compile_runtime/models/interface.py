"""What the runner (and ``verify``) need of a causal language model; every model here has it."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from transformers import PretrainedConfig


class CausalLanguageModel(Protocol):
    """A model split where compilation stops: the compiled body runs the decoder stack over
    the step's flattened tokens; the LM head runs outside it, on the rows that sample."""

    config: PretrainedConfig
    # The @compile-decorated body: (input_ids [tokens], positions [tokens]) -> hidden states;
    # a pipeline stage after the first takes the previous stage's hidden states third.
    model: nn.Module

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits of the given rows (None on tensor-parallel ranks other than the first, and
        on pipeline stages other than the last)."""
        ...
