"""Quantized weight formats: GGUF's Q8_0, Q4_0 and Q4_1 blocks, in the layouts we keep them in.

A quantized weight of N output rows and K inputs is a ``uint8`` tensor of shape
``[N, K / 32, block_bytes]``, the same bytes as the GGUF file holds (34 per block of 32
for Q8_0, 18 for Q4_0, 20 for Q4_1), so the weights take the file's memory and the
last dim names the format (``FORMATS``). Each row is rearranged once at load
(``from_gguf_blocks``) into the row layout:

* the row's scales first, ``nb = K / 32`` float16 ``d`` (Q4_1: then ``nb`` float16 ``m``);
* then its quants, in groups of 16 blocks (the last group may have fewer, ``G``): chunk
  ``k`` (0..7) of a group holds elements ``4k..4k+3`` of each of its blocks, 4 bytes per
  block, so one 64-byte load feeds one ``vpdpbusd`` whose 16 int32 lanes are the 16
  blocks, and a block's sum never leaves its lane;
* Q8_0 stores ``q + 128`` (unsigned: ``vpdpbusd`` multiplies unsigned by signed bytes);
  Q4 stores chunk ``2j`` in the low nibbles and chunk ``2j + 1`` in the high nibbles of
  packed chunk ``j`` (0..3).

Values: Q8_0 ``w = d * q`` (q int8), Q4_0 ``w = d * (q - 8)``, Q4_1 ``w = d * q + m``
(q in 0..15). Row order, rows of blocks, and block boundaries are those of the file, so
a row permutation, a slice of rows, or a slice of whole blocks along K (before the
rearrangement) is still a weight of the same format.

That row layout is how weights load (slices, fused parts, shards are whole rows). Once
loaded, ``pack_rows`` rearranges a linear layer's weight in place into the kernel's
layout, the same bytes in a different order, and records that (``is_packed``; the record is
kept with every processed weight's, ``packed_weights.py``):

* rows in groups of 16 (the last group has ``r = N mod 16`` rows, if any), each group's
  bytes where its rows' bytes were;
* a group of ``r`` rows holds first its scales, block by block the ``r`` rows' ``d``
  (float16; Q4_1: then all its ``m`` the same way), then its quants, block by block: chunk
  ``k`` (0..7) holds elements ``4k..4k+3`` of each row, 4 bytes per row, Q8_0 as
  ``q + 128``, Q4 two chunks per byte (chunk ``2j`` low nibbles, ``2j + 1`` high) as
  above. The quants start on a 64-byte line whenever ``nb`` is even (so do groups), so a
  full group's 64-byte loads never straddle two lines.

So one 64-byte load and one ``vpdpbusd`` with 4 bytes of x broadcast advance 16 rows by 4
elements, each row in its own int32 lane: no horizontal sums, and no lanes wasted on a
row whose block count is not a multiple of 16 (576 inputs are 18 blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compile_runtime.cpu.packed_weights import PackedWeight, lookup, record

BLOCK = 32  # values per block, every format


@dataclass(frozen=True)
class QuantFormat:
    name: str  # GGUF's type name
    block_bytes: int
    scale_bytes: int  # per block, at the start of a GGUF block: d (and m)
    bits: int


Q8_0 = QuantFormat("Q8_0", 34, 2, 8)
Q4_0 = QuantFormat("Q4_0", 18, 2, 4)
Q4_1 = QuantFormat("Q4_1", 20, 4, 4)
FORMATS = {f.block_bytes: f for f in (Q8_0, Q4_0, Q4_1)}
BY_NAME = {f.name: f for f in (Q8_0, Q4_0, Q4_1)}


def format_of(weight: torch.Tensor) -> QuantFormat | None:
    """The format of a quantized weight (``uint8`` ``[N, K/32, block_bytes]``), else None."""
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        return None
    return FORMATS.get(weight.shape[-1])


def quantized_shape(rows: int, cols: int, fmt: QuantFormat) -> tuple[int, int, int]:
    if cols % BLOCK:
        raise ValueError(f"{fmt.name} needs inputs in whole blocks of {BLOCK}; got {cols}")
    return rows, cols // BLOCK, fmt.block_bytes


def _groups(nb: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each group of 16 blocks of a row."""
    return [(b, min(16, nb - b)) for b in range(0, nb, 16)]


