"""The runner's CUDA graphs, decided once: after the first forward, when the split is known.

The mode is ``CompilationConfig.resolve`` against the attention backends' support
and what the trace's split really produced (a ``splitting_ops`` entry can match
nothing: then no piecewise graph may run, since it would capture attention). That
mode gives the dispatcher its keys and padding tables, and decides whether the whole
model is wrapped for FULL graphs. Before the plan exists the runner calls the bare
compiled model, outside any graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compile_runtime.attention.selector import min_cg_support
from compile_runtime.compiler.decorator import attention_split
from compile_runtime.config import CompilationConfig, CUDAGraphMode, ResolvedModes
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.graphs.dispatcher import CudagraphDispatcher
from compile_runtime.graphs.wrapper import CUDAGraphWrapper, GraphFactory, wrap_full_model
from compile_runtime.platforms.select import platform_for

if TYPE_CHECKING:
    from compile_runtime.attention.layer import Attention
    from compile_runtime.models.interface import CausalLanguageModel


@dataclass(frozen=True)
class CudaGraphPlan:
    modes: ResolvedModes
    dispatcher: CudagraphDispatcher  # holds the keys and padding tables of ``modes``
    forward_model: Callable[..., Any]  # what FULL steps and captures call: FULL-wrapped or bare
    bare_model: Callable[..., Any]  # what the other steps call (the FULL wrapper would pass)
    # The FULL graphs of uniform decode batches without adapters, through to the logits of
    # every row (``LogitsForward``); None where the head stays outside the graphs.
    decode_model: CUDAGraphWrapper | None = None

    @property
    def cudagraph_mode(self) -> CUDAGraphMode:
        return self.modes.cudagraph_mode

    def forward_for(
        self, mode: CUDAGraphMode, descriptor: BatchDescriptor
    ) -> tuple[Callable[..., Any], bool]:
        """What a step of runtime ``mode`` at ``descriptor`` calls, and whether that gives
        logits (every row's) rather than hidden states."""
        if mode != CUDAGraphMode.FULL:
            return self.bare_model, False
        if self.decode_model is not None and descriptor.uniform and not descriptor.has_lora:
            return self.decode_model, True
        return self.forward_model, False

    def wrappers(self) -> list[CUDAGraphWrapper]:
        """The FULL graphs' wrappers (what ``release`` empties)."""
        models = (self.forward_model, self.decode_model)
        return [model for model in models if isinstance(model, CUDAGraphWrapper)]


class LogitsForward:
    """The model's forward on through its LM head: what a uniform decode batch's FULL graph
    holds (padding rows get logits too, never read)."""

    def __init__(self, model: CausalLanguageModel):
        self.model = model

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model.model(*args))


def logits_fit_in_graph(model: CausalLanguageModel, *, single_rank: bool) -> bool:
    """Whether the LM head can run inside the decode graphs: one rank in one stage (else the
    logits are gathered to a rank, or a stage hands hidden states on) and a head the model
    names."""
    return single_rank and getattr(model, "lm_head", None) is not None


def plan_cudagraphs(
    model: CausalLanguageModel,
    layers: Sequence[Attention],
    config: CompilationConfig,
    dispatcher: CudagraphDispatcher,
    *,
    uniform_decode_query_len: int,
    device: torch.device,
    graph_factory: GraphFactory | None = None,
    lora: bool = False,
    logits_in_graph: bool = False,
) -> CudaGraphPlan:
    """The plan for ``model`` once traced; ``dispatcher`` (its capture sizes resolved when it
    was built) gets the keys of the resolved mode. ``graph_factory``: CPU graphs on a CPU
    that replays them (``compile_runtime/cpu/graph.py``), None for CUDA graphs.
    ``logits_in_graph``: the decode graphs end in the logits (``logits_fit_in_graph``)."""
    modes = config.resolve(
        min_cg_support({layer.attn_backend for layer in layers}),
        attention_split=bool(attention_split(model)),  # None: nothing traced, nothing split
        uniform_decode_query_len=uniform_decode_query_len,
        cuda_available=platform_for(device).graph_kind == "cuda",
        cpu_graphs=platform_for(device).graph_kind == "cpu" and graph_factory is not None,
    )
    dispatcher.initialize_keys(modes.cudagraph_mode, uniform_decode_query_len, lora=lora)
    forward_model = bare_model = model.model
    decode_model = None
    if modes.cudagraph_mode.has_full_cudagraphs():
        forward_model = wrap_full_model(bare_model, config, graph_factory=graph_factory)
        if logits_in_graph and modes.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL:
            decode_model = wrap_full_model(
                LogitsForward(model), config, graph_factory=graph_factory
            )
    return CudaGraphPlan(modes, dispatcher, forward_model, bare_model, decode_model)
