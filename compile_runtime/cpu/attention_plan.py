"""The host side of ``cpu_batched``: a step's plan, made once and shared by its layers.

The metadata builder plans on the host what every layer of a step shares: which requests
decode and which prefill, where their keys live in the cache, the masks, and the bounds of
the block ids and slots the step touches, checked against the cache before any C kernel
(or a CPU graph replaying one) reads raw memory. numpy throughout: a step's planning is
tiny work on tiny arrays, where numpy's per-call cost is a tenth of torch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from compile_runtime.attention.metadata import (
    AttentionMetadata,
    AttentionMetadataBuilder,
    MetadataError,
)


@dataclass
class GroupPlan:
    """One SDPA call's worth of requests: where their queries, keys and outputs are."""

    num_reqs: int
    # Each request's first ``num_blocks`` block ids: [num_reqs * num_blocks] int64.
    block_ids: torch.Tensor
    num_blocks: int
    num_keys: int  # keys attended over per request (<= num_blocks * block_size)
    seq_lens: torch.Tensor  # [num_reqs] int64
    # Query position of each (padded) query row: [num_reqs, max_query_len] (host array).
    query_pos: np.ndarray
    # Token index of each query row (padded rows repeat the request's last token).
    query_tokens: torch.Tensor  # [num_reqs * max_query_len] int64
    # Where the real rows go: the output tokens.
    out_tokens: torch.Tensor | slice
    # Each request's first query token and query length (host arrays).
    query_starts: np.ndarray | None = None
    query_lens: np.ndarray | None = None
    # Each request's index in the step (int64), for the C kernel; None: request i is i.
    req_index: torch.Tensor | None = None
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _kv_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def beyond_seq_len(self) -> torch.Tensor | None:
        """[num_reqs, num_keys] True past each request's length; None if nothing is."""
        beyond = np.arange(self.num_keys)[None, :] >= self.seq_lens.numpy()[:, None]
        return torch.from_numpy(beyond) if beyond.any() else None

    def kv_rows(self, num_blocks: int) -> torch.Tensor:
        """Rows of the cache viewed as [2 * num_blocks, ...]: the keys' blocks, then the values'."""
        rows = self._kv_rows.get(num_blocks)
        if rows is None:
            rows = self._kv_rows[num_blocks] = torch.cat(
                [self.block_ids, self.block_ids + num_blocks]
            )
        return rows

    @property
    def max_query_len(self) -> int:
        return self.query_pos.shape[1]

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        """[num_reqs, 1, max_query_len, num_keys] bool, True = visible; None = all visible."""
        if sliding_window not in self.masks:
            k_pos = np.arange(self.num_keys)
            q_pos = self.query_pos[:, :, None]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            all_visible = bool(visible.all())
            self.masks[sliding_window] = None if all_visible else torch.from_numpy(visible[:, None])
        return self.masks[sliding_window]


@dataclass
class BatchedPlan:
    # The one-token decodes' group, or how to plan it: a uniform decode step plans it only
    # when a layer asks (a replayed FULL graph never does).
    planned_decode: GroupPlan | Callable[[], GroupPlan] | None
    prefill: GroupPlan | None
    # Largest block id and slot the step touches: the C kernel reads and writes raw
    # memory, so both are checked against the cache before it runs.
    min_block_id: int = 0
    max_block_id: int = 0
    max_slot: int = -1
    # The decode kernel's arguments every layer of the step shares, by (cache shape, padded
    # tokens): checked against the cache once a step, not once a layer.
    kernel_step_args: dict = field(default_factory=dict)
    # Every request runs this many query tokens (1: one-token decodes; 1 + k: speculative
    # decoding's verify step), so the C kernel can take them all from the builder's
    # persistent buffers, as a FULL graph replays it; 0: not such a batch. Above 1 the
    # plan's prefill group is the torch fallback, for when the kernel does not run.
    uniform_query_len: int = 0

    @property
    def decode(self) -> GroupPlan | None:
        if callable(self.planned_decode):
            self.planned_decode = self.planned_decode()
        return self.planned_decode


