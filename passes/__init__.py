"""FX graph passes and the pass manager (see manager.py for the pipeline).

``base`` (the pass interface) and ``matching`` (FX matching helpers); the passes, in
pipeline order: ``noop_elimination`` (views and casts that change nothing),
``rms_norm_fusion`` (RMSNorm, with or without residual add), ``activation_fusion``
(SiLU-and-multiply), ``rotary_fusion`` (Q and K rotated by one in-place op), ``cleanup``
(dead nodes left by fusions), ``fix_functionalization`` (``auto_functionalized`` back to
in-place calls); ``post_grad`` (the manager as Inductor's post-grad pass).
"""

from compile_runtime.passes.base import GraphPass, Phase, TokenRange
from compile_runtime.passes.manager import PassManager, PassRecord


def __getattr__(name: str):
    if name == "PostGradPass":  # importing it imports Inductor: on first use
        from compile_runtime.passes.post_grad import PostGradPass

        return PostGradPass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GraphPass", "PassManager", "PassRecord", "Phase", "PostGradPass", "TokenRange"]
