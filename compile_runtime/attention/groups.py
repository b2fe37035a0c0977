"""Which attention layers share a step's metadata (``metadata.build_metadata`` builds it).

Layers share one builder when they have the same backend and the backend plans the
same into it (FlashInfer plans per window and soft cap, so Gemma 2's alternating
layers form two groups). A model of one group gets one metadata object per step;
otherwise each layer gets its group's, by name.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from compile_runtime.attention.metadata import AttentionMetadataBuilder

if TYPE_CHECKING:
    from compile_runtime.attention.layer import Attention

# (the group's builder, the names of its layers), in the order layers first appear.
MetadataGroups = list[tuple[AttentionMetadataBuilder, list[str]]]


def metadata_groups(
    layers: Sequence[Attention], block_size: int, max_num_seqs: int, device: torch.device
) -> MetadataGroups:
    groups: dict[Hashable, tuple[AttentionMetadataBuilder, list[str]]] = {}
    for layer in layers:
        backend = layer.attn_backend
        key = (backend, backend.metadata_key(layer.spec))
        if key not in groups:
            builder = backend.make_builder(layer.spec, block_size, max_num_seqs, device)
            groups[key] = (builder, [])
        groups[key][1].append(layer.layer_name)
    return list(groups.values())
