"""The pass manager as Inductor's post-grad custom pass (apart: importing it imports Inductor)."""

from __future__ import annotations

import hashlib
import json

import torch.fx
from compile_runtime.passes.base import Phase
from compile_runtime.passes.manager import PassManager

from compile_runtime.torch_internals import inductor_custom_graph_pass


class PostGradPass(inductor_custom_graph_pass()):
    """Inductor's ``post_grad_custom_post_pass`` for one compile of one piece."""

    def __init__(self, manager: PassManager, runtime_shape: int | None):
        self.manager = manager
        self.runtime_shape = runtime_shape

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager.run(graph, Phase.POST_GRAD, self.runtime_shape)

    def uuid(self) -> str:
        applies = [p.name for p, _ in self.manager.passes if p.applies_to(self.runtime_shape)]
        blob = json.dumps([self.manager.uuid(), applies])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
