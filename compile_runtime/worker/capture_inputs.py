"""The inputs each graph capture runs on: the runner's persistent buffers, and for a FULL
graph an attention batch that touches no real KV block."""

from __future__ import annotations

import numpy as np
import torch

from compile_runtime.attention.groups import MetadataGroups
from compile_runtime.attention.metadata import build_metadata
from compile_runtime.config import CUDAGraphMode, RunnerConfig
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.graphs.capture import CaptureInputs
from compile_runtime.worker.input_batch import BlockTable
from compile_runtime.worker.step_inputs import StepBuffers, capture_query_lens, query_start_loc


def capture_inputs(
    descriptor: BatchDescriptor,
    mode: CUDAGraphMode,
    *,
    buffers: StepBuffers,
    block_table: BlockTable,
    groups: MetadataGroups,
    config: RunnerConfig,
) -> CaptureInputs:
    """Inputs of a capture, in the runner's persistent ``buffers``; attention metadata (for
    ``groups``, over a ``block_table`` as wide as the runner's) only where the graph holds
    attention (FULL).

    Under PIECEWISE attention runs between the graphs, so the capture runs
    it without metadata (dense, no cache). A FULL capture gets a batch whose
    block tables point at block 1 and whose writes go to the null slot.
    """
    n = descriptor.num_tokens
    args = buffers.forward_args(n)
    if mode != CUDAGraphMode.FULL:
        return CaptureInputs(args=args)
    query_lens = capture_query_lens(
        n, descriptor.num_reqs, config.max_model_len, config.max_num_seqs
    )
    blocks = torch.ones(
        (len(query_lens), block_table.max_blocks_per_req),
        dtype=torch.int32,
        device=buffers.device,
    )
    slots = buffers.slot_mapping[:n]
    slots.fill_(-1)
    metadata = build_metadata(
        groups,
        query_start_loc(np.cumsum(query_lens)),
        torch.from_numpy(query_lens.copy()),
        blocks,
        slots,
        n,
        num_padded_tokens=n,
        for_cudagraph=True,
    )
    return CaptureInputs(args=args, attn_metadata=metadata)
