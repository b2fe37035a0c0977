"""One step's tokens laid out flat, and the rows whose logits the step needs.

The scheduler says how many tokens each request computes this step and how many it
had computed before. From those and the persistent batch come the step's flat token
ids, positions and KV slots (request after request), its query start locations and
sequence lengths. After the forward, logits are taken in one call at: the last
position of each request whose known sequence is now computed, every draft position
of a request verifying drafts (speculative decoding), then the prompt positions of
requests that asked for prompt logprobs.

Host to device. On CUDA the step's ids, positions and slots are written into pinned
host staging buffers (allocated once, ``staging_buffer``) and copied with
``non_blocking=True``: a copy from pageable memory goes through the driver's own
staging and blocks the host until it is done. The block table and the metadata
builders stage theirs in pinned buffers too. ``StepBuffers.load`` copies the step in,
builds its metadata and records an event after all of the step's copies (so does
``forward_args``, for callers that build metadata themselves); the next ``load`` waits
for it before any staging buffer is written again (a step that samples nothing does not
wait for the device otherwise). On a CPU the
staging buffers are the step buffers themselves: no pinning, no second copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from compile_runtime.attention.groups import MetadataGroups
from compile_runtime.attention.metadata import build_metadata
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    req_ids: list[str]
    rows: np.ndarray  # each request's row in the persistent batch
    num_scheduled: np.ndarray  # tokens each request computes this step
    num_computed: np.ndarray  # tokens each request had computed before this step
    cu_num_scheduled: np.ndarray  # running sum of num_scheduled: where each request ends
    token_ids: np.ndarray  # [total] the step's tokens
    positions: np.ndarray  # [total]
    slot_mapping: torch.Tensor  # [total] the KV cache slot each token writes
    total: int  # the step's tokens
    seq_lens: np.ndarray  # tokens each request attends to: computed + this step's
    # [num_reqs, max_blocks_per_req] host int32: the requests' rows of the block table, in
    # order (a view of the batch's staging, rewritten next step).
    block_table: torch.Tensor
    query_start_loc: torch.Tensor  # host int32 [0, *cu_num_scheduled], as builders take it
    # Every request's known sequence is computed by this step: each samples at its last row.
    samples_every_request: bool = True


def pins_staging(device: torch.device | str) -> bool:
    """Whether host-to-device copies to ``device`` go through pinned memory: on CUDA only
    (a CPU "copy" is a memcpy; pinning there costs and buys nothing)."""
    return platform_for(device).pins_staging


def staging_buffer(
    shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A host tensor that per-step copies to ``device`` start from, pinned when
    ``pins_staging(device)``: allocate once, write each step, copy with non_blocking."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pins_staging(device))


class StepBuffers:
    """The forward's inputs in persistent buffers of ``max_num_tokens``: a CUDA graph
    replays from the addresses it was captured at, whatever the step."""

    def __init__(
        self,
        max_num_tokens: int,
        device: torch.device,
        stage_input: tuple[int, torch.dtype] | None = None,
    ):
        """``stage_input``: (hidden size, dtype) of the hidden states a pipeline stage after
        the first receives from the one before (None: the first stage, or no pipeline)."""
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        self.hidden_states: torch.Tensor | None = None
        if stage_input is not None:
            hidden_size, dtype = stage_input
            self.hidden_states = torch.zeros(
                (max_num_tokens, hidden_size), dtype=dtype, device=device
            )
        self.device = device
        self._buffers = (self.input_ids, self.positions, self.slot_mapping)
        # Where load writes: on a CPU the buffers themselves, else one staging row each.
        self.staging: tuple[torch.Tensor, ...] = self._buffers
        platform = platform_for(device)
        if platform.stages_inputs:
            self.staging = tuple(staging_buffer((3, max_num_tokens), torch.long, device))
        # On CUDA: the last step's host-to-device copies (recorded by forward_args).
        self._copied = platform.step_event()

    def forward_args(self, num_tokens: int, start: int = 0) -> tuple[torch.Tensor, ...]:
        """The forward's arguments for tokens ``start:num_tokens``; called after the step's
        copies (this one's, the block table's and the metadata builders'), so on CUDA it
        marks their end."""
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        args = (self.input_ids[start:num_tokens], self.positions[start:num_tokens])
        if self.hidden_states is not None:
            args += (self.hidden_states[start:num_tokens],)
        return args

    def load(
        self,
        step: StepInputs,
        num_padded: int,
        groups: MetadataGroups = (),
        *,
        for_cudagraph: bool = False,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Copy the step in, padded tokens id 0 at position 0; build its attention metadata
        for ``groups`` (whose builders give padded tokens the null slot; None without
        groups). The forward's arguments for ``num_padded`` tokens and the metadata: one call
        where a step would make three (this, the metadata, ``forward_args``)."""
        total = step.total
        copied = self._copied
        if copied is not None:
            copied.synchronize()  # the last step's copies have read every staging buffer
        ids, positions, slots = self.staging
        ids[:total].copy_(torch.from_numpy(step.token_ids))
        positions[:total].copy_(torch.from_numpy(step.positions))
        slots[:total].copy_(step.slot_mapping)
        if self.staging is not self._buffers:
            for buffer, host in zip(self._buffers, self.staging, strict=True):
                buffer[:total].copy_(host[:total], non_blocking=True)
        if num_padded > total:
            self.input_ids[total:num_padded].zero_()
            self.positions[total:num_padded].zero_()
        metadata = None
        if groups:
            metadata = build_metadata(
                groups,
                step.query_start_loc,
                torch.from_numpy(step.seq_lens.astype(np.int32)),
                step.block_table,
                self.slot_mapping[:num_padded],
                total,
                num_padded_tokens=num_padded,
                for_cudagraph=for_cudagraph,
            )
        if copied is not None:  # forward_args' mark, after every copy of the step
            copied.record(torch.cuda.current_stream(self.device))
        args = (self.input_ids[:num_padded], self.positions[:num_padded])
        if self.hidden_states is not None:
            args += (self.hidden_states[:num_padded],)
        return args, metadata


def query_start_loc(cu_query_lens: np.ndarray) -> torch.Tensor:
    """``[0, *cu_query_lens]`` as the host int32 tensor the metadata builders take."""
    qsl = np.zeros(len(cu_query_lens) + 1, dtype=np.int32)
    qsl[1:] = cu_query_lens
    return torch.from_numpy(qsl)


class TokenIdError(ValueError):
    """A step's token id lies outside the vocabulary."""


def flatten_step(
    batch: InputBatch,
    num_scheduled_tokens: dict[str, int],
    num_computed_tokens: dict[str, int],
    vocab_size: int | None = None,
) -> StepInputs:
    """The step's tokens in the scheduler's request order: each request computes its
    ``num_scheduled_tokens`` from position ``num_computed_tokens`` on (the scheduler's count).
    Ids outside a ``vocab_size`` vocabulary raise ``TokenIdError`` before any forward: a
    kernel reading the embedding table (a replayed one above all) would read outside it."""
    req_ids = list(num_scheduled_tokens)
    n = len(req_ids)
    # map and fromiter run in C: no generator frames on every step.
    num_scheduled = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=n)
    num_computed = np.fromiter(map(num_computed_tokens.__getitem__, req_ids), np.int64, n)
    rows = np.empty(n, dtype=np.int64)
    requests = batch.requests
    for i, req_id in enumerate(req_ids):  # a loop: a generator's frames cost calls per step
        rows[i] = requests[req_id].row
    qsl = np.zeros(n + 1, dtype=np.int64)
    cu = np.cumsum(num_scheduled, out=qsl[1:])
    if (num_scheduled == 1).all():  # decodes: token i is request i's, no expansion
        positions, token_rows = num_computed, rows
    else:
        req_index = np.repeat(np.arange(len(req_ids)), num_scheduled)
        offsets = np.arange(len(req_index)) - (cu - num_scheduled)[req_index]
        positions = num_computed[req_index] + offsets
        token_rows = rows[req_index]
    # block_table[row, p // bs] * bs + p % bs (compute_slot_mapping's formula) in numpy,
    # whose per-call cost on a step's few numbers is a fraction of torch's.
    table = batch.block_table
    block_size = table.block_size
    blocks = table.table[token_rows, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    token_ids = batch.token_ids[token_rows, positions]
    if vocab_size is not None and n:
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= vocab_size:
            raise TokenIdError(
                f"token id {low if low < 0 else high} is outside the vocabulary of "
                f"{vocab_size}; check the prompt's token ids"
            )
    step_table = table.staging[:n]
    step_table.numpy()[:] = table.table[rows]
    seq_lens = num_computed + num_scheduled
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=num_scheduled,
        num_computed=num_computed,
        cu_num_scheduled=cu,
        token_ids=token_ids,
        positions=positions,
        slot_mapping=torch.from_numpy(slots),
        total=int(cu[-1]) if n else 0,
        seq_lens=seq_lens,
        block_table=step_table,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        samples_every_request=bool((seq_lens >= batch.num_tokens[rows]).all()),
    )


