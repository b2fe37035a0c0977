"""A step split into two micro-batches at a request boundary, each run with its own
attention metadata (and adapter map), one after the other without graphs.

The design's micro-batching overlaps one half's communication with the other's compute
on a GPU; on a CPU it is correctness only: the sliced step gives the same tokens.

Both halves build their metadata into the same pinned staging buffers (the builders' and
the LoRA map's), copied to the device without blocking: before the second half writes
them, the host waits for the event ``forward_args`` recorded after the first half's copies
(``StepBuffers._copied``; None on a CPU, where nothing is staged).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from compile_runtime.attention.groups import MetadataGroups
from compile_runtime.attention.metadata import build_metadata
from compile_runtime.forward_context import BatchDescriptor, set_forward_context
from compile_runtime.lora.manager import LoRAManager
from compile_runtime.worker.step_inputs import StepBuffers, StepInputs, query_start_loc


def microbatch_split(step: StepInputs, threshold: int) -> int | None:
    """How many of the step's requests go in the first micro-batch (the request boundary
    nearest half its tokens), or None: too few requests or tokens (``threshold``) to split."""
    n, total = len(step.req_ids), step.total
    if n < 2 or total < threshold:
        return None
    boundaries = step.cu_num_scheduled[:-1]
    return int(np.argmin(np.abs(boundaries - total / 2))) + 1


def run_microbatches(
    step: StepInputs,
    split: int,
    loras: list,
    *,
    model: Callable[..., torch.Tensor],
    buffers: StepBuffers,
    groups: MetadataGroups,
    lora: LoRAManager | None,
) -> torch.Tensor:
    """The step's hidden states, computed as two micro-batches of ``model`` (the forward
    without graphs), the step's tokens in ``buffers`` already."""
    cu = step.cu_num_scheduled
    parts = []
    for lo, hi in ((0, split), (split, len(step.req_ids))):
        t0, t1 = (int(cu[lo - 1]) if lo else 0), int(cu[hi - 1])
        if lo and buffers._copied is not None:
            buffers._copied.synchronize()  # the first half's copies have read the staging
        has_lora = False
        if lora is not None:
            has_lora = lora.prepare_step(loras[lo:hi], step.num_scheduled[lo:hi], t1 - t0)
        metadata = build_metadata(
            groups,
            query_start_loc(cu[lo:hi] - t0),
            torch.from_numpy(step.seq_lens[lo:hi].astype(np.int32)),
            step.block_table[lo:hi],
            buffers.slot_mapping[t0:t1],
            t1 - t0,
            num_padded_tokens=t1 - t0,
        )
        descriptor = BatchDescriptor(t1 - t0, has_lora=has_lora)
        with set_forward_context(metadata, batch_descriptor=descriptor):
            hidden = model(*buffers.forward_args(t1, start=t0))
        parts.append(hidden.clone() if not parts else hidden)  # the next forward may reuse it
    return torch.cat(parts)
