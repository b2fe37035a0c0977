"""The pass manager: runs the enabled graph passes over the whole graph before splitting.

The pipeline is empty until the passes issue adds passes; its ``uuid()`` is
already part of what identifies compiled code.
"""

from __future__ import annotations

import hashlib
import logging

import torch.fx

from compile_runtime.config import PassConfig

logger = logging.getLogger(__name__)


class PassManager:
    def __init__(self, pass_config: PassConfig):
        self.pass_config = pass_config
        self.passes: list = []

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for graph_pass in self.passes:
            graph_pass(gm)
        return gm

    def uuid(self) -> str:
        parts = [self.pass_config.model_dump_json()] + [p.uuid() for p in self.passes]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
