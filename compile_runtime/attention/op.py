"""The attention custom op: the split point of every compiled model.

``torch.ops.compile_runtime.attention(q, k, v, output, layer_name)`` writes
into ``output`` and returns nothing, so it is opaque to Dynamo and Inductor
(one node in the graph, easy to split at) and has fixed-address outputs
(capturable in a CUDA graph when the backend allows). The op finds the layer
object by name in a process-wide registry; the layer does the real work
(``compile_runtime.attention.layer.Attention``: reads the step's metadata from the
forward context, writes keys/values into its paged cache, runs its backend).
The fake implementation does nothing: the output buffer already has the
right shape, so tracing needs no metadata, cache or backend.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

ATTENTION_OP_NAME = "compile_runtime::attention"


class AttentionLayerLike(Protocol):
    """What the op calls: a layer that writes attention of q, k, v into output."""

    def forward_impl(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None: ...


_layers: weakref.WeakValueDictionary[str, AttentionLayerLike] = weakref.WeakValueDictionary()
_suffix = itertools.count(1)


def register_attention_layer(layer: AttentionLayerLike, prefix: str) -> str:
    """Register ``layer`` and return its unique name (``prefix``, or ``prefix#n`` if taken)."""
    name = prefix
    while name in _layers:
        name = f"{prefix}#{next(_suffix)}"
    _layers[name] = layer
    return name


def lookup_attention_layer(name: str) -> AttentionLayerLike:
    try:
        return _layers[name]
    except KeyError:
        raise KeyError(
            f"no attention layer named {name!r} is alive; attention layers register themselves "
            "when constructed (register_attention_layer) and vanish when garbage-collected"
        ) from None


def call_attention_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """The op's body as a plain function.

    The split graph calls this in place of the op at run time
    (``direct_splitting_piece``): the dispatcher is needed to trace the op, not
    to run it, and going through ``custom_op``'s wrapper cost ~25 us per layer.
    """
    lookup_attention_layer(layer_name).forward_impl(query, key, value, output)


@torch.library.custom_op(ATTENTION_OP_NAME, mutates_args=("output",))
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    call_attention_layer(query, key, value, output, layer_name)


@attention.register_fake
def _attention_fake(query, key, value, output, layer_name) -> None:
    return None


def default_splitting_ops() -> list[str]:
    """Op names the graph is split at when ``splitting_ops`` is None."""
    return [ATTENTION_OP_NAME]
