"""Scaffolding shared by tests and benchmarks, outside the installed package: small compiled
models (``toy``, ``transformer``), tiny model directories on disk (``model_dirs``), and
attention test inputs (``attention``). tests/conftest.py puts the repository root on the path
(of pytest and of the processes tests start); benchmarks ``import repo_root`` first
(benchmarks/repo_root.py)."""
