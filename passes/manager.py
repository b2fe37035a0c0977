"""The pass manager: which graph passes run, where, in what order, and under which identity.

Two places run passes:

* ``manager(gm)`` runs the pre-split passes once on the whole Dynamo graph,
  before it is split at the attention ops (passes that need the whole graph);
* ``post_grad.PostGradPass(manager, runtime_shape)`` is the ``CustomGraphPass`` that the
  Inductor adaptor installs as ``post_grad_custom_post_pass``: Inductor calls it
  on the ATen-level, functionalized graph of every piece it compiles.

The pipeline, in order: no-op elimination, RMSNorm fusion, SiLU-mul fusion,
rotary fusion, post-cleanup, fix-functionalization (last: it brings back
in-place calls, which later rewrites must not see). Each has a ``PassConfig``
flag; a fusion flag of None means "on for CUDA graphs only" (resolved per
graph from the device of its inputs), and ``enable_fusion=False`` turns every
fusion off.

``uuid()`` hashes the ``PassConfig`` and every pass's own ``uuid()`` (its source
and options), so changing a flag or editing a pass changes the key of every
compiled artifact. ``debug_dump_path`` does not change compiled code and is not
part of it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.fx
from compile_runtime.passes.activation_fusion import SiluMulFusionPass
from compile_runtime.passes.base import GraphPass, Phase
from compile_runtime.passes.cleanup import PostCleanupPass
from compile_runtime.passes.fix_functionalization import FixFunctionalizationPass
from compile_runtime.passes.matching import tensor_val
from compile_runtime.passes.noop_elimination import NoOpEliminationPass
from compile_runtime.passes.rms_norm_fusion import RMSNormFusionPass
from compile_runtime.passes.rotary_fusion import RotaryFusionPass

from compile_runtime.config import PassConfig

logger = logging.getLogger(__name__)

# (PassConfig flag, pass class, is a fusion), in pipeline order.
PIPELINE: list[tuple[str, type[GraphPass], bool]] = [
    ("enable_noop_elimination", NoOpEliminationPass, False),
    ("enable_rms_norm_fusion", RMSNormFusionPass, True),
    ("enable_silu_mul_fusion", SiluMulFusionPass, True),
    ("enable_rotary_fusion", RotaryFusionPass, True),
    ("enable_post_cleanup", PostCleanupPass, False),
    ("enable_fix_functionalization", FixFunctionalizationPass, False),
]
AUTO_DEVICE_TYPES = frozenset({"cuda"})


@dataclass
class PassRecord:
    """One pass run on one graph."""

    graph: str  # e.g. "003_post_grad_general" or "004_post_grad_size16"
    pass_name: str
    phase: Phase
    runtime_shape: int | None
    device_type: str
    matches: int
    details: dict[str, int] = field(default_factory=dict)


def graph_device_type(graph: torch.fx.Graph) -> str:
    """The device type of the graph's first tensor input ("cpu" when there is none)."""
    for node in graph.find_nodes(op="placeholder"):
        t = tensor_val(node)
        if t is not None:
            return t.device.type
    return "cpu"


class PassManager:
    def __init__(
        self,
        pass_config: PassConfig | None = None,
        *,
        debug_dump_path: str | None = None,
    ):
        self.pass_config = pass_config or PassConfig()
        self.debug_dump_path = debug_dump_path
        # (pass, setting): True = always, None = auto (CUDA only).
        self.passes: list[tuple[GraphPass, bool | None]] = []
        for flag, cls, is_fusion in PIPELINE:
            setting = getattr(self.pass_config, flag)
            if is_fusion and not self.pass_config.enable_fusion:
                setting = False
            if setting is not False:
                self.passes.append((cls(), setting))
        self.records: list[PassRecord] = []
        self._graph_ids = itertools.count()

    def add_pass(self, graph_pass: GraphPass, *, before: str | None = "post_cleanup") -> None:
        """Add a pass (always on) before the named one (or at the end); it joins ``uuid()``."""
        names = [p.name for p, _ in self.passes]
        index = names.index(before) if before in names else len(self.passes)
        self.passes.insert(index, (graph_pass, True))

    def active_passes(
        self, phase: Phase, runtime_shape: int | None, device_type: str
    ) -> list[GraphPass]:
        return [
            p
            for p, setting in self.passes
            if phase in p.phases
            and p.applies_to(runtime_shape)
            and (setting is True or device_type in AUTO_DEVICE_TYPES)
        ]

    # ---- running ------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Run the pre-split passes on the whole Dynamo graph."""
        if self.run(gm.graph, Phase.PRE_SPLIT):
            gm.recompile()
        return gm

    def run(
        self, graph: torch.fx.Graph, phase: Phase, runtime_shape: int | None = None
    ) -> dict[str, int]:
        """Run the passes of ``phase`` that apply to ``graph``; returns matches per pass."""
        device_type = graph_device_type(graph)
        passes = self.active_passes(phase, runtime_shape, device_type)
        if not passes:
            return {}
        size = "general" if runtime_shape is None else f"size{runtime_shape}"
        tag = f"{next(self._graph_ids):03d}_{phase.value}_{size}"
        counts: dict[str, int] = {}
        for i, graph_pass in enumerate(passes):
            self._dump(graph, tag, f"{i:02d}_{graph_pass.name}.before.py")
            matches = graph_pass.run(graph)
            graph.lint()
            self._dump(graph, tag, f"{i:02d}_{graph_pass.name}.after.py")
            counts[graph_pass.name] = matches
            details = dict(getattr(graph_pass, "last_counts", {}) or {})
            self.records.append(
                PassRecord(
                    tag, graph_pass.name, phase, runtime_shape, device_type, matches, details
                )
            )
            logger.debug("pass %s on graph %s replaced %d match(es)", graph_pass.name, tag, matches)
        logger.info(
            "graph passes on %s (%s): %s",
            tag,
            device_type,
            ", ".join(f"{name} {n}" for name, n in counts.items()),
        )
        return counts

    # ---- identity -------------------------------------------------------------

    def uuid(self) -> str:
        blob = json.dumps(
            {
                "config": self.pass_config.model_dump(mode="json"),
                "passes": [[p.name, p.uuid(), setting] for p, setting in self.passes],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- debugging ---------------------------------------------------------------

    def _dump(self, graph: torch.fx.Graph, tag: str, name: str) -> None:
        if not self.debug_dump_path:
            return
        folder = os.path.join(self.debug_dump_path, "passes", tag)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.write(readable_graph(graph))

    def matches(self, pass_name: str, phase: Phase = Phase.POST_GRAD) -> list[int]:
        """Matches of ``pass_name`` on each graph it ran on so far (for tests and benchmarks)."""
        return [r.matches for r in self.records if r.pass_name == pass_name and r.phase == phase]


def readable_graph(graph: torch.fx.Graph) -> str:
    """The graph as readable Python, with shapes, strides and devices of every value."""
    owner = graph.owning_module
    if isinstance(owner, torch.fx.GraphModule) and owner.graph is graph:
        return owner.print_readable(
            print_output=False, include_stride=True, include_device=True, colored=False
        )
    return graph.python_code("self").src
