"""``check_model_dir``: load a model directory, build one batch, verify it (``compile-runtime
check``).
"""

from __future__ import annotations

import os

import torch

from compile_runtime.config import CompilationConfig, parse_config
from compile_runtime.device import resolve_device
from compile_runtime.models.registry import load_model
from compile_runtime.platforms.select import platform_for
from compile_runtime.verify.report import VerifyReport
from compile_runtime.verify.verifier import verify_model


def require_model_dir(model_dir: str) -> None:
    """FileNotFoundError naming the fix unless ``model_dir`` holds a ``config.json``."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(
            f"{model_dir!r} is not a model directory (no config.json); pass a directory with "
            "config.json and safetensors weights"
        )


def check_model_dir(
    model_dir: str,
    config: CompilationConfig | dict | str | None = None,
    *,
    num_tokens: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    check_graphs: bool | None = None,
    use_transformers: bool = False,
) -> VerifyReport:
    """Load ``model_dir`` under ``config`` and verify it on ``num_tokens`` random tokens."""
    config = parse_config(config)
    require_model_dir(model_dir)
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    device = resolve_device(device)
    if (why := platform_for(device).missing_device(device)) is not None:
        raise ValueError(f"device {str(device)!r} was asked for, but {why}")
    model = load_model(
        model_dir, config, dtype=dtype, device=device, use_transformers=use_transformers
    )
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 100)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    return verify_model(
        model.model, input_ids, positions, atol=atol, rtol=rtol, check_graphs=check_graphs
    )