class PromptSpan(NamedTuple):
    """Prompt positions of one request whose next token is a prompt token, computed this step."""

    req_id: str
    first: int  # position of the first
    flat_row: int  # its row among the step's tokens
    count: int


@dataclass
class LogitsRows:
    """Which of the step's hidden rows get logits: sampling rows first, then prompt rows."""

    indices: np.ndarray
    sampling_req_ids: list[str]  # requests whose known sequence is computed: they get tokens
    drafts: list[list[int]] | None  # per sampling request, when any request has drafts
    num_sampling_rows: int  # per sampling request 1 + its drafts
    prompt_spans: list[PromptSpan]


def logits_rows(
    step: StepInputs, batch: InputBatch, spec_tokens: dict[str, list[int]]
) -> LogitsRows:
    """The rows to take logits at (``spec_tokens``: each request's drafts this step)."""
    spans = prompt_logprob_spans(step, batch) if batch.prompt_logprob_req_ids else []
    if not spec_tokens and not spans and step.samples_every_request:  # each one's last row
        num = len(step.req_ids)
        return LogitsRows(step.cu_num_scheduled - 1, list(step.req_ids), None, num, [])
    done = step.seq_lens >= batch.num_tokens[step.rows]
    sampling_idx = np.nonzero(done)[0]
    sampling_req_ids = [step.req_ids[i] for i in sampling_idx]
    drafts = None
    num_logits = np.ones(len(sampling_idx), dtype=np.int64)
    if spec_tokens:
        drafts = [spec_tokens.get(r, []) for r in sampling_req_ids]
        num_logits += [len(d) for d in drafts]
    # The last num_logits positions of each sampling request, in order.
    ends = np.repeat(step.cu_num_scheduled[sampling_idx], num_logits)
    back = np.repeat(np.cumsum(num_logits), num_logits) - np.arange(int(num_logits.sum()))
    indices = ends - back
    if spans:
        indices = np.concatenate(
            [indices, *(np.arange(s.flat_row, s.flat_row + s.count) for s in spans)]
        )
    return LogitsRows(
        indices=indices,
        sampling_req_ids=sampling_req_ids,
        drafts=drafts,
        num_sampling_rows=int(num_logits.sum()),
        prompt_spans=spans,
    )


