"""FX graph passes and the pass manager (see manager.py for the pipeline).

``base`` (the pass interface) and ``matching`` (FX matching helpers); the passes, in
pipeline order: ``noop_elimination`` (views and casts that change nothing),
``rms_norm_fusion`` (RMSNorm, with or without residual add), ``activation_fusion``
(SiLU-and-multiply), ``rotary_fusion`` (Q and K rotated by one in-place op), ``cleanup``
(dead nodes left by fusions), ``fix_functionalization`` (``auto_functionalized`` back to
in-place calls).
"""

from compile_runtime.passes.base import GraphPass, Phase, TokenRange
from compile_runtime.passes.manager import PassManager, PassRecord, PostGradPass

__all__ = ["GraphPass", "PassManager", "PassRecord", "Phase", "PostGradPass", "TokenRange"]
