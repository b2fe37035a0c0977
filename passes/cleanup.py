"""Post-cleanup: remove the nodes that replacements left without users.

Fusions erase what they matched, but inputs they shared with other nodes (the
angle lookups of a rotary, a convert feeding two patterns) can become dead
only once every pattern is gone. Dead-code elimination keeps every node with
side effects (in-place ops, ops with mutable schemas).
"""

from __future__ import annotations

import torch.fx
from compile_runtime.passes.base import GraphPass


class PostCleanupPass(GraphPass):
    name = "post_cleanup"

    def run(self, graph: torch.fx.Graph) -> int:
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