def hidden_rows(hidden: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
    """``hidden[indices]``; a view when they are its first rows in order (a decode step)."""
    n = len(indices)
    if n and indices[-1] == n - 1 and (n == 1 or (np.diff(indices) == 1).all()):
        return hidden[:n]
    return hidden[torch.from_numpy(indices).to(hidden.device)]


def prompt_logprob_spans(step: StepInputs, batch: InputBatch) -> list[PromptSpan]:
    """This step's prompt positions scored for the requests that want prompt logprobs."""
    if not batch.prompt_logprob_req_ids:
        return []
    spans = []
    for i, req_id in enumerate(step.req_ids):
        if req_id not in batch.prompt_logprob_req_ids:
            continue
        first = int(step.num_computed[i])
        num_prompt = len(batch.requests[req_id].prompt_token_ids)
        end = min(first + int(step.num_scheduled[i]), num_prompt - 1)
        if end > first:
            flat_row = int(step.cu_num_scheduled[i] - step.num_scheduled[i])
            spans.append(PromptSpan(req_id, first, flat_row, end - first))
    return spans


def profile_query_lens(num_tokens: int, max_num_seqs: int) -> np.ndarray:
    """Query lengths of the profiling forward: ``num_tokens`` over ``max_num_seqs`` requests
    (fewer when there are fewer tokens), as even as they divide: none is longer than
    ``ceil(num_tokens / max_num_seqs)`` (<= max_model_len, as the runner's step size is)."""
    count = max(1, min(max_num_seqs, num_tokens))
    query_lens = np.full(count, num_tokens // count, dtype=np.int32)
    query_lens[: num_tokens % count] += 1
    return query_lens


def capture_query_lens(
    num_tokens: int, num_reqs: int | None, max_model_len: int, max_num_seqs: int
) -> np.ndarray:
    """Query lengths of a FULL graph's capture batch of ``num_tokens``: ``num_reqs`` requests
    (enough of them that none is longer than ``max_model_len``), the last taking the rest."""
    n = num_tokens
    count = max(num_reqs or 1, -(-n // max_model_len))
    count = min(count, max_num_seqs, n)
    query_lens = np.full(count, n // count, dtype=np.int32)
    query_lens[-1] += n - int(query_lens.sum())
    return query_lens
