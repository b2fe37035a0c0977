"""The block table: which KV cache blocks each request row owns.

A persistent host array ``[max_num_reqs, max_blocks_per_req]`` edited in place
as requests come, grow and go; each step gathers the rows of the scheduled
requests into a (pinned) staging tensor. The device copy belongs to the attention
metadata builder, which keeps it at a fixed address for CUDA graphs.
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

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        """This step's block table on the host: the given rows, in order."""
        staging = self._staging[: len(rows)]
        staging.numpy()[:] = self.table[rows]
        return staging
