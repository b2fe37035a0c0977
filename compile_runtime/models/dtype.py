"""Which dtype a model runs in: a name the user gives, or ``"auto"``.

``"auto"`` keeps the checkpoint's precision where the hardware runs it well:
a bf16/fp16 checkpoint runs in bf16 on a CPU with AVX512-BF16 or AMX (fp16
has no fast CPU path) and in float32 on one without; a float32 checkpoint
stays float32 (its greedy tokens are the reference). A quantized GGUF file
has no float dtype of its own: its weights carry less than bf16's precision,
so it runs in bf16 where bf16 is fast. On CUDA the checkpoint's 16-bit dtype
is kept and float32 checkpoints run in bf16, as other engines do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from compile_runtime.platforms.select import platform_for

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX tiles: oneDNN's bf16 GEMMs run at least at fp32's speed."""
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None)  # transformers 5 reads torch_dtype into it
    if isinstance(value, str):
        value = DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: Any, device: torch.device | str, *, quantized: bool
) -> torch.dtype:
    """The dtype to run in; ``quantized``: the weights come from a quantized GGUF file."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)}")
        return DTYPES[dtype]
    stored = checkpoint_dtype(hf_config)
    if platform_for(device).prefers_16bit:
        chosen = stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16
        why = f"the checkpoint's {stored}" if chosen is stored else "16-bit on a GPU"
    elif quantized or stored in (torch.float16, torch.bfloat16):
        fast = cpu_has_fast_bf16()
        chosen = torch.bfloat16 if fast else torch.float32
        what = "quantized weights" if quantized else f"a {stored} checkpoint"
        why = f"{what}, and this CPU {'has' if fast else 'lacks'} AVX512-BF16/AMX"
    else:
        chosen, why = torch.float32, "the checkpoint's float32 (or no dtype in config.json)"
    logger.info("dtype=auto: %s (%s)", chosen, why)
    return chosen
