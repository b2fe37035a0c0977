"""Pure-PyTorch paged attention: the reference every other backend is tested against.

Loops over requests on the host and gathers each request's blocks, so its
shapes depend on the data: correct for any mix of prefill chunks and decodes,
on CPU and CUDA, but never inside a CUDA graph.
"""

from __future__ import annotations

import torch

from compile_runtime.attention.backend import AttentionBackend, AttentionImpl
from compile_runtime.attention.dense import dense_causal_attention
from compile_runtime.attention.metadata import AttentionMetadata
from compile_runtime.config import AttentionCGSupport


class TorchNativeImpl(AttentionImpl):
    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> int:
        block_size, num_kv_heads, head_size = kv_cache.shape[2:]
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if start == end:
                continue
            blocks = metadata.block_table[i, : -(-seq_len // block_size)].to(torch.long)
            k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
            v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
            output[start:end] = dense_causal_attention(
                query[start:end],
                k.to(query.dtype),
                v.to(query.dtype),
                self.spec.scale,
                self.spec.sliding_window,
                self.spec.logits_soft_cap,
            )
        return metadata.num_actual_tokens


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    cg_support = AttentionCGSupport.NEVER  # host loop, data-dependent shapes
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_devices = frozenset({"cpu", "cuda"})
    impl_cls = TorchNativeImpl
