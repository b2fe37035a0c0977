"""The piece-by-piece verifier: which compiled piece made a model's output wrong.

``compare``: the comparison maths and the tolerances per dtype; ``report``: what a check
found and how it prints; ``verifier``: ``verify_model`` runs the split graph piece by piece,
compiled against eager; ``model_dir``: the same for a model directory; ``capture``: whether
the pieces would capture in CUDA graphs (``check --capture-safety``). The
``compile-runtime check`` command is in ``compile_runtime/cli/check.py``.
"""
