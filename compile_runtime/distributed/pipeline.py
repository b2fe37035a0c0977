"""Which decoder layers each pipeline stage holds, and which checkpoint tensors it loads.

Layers split evenly; where they do not divide, the first stages take one more (the last
stage also runs the final norm, the LM head and the sampler). ``pipeline_layer_partition``
overrides the split with an explicit count per stage. The first stage holds the embedding,
the last the final norm and the LM head (and the embedding too when the LM head shares its
weights).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from compile_runtime.distributed.parallel_state import (
    get_parallel_state,
    get_pp_rank,
    get_pp_world_size,
)


class PipelineConfigError(ValueError):
    """The model's layers cannot be split into the stages asked for."""


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    rank: int
    size: int
    start: int  # the first layer this stage runs
    end: int  # one past its last
    tied: bool = False  # the LM head shares the embedding's weights

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def holds_embedding(self) -> bool:
        return self.is_first or (self.is_last and self.tied)

    def holds_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this stage."""
        layer = _LAYER.search(name)
        if layer is not None:
            return self.holds_layer(int(layer.group(1)))
        if "embed_tokens." in name:
            return self.holds_embedding
        if name.startswith(("lm_head.", "model.norm.")):
            return self.is_last
        return True


def stage_layer_counts(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[int]:
    """Layers per stage: ``partition`` when given (checked), else an even split."""
    if pp_size < 1:
        raise PipelineConfigError(f"pipeline_parallel_size={pp_size} must be at least 1")
    if partition is not None:
        partition = list(partition)
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise PipelineConfigError(
                f"pipeline_layer_partition={partition}: needs {pp_size} counts of at least 1 "
                f"that add up to the model's {num_layers} layers (num_hidden_layers)"
            )
        return partition
    if pp_size > num_layers:
        raise PipelineConfigError(
            f"pipeline_parallel_size={pp_size} is more stages than the model's {num_layers} "
            f"layers; use at most {num_layers}"
        )
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if stage < extra else 0) for stage in range(pp_size)]


def pipeline_stage(num_layers: int, *, tied: bool = False) -> PipelineStage:
    """This process's stage (the whole model outside a pipeline)."""
    rank, size = get_pp_rank(), get_pp_world_size()
    state = get_parallel_state()
    partition = state.pp_layer_partition if state is not None else None
    counts = stage_layer_counts(num_layers, size, partition)
    start = sum(counts[:rank])
    return PipelineStage(rank, size, start, start + counts[rank], tied)