def _interleave(elements: np.ndarray) -> np.ndarray:
    """[N, nb, 32] -> [N, nb * 32]: per group, chunk k = elements 4k..4k+3 of each block."""
    n, nb, _ = elements.shape
    parts = []
    for b, g in _groups(nb):
        part = elements[:, b : b + g].reshape(n, g, 8, 4).transpose(0, 2, 1, 3)
        parts.append(part.reshape(n, -1))
    return np.concatenate(parts, axis=1)


def _deinterleave(quants: torch.Tensor, nb: int) -> torch.Tensor:
    """Inverse of ``_interleave``: [N, nb * 32] -> [N, nb, 32] (torch)."""
    n = quants.shape[0]
    parts = []
    for b, g in _groups(nb):
        part = quants[:, b * 32 : (b + g) * 32].reshape(n, 8, g, 4).transpose(1, 2)
        parts.append(part.reshape(n, g, 32))
    return torch.cat(parts, dim=1)


def from_gguf_blocks(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """GGUF blocks (``uint8``, [N, nb * block_bytes] or [N, nb, block_bytes]) -> our layout,
    ``uint8`` [N, nb, block_bytes]."""
    n = blocks.shape[0]
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, -1, fmt.block_bytes)
    nb = blocks.shape[1]
    scales = blocks[:, :, : fmt.scale_bytes]  # d (Q4_1: d, m), float16 each
    if fmt is Q4_1:
        scales = np.concatenate(
            [scales[:, :, :2].reshape(n, -1), scales[:, :, 2:].reshape(n, -1)], 1
        )
    else:
        scales = scales.reshape(n, -1)
    qs = blocks[:, :, fmt.scale_bytes :]
    if fmt is Q8_0:
        quants = _interleave(qs ^ np.uint8(0x80))
    else:  # element j: low nibble of byte j, element j + 16: its high nibble
        elements = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
        quants = _pack_nibbles(elements)
    return np.concatenate([scales, quants], axis=1).reshape(n, nb, fmt.block_bytes)


def _pack_nibbles(elements: np.ndarray) -> np.ndarray:
    """[N, nb, 32] nibbles -> [N, nb * 16]: per group, packed chunk j = chunks 2j | 2j+1 << 4."""
    n, nb, _ = elements.shape
    parts = []
    for b, g in _groups(nb):
        chunks = elements[:, b : b + g].reshape(n, g, 8, 4).transpose(0, 2, 1, 3)  # [n, 8, g, 4]
        packed = chunks[:, 0::2] | (chunks[:, 1::2] << 4)  # [n, 4, g, 4]
        parts.append(packed.reshape(n, -1))
    return np.concatenate(parts, axis=1)


def _unpack_nibbles(quants: torch.Tensor, nb: int) -> torch.Tensor:
    """Inverse of ``_pack_nibbles`` (torch): [N, nb * 16] -> [N, nb, 32] values 0..15."""
    n = quants.shape[0]
    parts = []
    for b, g in _groups(nb):
        packed = quants[:, b * 16 : (b + g) * 16].reshape(n, 4, g, 4)
        chunks = torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(n, 8, g, 4)
        parts.append(chunks.transpose(1, 2).reshape(n, g, 32))
    return torch.cat(parts, dim=1)


def _row_fields(weight: torch.Tensor, fmt: QuantFormat):
    """Row layout -> (d [N, nb, 2] bytes, m or None, stored quants [N, nb, 32])."""
    n, nb, _ = weight.shape
    flat = weight.reshape(n, -1)
    d = flat[:, : 2 * nb].reshape(n, nb, 2)
    m = flat[:, 2 * nb : 4 * nb].reshape(n, nb, 2) if fmt is Q4_1 else None
    quants = flat[:, (4 if fmt is Q4_1 else 2) * nb :]
    q = _deinterleave(quants, nb) if fmt is Q8_0 else _unpack_nibbles(quants, nb)
    return d, m, q


GROUP = 16  # rows per group of the packed layout


def _row_groups(n: int) -> list[tuple[int, int, int]]:
    """(first row, groups, rows per group): the full groups of 16 at once, then the rest."""
    full = n // GROUP
    parts = [(0, full, GROUP)] if full else []
    return parts + ([(full * GROUP, 1, n - full * GROUP)] if n % GROUP else [])


