"""The attention custom op: the split point of every compiled model.

``torch.ops.compile_runtime.attention(q, k, v, output, layer_name)`` writes
into ``output`` and returns nothing, so it is opaque to Dynamo and Inductor
(one node in the graph, easy to split at) and has fixed-address outputs
(capturable in a CUDA graph when the backend allows). The op finds the layer
object by name in the layer table of the model whose forward is running (each
``@compile`` model makes its own table current around its calls: two engines in
one process keep the same names, so the same graph); the layer does the real work
(``compile_runtime.attention.layer.Attention``: reads the step's metadata from the
forward context, writes keys/values into its paged cache, runs its backend).
The fake implementation does nothing: the output buffer already has the
right shape, so tracing needs no metadata, cache or backend.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

ATTENTION_OP_NAME = "compile_runtime::attention"


class AttentionLayerLike(Protocol):
    """What the op calls: a layer that writes attention of q, k, v into output."""

    def forward_impl(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None: ...


class DuplicateLayerNameError(ValueError):
    """Two attention layers of one model have the same name."""


def attention_layer_table(model: torch.nn.Module) -> dict[str, AttentionLayerLike]:
    """``layer_name -> layer`` of every attention layer in ``model``.

    Names are the prefixes the model gave its layers, so two instances of a model
    trace the same graph (and share its cache entry); within one model a name
    must be unique.
    """
    table: dict[str, AttentionLayerLike] = {}
    where: dict[str, str] = {}
    for path, module in model.named_modules():
        name = getattr(module, "layer_name", None)
        if not isinstance(name, str) or not callable(getattr(module, "forward_impl", None)):
            continue
        if name in table:
            raise DuplicateLayerNameError(
                f"attention layers {where[name] or '<root>'!r} and {path!r} of "
                f"{type(model).__name__} are both named {name!r}; give each attention layer its "
                "own prefix (e.g. f'layers.{i}.self_attn.attn')"
            )
        table[name] = module
        where[name] = path
    return table


class _Running(threading.local):
    """The layer tables of the models whose forward is running in this thread, innermost last."""

    def __init__(self) -> None:
        self.tables: list[dict[str, AttentionLayerLike]] = []


_running = _Running()
TABLE_ATTR = "_compile_runtime_layers"  # where a model keeps its table, built at first use


class running_layers:  # noqa: N801 - used as a context manager, like a function
    """``with running_layers(model):`` the attention op finds ``model``'s layers.

    A ``@compile`` model does this around each of its calls; code that runs a model's
    graph by other means (``verify``) does it itself.
    """

    __slots__ = ("table",)

    def __init__(self, model: torch.nn.Module) -> None:
        table = model.__dict__.get(TABLE_ATTR)
        if table is None:
            table = model.__dict__[TABLE_ATTR] = attention_layer_table(model)
        self.table = table

    def __enter__(self) -> None:
        _running.tables.append(self.table)

    def __exit__(self, *exc: object) -> None:
        _running.tables.pop()


def lookup_attention_layer(name: str) -> AttentionLayerLike:
    """The layer ``name`` of the model whose forward is running."""
    try:
        return _running.tables[-1][name]
    except IndexError:
        raise LookupError(
            f"the attention op ran for layer {name!r} outside a model's forward; call the "
            "model (decorated with @compile_runtime.compile), which makes its layers the "
            "ones the op finds"
        ) from None
    except KeyError:
        raise KeyError(
            f"the running model has no attention layer named {name!r}; it has "
            f"{sorted(_running.tables[-1])[:8]}"
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
    to run it, and ``custom_op``'s wrapper costs time on every layer of every step.
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
