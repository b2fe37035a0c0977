"""FX graph passes and the pass manager (see manager.py for the pipeline)."""

from compile_runtime.passes.base import GraphPass, Phase, TokenRange
from compile_runtime.passes.manager import PassManager, PassRecord, PostGradPass

__all__ = ["GraphPass", "PassManager", "PassRecord", "Phase", "PostGradPass", "TokenRange"]
