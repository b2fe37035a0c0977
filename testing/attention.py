"""Synthetic paged batches with known contents, for tests and benchmarks.

A batch is a set of requests, each with ``context_len`` tokens already in the
cache and ``query_len`` new tokens this step, scattered over randomly chosen
blocks (never the null block), plus optional padding tokens. It keeps every
request's full keys and values so results can be checked against dense
attention computed request by request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile_runtime.attention.kv_cache import NULL_BLOCK_ID, PADDING_SLOT, kv_cache_shape


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_padded_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_padded_tokens, num_kv_heads, head_size] (this step's tokens)
    value: torch.Tensor
    kv_cache: torch.Tensor  # context already written; this step's tokens not yet
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_padded_tokens] int64, -1 for padding
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    num_actual_tokens: int
    full_keys: list[torch.Tensor]  # per request: [seq_len, num_kv_heads, head_size]
    full_values: list[torch.Tensor]

    @property
    def num_reqs(self) -> int:
        return len(self.full_keys)

    def expected_cache(self) -> torch.Tensor:
        """The cache after a correct step: exactly the real tokens' keys and values written."""
        cache = self.kv_cache.clone()
        n = self.num_actual_tokens
        slots = self.slot_mapping[:n]
        _, _, _, num_kv_heads, head_size = cache.shape
        cache[0].view(-1, num_kv_heads, head_size)[slots] = self.key[:n]
        cache[1].view(-1, num_kv_heads, head_size)[slots] = self.value[:n]
        return cache


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_padding: int = 0,
    spare_blocks: int = 2,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens need one entry per request")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    # Random physical blocks, skipping the null block.
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req + [1])
    block_table = torch.full((len(seq_lens), max_blocks), NULL_BLOCK_ID, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)

    cache = torch.zeros(
        kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device
    )
    full_keys, full_values, slots = [], [], []
    for i, (ctx, seq) in enumerate(zip(context_lens, seq_lens, strict=True)):
        k, v = randn(seq, num_kv_heads, head_size), randn(seq, num_kv_heads, head_size)
        full_keys.append(k)
        full_values.append(v)
        pos = torch.arange(seq)
        req_slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
        cache[0].view(-1, num_kv_heads, head_size)[req_slots[:ctx].to(device)] = k[:ctx]
        cache[1].view(-1, num_kv_heads, head_size)[req_slots[:ctx].to(device)] = v[:ctx]
        slots.append(req_slots[ctx:])
    slots.append(torch.full((num_padding,), PADDING_SLOT, dtype=torch.long))

    num_actual = sum(query_lens)
    pad_k = randn(num_padding, num_kv_heads, head_size)
    pad_v = randn(num_padding, num_kv_heads, head_size)
    key = torch.cat([k[c:] for k, c in zip(full_keys, context_lens, strict=True)] + [pad_k])
    value = torch.cat([v[c:] for v, c in zip(full_values, context_lens, strict=True)] + [pad_v])
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return PagedBatch(
        query=randn(num_actual + num_padding, num_heads, head_size),
        key=key,
        value=value,
        kv_cache=cache,
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        num_actual_tokens=num_actual,
        full_keys=full_keys,
        full_values=full_values,
    )