def _plan_group(
    req_idx: np.ndarray,
    query_start: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
) -> GroupPlan:
    """Plan for the requests ``req_idx``; numpy on the host (a step's planning is tiny work
    on tiny arrays, where numpy's per-call cost is a tenth of torch's)."""
    n = len(req_idx)
    q_lens, s_lens, starts = query_lens[req_idx], seq_lens[req_idx], query_start[req_idx]
    max_q, max_s = int(q_lens.max()), int(s_lens.max())
    num_blocks = -(-max_s // block_size)
    offsets = np.arange(max_q)
    real = offsets[None, :] < q_lens[:, None]  # [n, max_q]
    # Padded rows copy the request's last query row (valid everywhere, then dropped).
    row = np.minimum(offsets[None, :], q_lens[:, None] - 1)
    query_tokens = (starts[:, None] + row).reshape(-1)
    flat_real = real.reshape(-1)
    real_tokens = query_tokens[flat_real]
    first, count = int(real_tokens[0]), len(real_tokens)
    contiguous = bool((np.diff(real_tokens) == 1).all())
    return GroupPlan(
        num_reqs=n,
        block_ids=torch.from_numpy(block_table[req_idx, :num_blocks].reshape(-1).astype(np.int64)),
        num_blocks=num_blocks,
        num_keys=max_s,
        seq_lens=torch.from_numpy(s_lens),
        query_pos=s_lens[:, None] - q_lens[:, None] + row,
        query_tokens=torch.from_numpy(query_tokens),
        out_tokens=slice(first, first + count) if contiguous else torch.from_numpy(real_tokens),
        query_starts=starts,
        query_lens=q_lens,
        req_index=torch.from_numpy(req_idx.astype(np.int64)),
    )


class CPUBatchedMetadataBuilder(AttentionMetadataBuilder):
    def _finish(
        self, metadata: AttentionMetadata, num_padded_tokens: int, for_cudagraph: bool
    ) -> None:
        seq_lens = metadata.seq_lens_cpu.numpy().astype(np.int64)
        table = metadata.block_table.cpu().numpy()
        slots = metadata.slot_mapping[: metadata.num_actual_tokens].numpy()
        rows = table[: len(seq_lens)]
        bounds = {
            "min_block_id": int(rows.min()) if rows.size else 0,
            "max_block_id": int(rows.max()) if rows.size else 0,
            "max_slot": int(slots.max()) if len(slots) else -1,
        }
        num_blocks = self.num_cache_blocks  # checked before a replay too, which no layer checks
        if num_blocks is not None and (  # check_bounds' test, inlined: it raises
            bounds["min_block_id"] < 0
            or bounds["max_block_id"] >= num_blocks
            or bounds["max_slot"] >= num_blocks * self.block_size
        ):
            check_bounds(bounds, num_blocks, self.block_size)
        if metadata.uniform_decode:  # the common step: request i decodes token i
            decode = functools.partial(self._decode_plan, seq_lens, table)
            metadata.backend_state = BatchedPlan(decode, None, **bounds, uniform_query_len=1)
            return
        qsl = metadata.query_start_loc_cpu.numpy().astype(np.int64)
        query_lens = qsl[1:] - qsl[:-1]
        q = int(query_lens[0]) if len(query_lens) else 0
        # Speculative decoding's verify step: its FULL graph holds the C kernel; other chunks
        # of equal length are prefill work, for SDPA.
        uniform = 1 < q == self.uniform_decode_query_len and bool((query_lens == q).all())
        groups = []
        for selected in (query_lens == 1, query_lens > 1):
            req_idx = np.flatnonzero(selected)
            groups.append(
                _plan_group(req_idx, qsl[:-1], query_lens, seq_lens, table, self.block_size)
                if len(req_idx)
                else None
            )
        metadata.backend_state = BatchedPlan(
            *groups, **bounds, uniform_query_len=q if uniform else 0
        )

    def _decode_plan(self, seq_lens: np.ndarray, table: np.ndarray) -> GroupPlan:
        """``_plan_group`` for a batch of decodes only, without its general bookkeeping."""
        n = len(seq_lens)
        num_blocks = -(-int(seq_lens.max()) // self.block_size)
        return GroupPlan(
            num_reqs=n,
            block_ids=torch.from_numpy(table[:n, :num_blocks].reshape(-1).astype(np.int64)),
            num_blocks=num_blocks,
            num_keys=int(seq_lens.max()),
            seq_lens=torch.from_numpy(seq_lens),
            query_pos=(seq_lens - 1)[:, None],
            query_tokens=torch.arange(n),
            out_tokens=slice(0, n),
        )


def check_bounds(bounds: dict, num_blocks: int, block_size: int) -> None:
    """The step's block ids and slots lie inside a cache of ``num_blocks`` blocks: the C
    kernel (and a CPU graph replaying it) reads and writes raw memory."""
    if (
        bounds["min_block_id"] < 0
        or bounds["max_block_id"] >= num_blocks
        or bounds["max_slot"] >= num_blocks * block_size
    ):
        raise MetadataError(
            f"the step addresses blocks {bounds['min_block_id']}..{bounds['max_block_id']} and "
            f"slots up to {bounds['max_slot']} in blocks of {block_size}, but the KV cache has "
            f"{num_blocks} blocks; the block table or slot mapping does not belong to this cache"
        )
