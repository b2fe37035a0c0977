"""A pipeline stage's part of a step: before its forward, the hidden states of the step's
tokens from the stage before; after it, its own to the stage after.

Only the step's real tokens travel: each stage pads to its own captured size, and the
padded rows' values never reach a real token. The last stage alone computes logits and
samples; the tokens then reach every rank (``sampling_step.broadcast_tokens``).
"""

from __future__ import annotations

import torch

from compile_runtime.distributed import receive_from_previous_stage, send_to_next_stage
from compile_runtime.distributed.pipeline import PipelineStage
from compile_runtime.worker.step_inputs import StepBuffers


def receive_stage_input(stage: PipelineStage, buffers: StepBuffers, total: int) -> None:
    """Fill the first ``total`` rows of the stage's input buffer from the previous stage."""
    if not stage.is_first:
        receive_from_previous_stage(buffers.hidden_states[:total])


def send_stage_output(stage: PipelineStage, hidden: torch.Tensor, total: int) -> None:
    """Hand the step's ``total`` rows of ``hidden`` to the next stage."""
    if not stage.is_last:
        send_to_next_stage(hidden[:total])
