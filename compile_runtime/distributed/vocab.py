"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of the ranks and each rank holds a
contiguous block of rows. The embedding looks up the ids it owns, zeroes the
others and all-reduces (inside the compiled graph); the LM head computes its
block of logits and gathers them on rank 0 (outside the graph), which is the
only rank that samples. On one rank both are plain ``F.embedding`` /
``F.linear`` over the whole vocabulary.

The rank's first and last row ids are buffers, not Python constants, so the
traced graph is the same on every rank (one cache key for all ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compile_runtime.cpu.linear import linear
from compile_runtime.cpu.quant_gemm import ResolvedQuantLinear, resolve_quant_linear, run_resolved
from compile_runtime.distributed.communication import (
    gather_to_first_rank,
    tensor_parallel_all_reduce,
)
from compile_runtime.distributed.parallel_state import get_tp_rank, get_tp_world_size
from compile_runtime.distributed.sharding import vocab_range


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.rank, self.world_size = get_tp_rank(), get_tp_world_size()
        self.vocab_size = vocab_size
        self.start, self.end, self.rows = vocab_range(vocab_size, self.rank, self.world_size)
        self.register_buffer("vocab_start", torch.tensor(self.start), persistent=False)
        self.register_buffer("vocab_end", torch.tensor(self.end), persistent=False)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.weight.tp_shard = self._shard  # type: ignore[attr-defined]
        with torch.no_grad():  # nn.Embedding's initialisation; padding rows (no token) zero
            nn.init.normal_(self.weight)
            self.weight[self.end - self.start :].zero_()

    def _shard(self, shard_id: object) -> tuple[int, int, int] | None:
        if self.world_size == 1:
            return None
        return 0, self.start, self.end - self.start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        x = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return tensor_parallel_all_reduce(x)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows [{self.start}, {self.end}), tp={self.world_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; full logits on rank 0 only (None elsewhere)."""

    use_packed_weight = False  # set by compile_runtime.cpu.linear.pack_linear_weights
    # (weight, its packed quantized kernel call or None), found at the first call: None
    # before it, and after the call stopped holding (found again at the next).
    _resolved: tuple[torch.Tensor, ResolvedQuantLinear | None] | None = None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight
        logits = None
        if weight.dtype == torch.uint8:
            # A quantized head's kernel sums in float32 whatever x is: float32 logits keep
            # greedy's top two apart, where bf16's 8-bit mantissa often ties them.
            hidden_states = hidden_states.float()
            if self.use_packed_weight:  # cpu_linear's path, without walking it every step
                resolved = self._resolved
                if resolved is None or resolved[0] is not weight:
                    resolved = self._resolved = (weight, resolve_quant_linear(weight))
                plan = resolved[1]
                if plan is not None:
                    logits = run_resolved(plan, hidden_states)
                    if logits is None:
                        self._resolved = None  # no longer holds: found again next call
        if logits is None:
            logits = linear(hidden_states, weight, None, self.use_packed_weight)
        if self.world_size == 1:
            return logits
        gathered = gather_to_first_rank(logits, dim=-1)
        return gathered[..., : self.vocab_size] if gathered is not None else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden_states)
