"""The block table: which KV cache blocks each request row owns.

A persistent host array ``[max_num_reqs, max_blocks_per_req]`` edited in place
as requests come, grow and go; each step gathers the rows of the scheduled
requests and commits them to the device in one copy.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    def __init__(
        self, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device
    ):
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        pin = device.type == "cuda"
        self._staging = torch.zeros(
            (max_num_reqs, max_blocks_per_req), dtype=torch.int32, pin_memory=pin
        )
        self.device_table = torch.zeros(
            (max_num_reqs, max_blocks_per_req), dtype=torch.int32, device=device
        )

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {end} blocks but the table has {self.max_blocks_per_req} "
                "columns; raise max_model_len or lower the request's length"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        self.num_blocks[row] = 0

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: ``rows[i]``'s block for ``positions[i]``, plus the offset."""
        blocks = self.table[rows, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def commit(self, rows: np.ndarray) -> torch.Tensor:
        """Device block table of this step: the given rows, in order, in one host-to-device copy."""
        n = len(rows)
        staging = self._staging[:n]
        staging.numpy()[:] = self.table[rows]
        out = self.device_table[:n]
        out.copy_(staging, non_blocking=True)
        return out
