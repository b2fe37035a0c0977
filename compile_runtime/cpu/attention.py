"""Batched paged attention for CPUs: one SDPA call per layer for each group of requests.

``torch_native`` loops over requests in Python; on a CPU that loop, not the math,
was most of a decode step. Here the metadata builder plans once per step what
every layer of the step shares (which requests decode and which prefill, where
their keys live in the cache, the masks), and each layer then does, per group,
one ``index_select`` of its cached keys/values and one
``scaled_dot_product_attention``:

* decode group (one query token each): the query heads that share a KV head
  become SDPA's query length, ``[reqs, kv_heads, queries_per_kv, d]`` against
  ``[reqs, kv_heads, seq, d]``, so grouped-query attention repeats no keys;
* prefill group (chunks of two or more tokens): one SDPA call per request over
  its own queries and keys, a causal mask offset by its cached prefix,
  ``enable_gqa`` (padding every chunk to the longest cost more than the calls).

This is far faster than the per-request loop at batch 32 decode; SDPA's GQA flag costs more
than the grouped view, a hand-written matmul/softmax more still, and the same math
compiled by Inductor (gather fused into the loops) was slower than the loop (the
README's "On a CPU" gives the times).
SDPA cannot soft-cap logits: layers with ``logits_soft_cap`` take that
hand-written path (``masked_attention``) instead.
"""

from __future__ import annotations

import torch

from compile_runtime.attention.backend import AttentionBackend, AttentionImpl
from compile_runtime.attention.dense import masked_attention
from compile_runtime.attention.kv_cache import write_kv_cache
from compile_runtime.attention.metadata import AttentionMetadata, MetadataError
from compile_runtime.config import AttentionCGSupport
from compile_runtime.cpu.attention_plan import (
    BatchedPlan,
    CPUBatchedMetadataBuilder,
    GroupPlan,
    check_bounds,
)
from compile_runtime.cpu.decode_kernel import load_decode_kernel

# What the C decode kernel computes in (cpu_decode_kernel.py).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_takes(spec, query, key, value, output, kv_cache) -> bool:
    """The C kernel reads raw float32 or bfloat16 memory: only layouts it was written for,
    every tensor in one of those dtypes (the slot mapping: ``_step_args``)."""
    dtype, d = query.dtype, spec.head_size
    return (
        dtype in KERNEL_DTYPES
        and key.dtype == dtype
        and value.dtype == dtype
        and output.dtype == dtype
        and kv_cache.dtype == dtype
        and query.shape[1] == spec.num_heads
        and output.shape[1] == spec.num_heads
        and key.shape[1] == spec.num_kv_heads
        and value.shape[1] == spec.num_kv_heads
        and query.shape[2] == d
        and key.shape[2] == d
        and value.shape[2] == d
        and output.shape[2] == d
        and query.stride(2) == 1
        and key.stride(2) == 1
        and value.stride(2) == 1
        and output.stride(2) == 1
        and query.stride(1) == d
        and key.stride(1) == d
        and value.stride(1) == d
        and output.stride(1) == d
        and kv_cache.shape[3:] == (spec.num_kv_heads, d)
        and kv_cache.is_contiguous()
    )


