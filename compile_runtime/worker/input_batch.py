"""The persistent batch: every running request's state, kept across steps.

Rows are allocated when a request arrives and freed when it ends; free rows
are reused. A step only applies the scheduler's differences (new requests,
appended blocks, finished ids) and reads the arrays by row: no per-step
rebuild of whole-batch state.

The block table (``BlockTable``): which KV cache blocks each request row owns, a persistent
host array ``[max_num_reqs, max_blocks_per_req]`` edited in place as requests come, grow and
go; each step's rows are gathered, in the step's order, into its (pinned) staging tensor. The
device copy belongs to the attention metadata builder, which keeps it at a fixed address for
CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler_output import NewRequestData, SchedulerOutput
from compile_runtime.lora.request import LoRARequest
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.sampling_metadata import make_generator


@dataclass
class RequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    plain_argmax: bool = False  # sampling_params.plain_argmax, read once
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # prompt + outputs so far
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_reqs, max_blocks, block_size, device)
        self.requests: dict[str, RequestState] = {}
        self.prompt_logprob_req_ids: set[str] = set()  # requests that want prompt logprobs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives the lowest

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, new: NewRequestData) -> RequestState:
        if new.req_id in self.requests:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError(
                f"the batch is full ({self.max_num_reqs} requests); raise max_num_seqs"
            )
        n = len(new.prompt_token_ids)
        if n > self.max_model_len:
            raise ValueError(
                f"request {new.req_id!r} has {n} tokens; max_model_len is {self.max_model_len}"
            )
        row = self._free_rows.pop()
        self.token_ids[row, :n] = new.prompt_token_ids
        self.num_tokens[row] = n
        self.block_table.add_row(row, new.block_ids)
        generator = None
        if new.sampling_params.seed is not None:
            generator = make_generator(new.sampling_params.seed, self.device)
        state = RequestState(
            req_id=new.req_id,
            row=row,
            prompt_token_ids=list(new.prompt_token_ids[: n - len(new.output_token_ids)]),
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            output_token_ids=list(new.output_token_ids),
            generator=generator,
            plain_argmax=new.sampling_params.plain_argmax,
            lora_request=new.lora_request,
        )
        self.requests[new.req_id] = state
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprob_req_ids.add(new.req_id)
        return state

    def apply(self, so: SchedulerOutput, take_tokens: bool = False) -> None:
        """Apply a step's differences: requests dropped, joining, their new blocks and drafts;
        with ``take_tokens`` (a pipelined rank that does not sample) the tokens each request
        got since this rank last saw it."""
        for req_id in so.finished_req_ids:
            self.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if blocks:  # a decode within its blocks adds none
                self.block_table.append_row(self.requests[req_id].row, blocks)
        if take_tokens:
            for req_id, tokens in zip(cached.req_ids, cached.new_token_ids, strict=True):
                for token in tokens:
                    self.append_token(req_id, token)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # After the request's last token, not counted in its tokens until accepted.
            row = self.requests[req_id].row
            end = int(self.num_tokens[row])
            self.token_ids[row, end : end + len(drafts)] = drafts

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        self.prompt_logprob_req_ids.discard(req_id)
        self.block_table.clear_row(state.row)
        self._free_rows.append(state.row)
        self._free_rows.sort(reverse=True)

    def append_token(self, req_id: str, token: int) -> None:
        state = self.requests[req_id]
        row = state.row
        n = int(self.num_tokens[row])
        if n >= self.max_model_len:
            raise ValueError(f"request {req_id!r} reached max_model_len ({self.max_model_len})")
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
        state.output_token_ids.append(token)

    def rows(self, req_ids: list[str]) -> np.ndarray:
        rows = np.empty(len(req_ids), dtype=np.int64)
        requests = self.requests
        for i, req_id in enumerate(req_ids):  # a loop: a generator's frames cost calls per step
            rows[i] = requests[req_id].row
        return rows


class BlockTable:
    def __init__(
        self, max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device
    ):
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Each step's rows, gathered by flatten_step (step_inputs.py); pinned on CUDA.
        self.staging = torch.zeros(
            (max_num_reqs, max_blocks_per_req),
            dtype=torch.int32,
            pin_memory=platform_for(device).pins_staging,
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
