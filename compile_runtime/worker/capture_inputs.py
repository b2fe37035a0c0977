"""The inputs each graph capture runs on: the runner's persistent buffers, and for a FULL
graph an attention batch that touches no real KV block."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from compile_runtime.attention.groups import build_metadata
from compile_runtime.config import CUDAGraphMode
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.graphs.capture import CaptureInputs
from compile_runtime.worker.step_inputs import capture_query_lens, query_start_loc


def capture_inputs(runner: Any, descriptor: BatchDescriptor, mode: CUDAGraphMode) -> CaptureInputs:
    """Inputs of a capture (``runner``: the ModelRunner); attention metadata only where the
    graph holds attention (FULL).

    Under PIECEWISE attention runs between the graphs, so the capture runs
    it without metadata (dense, no cache). A FULL capture gets a batch whose
    block tables point at block 1 and whose writes go to the null slot.
    """
    n = descriptor.num_tokens
    args = runner.buffers.forward_args(n)
    if mode != CUDAGraphMode.FULL:
        return CaptureInputs(args=args)
    c = runner.config
    query_lens = capture_query_lens(n, descriptor.num_reqs, c.max_model_len, c.max_num_seqs)
    block_table = torch.ones(
        (len(query_lens), runner.input_batch.block_table.max_blocks_per_req),
        dtype=torch.int32,
        device=runner.device,
    )
    slots = runner.buffers.slot_mapping[:n]
    slots.fill_(-1)
    metadata = build_metadata(
        runner.metadata_groups,
        query_start_loc(np.cumsum(query_lens)),
        torch.from_numpy(query_lens.copy()),
        block_table,
        slots,
        n,
        num_padded_tokens=n,
        for_cudagraph=True,
    )
    return CaptureInputs(args=args, attn_metadata=metadata)
