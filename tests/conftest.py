from __future__ import annotations

import pytest
import torch

from compile_runtime.tiny_models import make_model_dir


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny model directories (config, random weights, tokenizer), built once per session."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, str] = {}

    def get(arch: str, **overrides) -> str:
        key = arch + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
        if key not in cache:
            cache[key] = make_model_dir(str(root / key), arch=arch, **overrides)
        return cache[key]

    return get
