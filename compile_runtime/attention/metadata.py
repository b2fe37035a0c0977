"""Per-step attention metadata and the builder that makes it.

The runner builds metadata once per step (outside any graph) and passes it
through ``set_forward_context``; every attention layer of the step reads the
same object. The builder copies ``query_start_loc``, ``seq_lens`` and
``block_table`` into device buffers it owns, so a CUDA graph captured on one
step reads the next step's values from the same addresses whatever tensors
the runner passes. ``slot_mapping`` is used as given: pass a view of a
persistent buffer.

Padding. A graph runs at a padded token count. Tokens past
``num_actual_tokens`` are padding: their slot is -1 (their key/value land in
the null block) and their output rows are never read (the backends' one rule
for them is ``AttentionImpl.forward`` in ``compile_runtime/attention/backend.py``). The
request count is padded too (``num_reqs_padded``; for FULL graphs by default
to ``min(num_padded_tokens, max_num_reqs)``): padded requests have no query
tokens and ``seq_len`` 0, so kernel arguments are identical on every replay
of one captured size.

Lifetime. The device tensors of a metadata object are views of the builder's
buffers: they hold the latest step's values, so use a metadata object before
building the next one (the runner does, one step at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.attention.kv_cache import PADDING_SLOT
from compile_runtime.attention.spec import AttentionSpec
from compile_runtime.platforms.select import platform_for


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # real tokens; the rest of the step's tokens are padding
    num_reqs: int  # real requests
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool  # every request has exactly one query token (dispatcher.is_uniform_decode)
    block_size: int
    # Device tensors (int32 unless noted). Request i owns query tokens
    # query_start_loc[i]:query_start_loc[i+1] and attends to its seq_lens[i]
    # cached tokens (this step's included), the last query token being the last.
    query_start_loc: torch.Tensor  # [num_reqs_padded + 1]
    seq_lens: torch.Tensor  # [num_reqs_padded]
    block_table: torch.Tensor  # [num_reqs_padded, max_blocks_per_req], physical block ids
    slot_mapping: torch.Tensor  # [>= num_actual_tokens] int64, -1 = padding
    # Host copies of the real requests' values, for backends that plan on the CPU.
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # [num_reqs]
    # Whatever a backend's builder prepared for its kernels (FlashInfer's planned wrapper).
    backend_state: Any = None

    @property
    def num_reqs_padded(self) -> int:
        return self.query_start_loc.shape[0] - 1

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


class MetadataError(ValueError):
    """The runner passed inconsistent step data to a metadata builder."""


class AttentionMetadataBuilder:
    """Turns the runner's per-step arrays into ``AttentionMetadata``.

    Backends that need more (a plan, extra buffers) subclass this and fill
    ``backend_state`` in ``_finish``.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        block_size: int,
        max_num_reqs: int,
        device: torch.device | str,
    ):
        self.spec = spec
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        platform = platform_for(self.device)
        self._query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # Host staging of the two: on a CPU the buffers themselves (no second copy).
        self._query_start_loc_cpu, self._seq_lens_cpu = self._query_start_loc, self._seq_lens
        if platform.stages_inputs:
            pin = platform.pins_staging
            self._query_start_loc_cpu = torch.zeros(
                max_num_reqs + 1, dtype=torch.int32, pin_memory=pin
            )
            self._seq_lens_cpu = torch.zeros(max_num_reqs, dtype=torch.int32, pin_memory=pin)
        self._block_table: torch.Tensor | None = None  # [max_num_reqs, max_blocks], lazily
        # Blocks of the KV cache the steps address, once it is bound (the runner sets it):
        # a builder whose kernels read raw memory checks every step's block ids against it.
        self.num_cache_blocks: int | None = None
        # Query tokens a request runs in a uniform decode batch (the runner sets 1 + k under
        # speculative decoding): the batches the FULL decode graphs are captured for.
        self.uniform_decode_query_len = 1

    def build(
        self,
        query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_actual_tokens: int,
        *,
        num_reqs_padded: int | None = None,
        num_padded_tokens: int | None = None,
        for_cudagraph: bool = False,
    ) -> AttentionMetadata:
        """Metadata of one step.

        ``query_start_loc_cpu`` [num_reqs + 1] and ``seq_lens_cpu`` [num_reqs]
        are host tensors; ``slot_mapping`` lives on the device and
        ``block_table`` [>= num_reqs, max_blocks_per_req] on either. Entries of ``slot_mapping`` past ``num_actual_tokens`` are set
        to -1 here, so padded tokens never write into a request's blocks.
        ``num_padded_tokens`` is the token count the forward runs at (defaults
        to ``num_actual_tokens``). ``for_cudagraph`` says the step runs inside
        a FULL CUDA graph (capture or replay): requests are then padded to a
        count fixed by the padded size, and backends use fixed-address
        resources per size.
        """
        num_reqs = seq_lens_cpu.shape[0]
        num_padded_tokens = num_padded_tokens or num_actual_tokens
        padded = num_reqs_padded
        if padded is None:
            padded = num_reqs
            if for_cudagraph:
                padded = max(num_reqs, min(num_padded_tokens, self.max_num_reqs))
        # Inconsistent step data raises (checked here, not in a helper: this runs every step).
        if query_start_loc_cpu.device.type != "cpu" or seq_lens_cpu.device.type != "cpu":
            raise MetadataError("query_start_loc_cpu and seq_lens_cpu must be host (CPU) tensors")
        if query_start_loc_cpu.shape != (num_reqs + 1,):
            raise MetadataError(
                f"query_start_loc_cpu has shape {tuple(query_start_loc_cpu.shape)}; expected "
                f"({num_reqs + 1},) for {num_reqs} requests"
            )
        # numpy views: these checks run every step, and numpy's per-call cost on a
        # handful of numbers is a fraction of torch's.
        qsl, lens = query_start_loc_cpu.numpy(), seq_lens_cpu.numpy()
        if qsl[-1] != num_actual_tokens or qsl[0] != 0:
            raise MetadataError(
                f"query_start_loc_cpu must run from 0 to num_actual_tokens={num_actual_tokens}, "
                f"got {qsl.tolist()}"
            )
        if not num_reqs <= padded <= self.max_num_reqs:
            raise MetadataError(
                f"need num_reqs ({num_reqs}) <= num_reqs_padded ({padded}) <= "
                f"max_num_reqs ({self.max_num_reqs}); build the builder with a larger max_num_reqs"
            )
        if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
            raise MetadataError(
                f"block_table has shape {tuple(block_table.shape)}; expected "
                f"[>= {num_reqs}, max_blocks_per_req]"
            )
        query_lens, max_seq_len = qsl[1:] - qsl[:-1], 0
        if num_reqs:
            if (query_lens > lens).any() or (query_lens < 0).any():
                raise MetadataError(
                    "every request needs 0 <= query_len <= seq_len; query lens "
                    f"{query_lens.tolist()}, seq lens {lens.tolist()}"
                )
            max_seq_len = int(lens.max())
            max_blocks = -(-max_seq_len // self.block_size)
            if max_blocks > block_table.shape[1]:
                raise MetadataError(
                    f"a request of {max_seq_len} tokens needs {max_blocks} blocks of "
                    f"{self.block_size}; block_table has {block_table.shape[1]} columns"
                )

        staged_qsl, staged_lens = self._query_start_loc_cpu.numpy(), self._seq_lens_cpu.numpy()
        staged_qsl[: num_reqs + 1] = qsl
        staged_qsl[num_reqs + 1 : padded + 1] = num_actual_tokens
        staged_lens[:num_reqs] = lens
        staged_lens[num_reqs:padded] = 0
        query_start_loc = self._query_start_loc[: padded + 1]
        seq_lens = self._seq_lens[:padded]
        if self._query_start_loc_cpu is not self._query_start_loc:
            query_start_loc.copy_(self._query_start_loc_cpu[: padded + 1], non_blocking=True)
            seq_lens.copy_(self._seq_lens_cpu[:padded], non_blocking=True)
        table = self._block_table
        if table is None or table.shape[1] != block_table.shape[1]:
            table = self._block_table_buffer(block_table.shape[1])
        table = table[:padded]
        table[:num_reqs].copy_(block_table[:num_reqs], non_blocking=True)

        if slot_mapping.shape[0] > num_actual_tokens:
            slot_mapping[num_actual_tokens:].fill_(PADDING_SLOT)
        metadata = AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            num_reqs=num_reqs,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=max_seq_len,
            # is_uniform_decode(query_lens), inlined: one call less on every step.
            uniform_decode=num_reqs > 0 and bool((query_lens == 1).all()),
            block_size=self.block_size,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slot_mapping.to(self.device, non_blocking=True),
            # The step's own host tensors (the staging buffers are rewritten next step).
            query_start_loc_cpu=query_start_loc_cpu.to(torch.int32),
            seq_lens_cpu=seq_lens_cpu.to(torch.int32),
        )
        self._finish(metadata, num_padded_tokens, for_cudagraph)
        return metadata

    def _block_table_buffer(self, max_blocks: int) -> torch.Tensor:
        if self._block_table is None or self._block_table.shape[1] != max_blocks:
            # Rows past a step's requests are never read (their seq_len is 0).
            self._block_table = torch.zeros(
                (self.max_num_reqs, max_blocks), dtype=torch.int32, device=self.device
            )
        return self._block_table

    def _finish(
        self, metadata: AttentionMetadata, num_padded_tokens: int, for_cudagraph: bool
    ) -> None:
        """Backend hook: prepare ``metadata.backend_state``."""


def build_metadata(groups: Sequence[tuple[AttentionMetadataBuilder, list[str]]], *args, **kwargs):
    """The step's attention metadata for every group of layers (``groups.py``): one object,
    or one per layer name when groups differ. The arguments are ``build``'s."""
    if len(groups) == 1:
        return groups[0][0].build(*args, **kwargs)
    by_layer = {}
    for builder, names in groups:
        metadata = builder.build(*args, **kwargs)
        by_layer.update(dict.fromkeys(names, metadata))
    return by_layer
