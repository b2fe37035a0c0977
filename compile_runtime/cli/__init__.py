"""The command-line front ends: the one layer that parses flags and prints for a terminal.

Nothing below this package imports it. ``main`` (the ``compile-runtime`` command:
``config show`` and ``generate``, and the registry of sub-commands), ``serve`` (the
OpenAI-compatible server's flags), ``engine_flags`` (the engine flags ``generate`` and
``serve`` share, and the ``LLM`` they build), ``argtypes`` (argparse value checks that
name the flag and the fix), ``cache`` (``cache list|show|explain|clear|prune|export|
import|verify``), ``plan_sizes`` (``plan-sizes``: capture sizes from a recorded workload),
``check`` (``check``: a model directory and its capture safety), ``tune`` (``tune``: the
CPU linear kernels' tuning table), ``__main__`` (``python -m compile_runtime.cli``).
"""