class CPUBatchedImpl(AttentionImpl):
    # The C decode kernel writes the whole step's keys/values in the same call as the decode
    # group's attention (one pass instead of two); without it, write_kv_cache writes them.
    compute_writes_cache = True

    def __init__(self, spec) -> None:
        super().__init__(spec)
        # The kernel's float arguments, by pointer: scale and soft cap.
        self._params = torch.tensor([spec.scale, spec.logits_soft_cap or 0.0], dtype=torch.float32)

    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> int:
        plan: BatchedPlan = metadata.backend_state
        kernel = None
        if (plan.uniform_query_len or plan.decode is not None) and _kernel_takes(
            self.spec, query, key, value, output, kv_cache
        ):
            kernel = load_decode_kernel()
        step = None if kernel is None else self._step_args(plan, kv_cache, metadata, key.shape[0])
        if step is not None:
            self._decode_kernel(kernel, query, key, value, kv_cache, step, output)
            if plan.uniform_query_len:
                # Every (padded) query row is written, padded ones with zeros: no rows left
                # for forward() to zero, so a CPU graph records one call per layer.
                return step[-2]
        else:
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            if plan.decode is not None:
                self._decode(query, kv_cache, plan.decode, output)
        if plan.prefill is not None:
            self._prefill(query, kv_cache, plan.prefill, output)
        return metadata.num_actual_tokens

    @staticmethod
    def _step_args(
        plan: BatchedPlan, kv_cache: torch.Tensor, metadata: AttentionMetadata, num_tokens: int
    ) -> tuple | None:
        """The kernel's arguments shared by the step's layers (None: the slot mapping is not
        the kernel's), checked against the cache at the step's first layer."""
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        key = (num_blocks, block_size, num_tokens)
        args = plan.kernel_step_args.get(key)
        if args is not None:
            return args
        if block_size != metadata.block_size:
            raise MetadataError(
                f"the step's blocks hold {metadata.block_size} tokens, the KV cache's "
                f"{block_size}; the metadata does not belong to this cache"
            )
        bounds = {k: getattr(plan, k) for k in ("min_block_id", "max_block_id", "max_slot")}
        check_bounds(bounds, num_blocks, block_size)
        slots, table = metadata.slot_mapping, metadata.block_table
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        q = plan.uniform_query_len
        group = None if q else plan.decode
        # A uniform batch reads the builder's persistent buffers, every padded request
        # included (fixed addresses and counts: what a CPU graph replays); a mixed step
        # names its decode requests and their query rows.
        reqs = None if q else group.req_index.data_ptr()
        tokens = None if q else group.query_tokens.data_ptr()
        rows = min(metadata.num_reqs_padded * q, num_tokens) if q else group.num_reqs
        args = (
            slots.data_ptr(), min(num_tokens, slots.shape[0]),
            table.data_ptr(), table.stride(0), metadata.seq_lens.data_ptr(), reqs, tokens,
            rows, max(q, 1),
        )  # fmt: skip
        plan.kernel_step_args[key] = args
        return args

    def _decode_kernel(self, kernel, query, key, value, kv_cache, step, output) -> None:
        """Cache writes of the whole step and the decode group's attention in one C call."""
        slots, num_new, table, table_stride, seq_lens, reqs, tokens, rows, q_len = step
        spec = self.spec
        keys = kv_cache.data_ptr()
        values = keys + kv_cache.stride(0) * kv_cache.element_size()
        decode = kernel["f32" if query.dtype == torch.float32 else "bf16"]
        decode(
            query.data_ptr(), query.stride(0),
            key.data_ptr(), key.stride(0),
            value.data_ptr(), value.stride(0),
            slots, num_new, keys, values, table, table_stride, seq_lens, reqs, tokens,
            output.data_ptr(), output.stride(0),
            rows, q_len, spec.num_heads, spec.num_kv_heads, spec.head_size,
            kv_cache.shape[2], self._params.data_ptr(), spec.sliding_window or 0,
            torch.get_num_threads(),
        )  # fmt: skip

    def _keys_values(
        self, kv_cache: torch.Tensor, group: GroupPlan, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[reqs, kv_heads, num_keys, d] views of the group's keys and values (one copy)."""
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        # Keys and values in one gather over whole blocks (rows of the flattened cache):
        # faster than index_select along the block dim of the 5-d cache.
        rows = group.kv_rows(num_blocks)
        kv = kv_cache.view(2 * num_blocks, -1).index_select(0, rows).to(dtype)
        shape = (2, group.num_reqs, group.num_blocks * block_size, num_kv_heads, head_size)
        kv = kv.view(shape)[:, :, : group.num_keys]
        beyond = group.beyond_seq_len
        if beyond is not None:  # other requests' old data: masked out, but inf/NaN would leak
            kv.masked_fill_(beyond[None, :, :, None, None], 0)
        kv = kv.transpose(2, 3)
        return kv[0], kv[1]

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: GroupPlan, output: torch.Tensor
    ) -> None:
        spec = self.spec
        k, v = self._keys_values(kv_cache, group, query.dtype)
        q = query.index_select(0, group.query_tokens)
        q = q.view(group.num_reqs, spec.num_kv_heads, spec.num_queries_per_kv, spec.head_size)
        mask = group.mask(spec.sliding_window)
        if mask is not None:  # [reqs, 1, 1, keys]: the same for every query head
            mask = mask[:, :, :1]
        out = masked_attention(q, k, v, mask, spec.scale, spec.logits_soft_cap)
        output[group.out_tokens] = out.view(group.num_reqs, spec.num_heads, spec.head_size)

    def _prefill(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: GroupPlan, output: torch.Tensor
    ) -> None:
        """Chunks of several requests: one SDPA call per request over its own queries and
        keys. Padding every chunk to the longest, as one batched call must, costs more
        than the calls: on SmolLM2's mixed workload (chunks of 8-200 tokens) the padded
        call did several times the attention work (README, "On a CPU")."""
        spec = self.spec
        k, v = self._keys_values(kv_cache, group, query.dtype)
        mask = group.mask(spec.sliding_window)
        seq_lens = group.seq_lens.numpy()
        for i in range(group.num_reqs):
            start, q_len, s_len = (
                int(group.query_starts[i]),
                int(group.query_lens[i]),
                int(seq_lens[i]),
            )
            q = query[start : start + q_len].unsqueeze(0).transpose(1, 2)
            out = masked_attention(
                q,
                k[i : i + 1, :, :s_len],
                v[i : i + 1, :, :s_len],
                None if mask is None else mask[i : i + 1, :, :q_len, :s_len],
                spec.scale,
                spec.logits_soft_cap,
                enable_gqa=spec.num_queries_per_kv > 1,
            )
            output[start : start + q_len] = out[0].transpose(0, 1)


class CPUBatchedBackend(AttentionBackend):
    name = "cpu_batched"
    cg_support = AttentionCGSupport.NEVER  # host planning, data-dependent shapes (torch path)
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_devices = frozenset({"cpu"})
    impl_cls = CPUBatchedImpl
    builder_cls = CPUBatchedMetadataBuilder

    @classmethod
    def graph_support(cls) -> AttentionCGSupport:
        """Uniform batches (one-token decodes, and speculative decoding's 1 + k tokens a
        request) run in one C call per layer reading fixed buffers (the C kernel): a CPU
        graph can hold them. Without the kernel, the torch path plans on the host."""
        from compile_runtime.cpu.graph import cpu_graphs_available

        if load_decode_kernel() is not None and cpu_graphs_available():
            return AttentionCGSupport.UNIFORM_BATCH
        return cls.cg_support
