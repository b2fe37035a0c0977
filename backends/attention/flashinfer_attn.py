"""FlashInfer paged attention: prefill and decode wrappers, planned outside the graph.

The metadata builder calls the wrappers' ``plan()`` once per step on the host
(it is not capturable and reads host arrays); the layers only call ``run()``.
Pure decode batches go to a decode wrapper; when the step runs inside a FULL
CUDA graph (``build(..., for_cudagraph=True)``) that is a wrapper in CUDA-graph
mode with fixed buffers for exactly this padded batch size, one per size,
every padded token being a one-token request on the null block. Mixed
batches go to the prefill wrapper (causal, attending to the cached prefix),
which is not capturable: support is UNIFORM_SINGLE_TOKEN_DECODE, so mixed
batches run with attention eager between piecewise graphs.

FlashInfer is imported only when a builder plans; this module imports without
it and on CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.attention.backend import (
    AttentionBackend,
    AttentionBackendError,
    AttentionImpl,
)
from compile_runtime.attention.kv_cache import NULL_BLOCK_ID
from compile_runtime.attention.metadata import AttentionMetadata, AttentionMetadataBuilder
from compile_runtime.attention.spec import AttentionSpec
from compile_runtime.config import AttentionCGSupport

INSTALL_HINT = (
    "pip install flashinfer-python (needs a CUDA GPU; its kernels compile just-in-time with nvcc)"
)
WORKSPACE_BYTES = 128 * 1024 * 1024


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise AttentionBackendError(
            f"the flashinfer attention backend needs FlashInfer: {INSTALL_HINT}"
        ) from e
    return flashinfer


@dataclass
class FlashInferState:
    """What the layers of one step run: a planned wrapper over the first ``num_tokens`` rows."""

    wrapper: Any
    num_tokens: int
    decode: bool
    dtype: torch.dtype
    spec: AttentionSpec  # window and soft cap are planned into the wrapper


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Plans FlashInfer's wrappers for the step; one builder serves all layers of a spec."""

    def __init__(
        self,
        spec: AttentionSpec,
        block_size: int,
        max_num_reqs: int,
        device: torch.device | str,
    ):
        super().__init__(spec, block_size, max_num_reqs, device)
        if self.device.type != "cuda":
            raise AttentionBackendError(
                f"the flashinfer attention backend runs on CUDA devices, not {self.device}"
            )
        self._flashinfer = import_flashinfer()
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill_wrapper: Any = None
        self._decode_wrapper: Any = None
        self._graph_decode_wrappers: dict[int, Any] = {}
        # Tensor cores pay off once several query heads share a KV head.
        self._use_tensor_cores = spec.num_queries_per_kv >= 4

    def _finish(
        self, metadata: AttentionMetadata, num_padded_tokens: int, for_cudagraph: bool
    ) -> None:
        if for_cudagraph and not metadata.uniform_decode:
            raise AttentionBackendError(
                "flashinfer runs mixed prefill/decode batches outside CUDA graphs only "
                "(support UNIFORM_SINGLE_TOKEN_DECODE); dispatch mixed batches to PIECEWISE or NONE"
            )
        if metadata.uniform_decode and for_cudagraph:
            # Every padded token is a request of its own: batch size = padded token count.
            num_tokens = num_padded_tokens
            wrapper = self._graph_decode_wrapper(num_tokens, metadata.block_table.shape[1])
        elif metadata.uniform_decode:
            num_tokens = metadata.num_actual_tokens
            wrapper = self._eager_decode_wrapper()
        else:
            num_tokens = metadata.num_actual_tokens
            wrapper = self._eager_prefill_wrapper()
        indptr, indices, last_page_len = self._paged_kv(
            metadata, num_tokens if for_cudagraph else 0
        )
        spec = self.spec
        window_left = spec.sliding_window - 1 if spec.sliding_window else -1
        if metadata.uniform_decode:
            wrapper.plan(
                indptr,
                indices,
                last_page_len,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_size,
                self.block_size,
                pos_encoding_mode="NONE",
                window_left=window_left,
                logits_soft_cap=spec.logits_soft_cap,
                sm_scale=spec.scale,
                q_data_type=spec.dtype,
                kv_data_type=spec.dtype,
            )
        else:
            wrapper.plan(
                metadata.query_start_loc_cpu,
                indptr,
                indices,
                last_page_len,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_size,
                self.block_size,
                causal=True,
                window_left=window_left,
                logits_soft_cap=spec.logits_soft_cap,
                sm_scale=spec.scale,
                q_data_type=spec.dtype,
                kv_data_type=spec.dtype,
            )
        metadata.backend_state = FlashInferState(
            wrapper, num_tokens, metadata.uniform_decode, spec.dtype, spec
        )

    def _paged_kv(
        self, metadata: AttentionMetadata, pad_to_reqs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's CSR page table: indptr and last_page_len on the host, indices on the device.

        Requests added by padding (up to ``pad_to_reqs``) get one page, the null block.
        """
        seq_lens = metadata.seq_lens_cpu.to(torch.int64)
        num_pages = (seq_lens + self.block_size - 1) // self.block_size
        last_page_len = seq_lens - (num_pages - 1).clamp(min=0) * self.block_size
        rows = torch.repeat_interleave(torch.arange(len(seq_lens)), num_pages)
        cols = torch.arange(int(num_pages.sum())) - torch.repeat_interleave(
            torch.cumsum(num_pages, 0) - num_pages, num_pages
        )
        indices = metadata.block_table[rows.to(self.device), cols.to(self.device)].to(torch.int32)
        num_padding = max(0, pad_to_reqs - len(seq_lens))
        if num_padding:
            num_pages = torch.cat([num_pages, torch.ones(num_padding, dtype=torch.int64)])
            last_page_len = torch.cat([last_page_len, torch.ones(num_padding, dtype=torch.int64)])
            indices = torch.cat(
                [
                    indices,
                    torch.full(
                        (num_padding,), NULL_BLOCK_ID, dtype=torch.int32, device=self.device
                    ),
                ]
            )
        indptr = torch.zeros(len(num_pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(num_pages, 0)
        return indptr, indices, last_page_len.to(torch.int32)

    def _eager_prefill_wrapper(self) -> Any:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD"
            )
        return self._prefill_wrapper

    def _eager_decode_wrapper(self) -> Any:
        if self._decode_wrapper is None:
            self._decode_wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self._use_tensor_cores
            )
        return self._decode_wrapper

    def _graph_decode_wrapper(self, batch_size: int, max_blocks_per_req: int) -> Any:
        """The CUDA-graph-mode decode wrapper of one padded batch size (buffers at fixed addresses)."""
        wrapper = self._graph_decode_wrappers.get(batch_size)
        if wrapper is None:
            int32 = {"dtype": torch.int32, "device": self.device}
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, **int32),
                paged_kv_indices_buffer=torch.zeros(batch_size * max_blocks_per_req, **int32),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, **int32),
            )
            self._graph_decode_wrappers[batch_size] = wrapper
        return wrapper


class FlashInferImpl(AttentionImpl):
    def check(self, query: torch.Tensor, metadata: AttentionMetadata) -> None:
        """The step must have been planned by FlashInfer's builder, for this layer's dtype,
        window and cap."""
        state = metadata.backend_state
        if not isinstance(state, FlashInferState):
            raise AttentionBackendError(
                "flashinfer layers need metadata from FlashInferBackend.make_builder(...).build(...)"
            )
        if query.dtype != state.dtype:
            raise AttentionBackendError(
                f"flashinfer was planned for {state.dtype} but the query is {query.dtype}; build "
                "the model (and so its Attention layers) under the dtype it runs in"
            )
        planned = (state.spec.sliding_window, state.spec.logits_soft_cap)
        if planned != (self.spec.sliding_window, self.spec.logits_soft_cap):
            raise AttentionBackendError(
                "flashinfer plans the sliding window and logit soft cap once per step, for "
                f"(window, cap) = {planned}, but this layer has "
                f"{(self.spec.sliding_window, self.spec.logits_soft_cap)}; give each "
                "(window, cap) its own builder (FlashInferBackend.metadata_key), as the runner does"
            )

    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> int:
        """The rows the wrapper was planned for: the real tokens, or in a FULL graph every
        padded token (each one a request on the null block)."""
        state: FlashInferState = metadata.backend_state
        n = state.num_tokens
        state.wrapper.run(query[:n].contiguous(), (kv_cache[0], kv_cache[1]), out=output[:n])
        return n


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    cg_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supported_dtypes = frozenset({torch.float16, torch.bfloat16})
    supported_devices = frozenset({"cuda"})
    supported_head_sizes = frozenset({64, 128, 256})
    impl_cls = FlashInferImpl
    builder_cls = FlashInferMetadataBuilder

    @classmethod
    def metadata_key(cls, spec: AttentionSpec) -> Hashable:
        return (spec.sliding_window, spec.logits_soft_cap)  # planned once per step

    @classmethod
    def missing_dependency(cls) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return f"needs FlashInfer: {INSTALL_HINT}"
        return None