def _packed_bytes(fmt: QuantFormat, d, m, q) -> torch.Tensor:
    """(d, m, q) of the row layout -> the packed layout's bytes, flat."""
    n, nb = d.shape[:2]
    parts = []
    for start, groups, r in _row_groups(n):
        rows = slice(start, start + groups * r)

        def by_block(t: torch.Tensor, rows=rows, groups=groups, r=r) -> torch.Tensor:
            return t[rows].reshape(groups, r, nb, 2).transpose(1, 2).reshape(groups, -1)

        fields = [by_block(d)] + ([by_block(m)] if m is not None else [])
        e = q[rows].reshape(groups, r, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [g, nb, 8, r, 4]
        if fmt is not Q8_0:
            e = e[:, :, 0::2] | (e[:, :, 1::2] << 4)
        fields.append(e.reshape(groups, -1))
        parts.append(torch.cat(fields, dim=1).reshape(-1))
    return torch.cat(parts)


def _packed_fields(weight: torch.Tensor, fmt: QuantFormat):
    """Packed layout -> (d [N, nb, 2] bytes, m or None, stored quants [N, nb, 32])."""
    n, nb, bb = weight.shape
    flat = weight.reshape(-1)
    ds, ms, qs = [], [], []
    for start, groups, r in _row_groups(n):
        group = flat[start * nb * bb : (start + groups * r) * nb * bb].reshape(groups, -1)

        def by_row(t: torch.Tensor, groups=groups, r=r) -> torch.Tensor:
            return t.reshape(groups, nb, r, 2).transpose(1, 2).reshape(groups * r, nb, 2)

        scale = 2 * nb * r  # bytes of a group's d (or m)
        ds.append(by_row(group[:, :scale]))
        if fmt is Q4_1:
            ms.append(by_row(group[:, scale : 2 * scale]))
        e = group[:, (2 if fmt is Q4_1 else 1) * scale :]
        if fmt is Q8_0:
            e = e.reshape(groups, nb, 8, r, 4)
        else:
            packed = e.reshape(groups, nb, 4, r, 4)
            e = torch.stack([packed & 0x0F, packed >> 4], dim=3).reshape(groups, nb, 8, r, 4)
        qs.append(e.permute(0, 3, 1, 2, 4).reshape(groups * r, nb, 32))
    return torch.cat(ds), torch.cat(ms) if ms else None, torch.cat(qs)


def is_packed(weight: torch.Tensor) -> bool:
    """``weight``'s bytes are in the packed layout (``pack_rows``), and unchanged since."""
    return lookup(weight) is not None


def pack_rows(weight: torch.Tensor) -> PackedWeight:
    """Rearrange a quantized weight (row layout) in place into the packed layout, once; the
    record (``packed_weights.py``) says its bytes are in that layout while it is current."""
    fmt = format_of(weight)
    if fmt is None:
        raise ValueError(f"not a quantized weight: {weight.dtype} {tuple(weight.shape)}")
    entry = lookup(weight)
    if entry is not None:
        return entry
    with torch.no_grad():
        weight.view(-1).copy_(_packed_bytes(fmt, *_row_fields(weight, fmt)))
    return record(weight)


def dequantize(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A quantized weight (row layout, or packed) as floats, [N, K]."""
    fmt = format_of(weight)
    if fmt is None:
        raise ValueError(f"not a quantized weight: {weight.dtype} {tuple(weight.shape)}")
    n, nb, _ = weight.shape
    d8, m8, q = (_packed_fields if is_packed(weight) else _row_fields)(weight, fmt)
    d = d8.contiguous().view(torch.float16).float()  # [N, nb, 1]
    if fmt is Q8_0:
        w = d * (q.to(torch.int16) - 128).float()
    elif fmt is Q4_0:
        w = d * (q.to(torch.int16) - 8).float()
    else:
        w = d * q.float() + m8.contiguous().view(torch.float16).float()
    return w.reshape(n, nb * BLOCK).to(dtype)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] (K a multiple of 32) as Q8_0 in our layout: per block of 32,
    ``d = max|w| / 127`` (float16) and ``q = round(w / d)``, as llama.cpp quantizes."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 weights need inputs in whole blocks of {BLOCK}; got {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    amax = w.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(w * inv).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return torch.from_numpy(from_gguf_blocks(blocks.numpy(), Q8_0))
