"""Scaffolding shared by tests and benchmarks, outside the installed package: small compiled
models (toy, transformer), tiny model directories on disk (model_dirs), and attention test
inputs (attention). pytest finds it through pyproject.toml's ``pythonpath``; benchmarks through
``benchmarks/repo_root.py``."""
