"""``compile_runtime::lora_add_``: each token's own LoRA adapter added to a linear layer's
output, in place, in one call per layer (``lora/slots.py`` holds the tensors it reads).

On a CPU the body is the C kernel of ``csrc/lora.c`` (a recorded native call, so CPU graphs
replay it); elsewhere, or without a compiler, ``lora_add_reference`` (torch ops). A step
whose batch descriptor says it has no adapters (``BatchDescriptor.has_lora``) skips the op
altogether: its captured graphs hold no LoRA call, so the feature costs a no-LoRA step
nothing but the op's dispatch when no graph replays.
"""

from __future__ import annotations

import functools

import torch

from compile_runtime.cpu.native_function import NativeFunction
from compile_runtime.forward_context import get_forward_context, is_forward_context_available

OP_NAME = "compile_runtime::lora_add_"


@functools.cache
def _kernels() -> dict[torch.dtype, NativeFunction]:
    from compile_runtime.cpu.c_library import load_c_library

    lib = load_c_library("lora", "batched LoRA on a CPU")
    if lib is None:
        return {}
    return {torch.float32: lib.native("lora_add_f32"), torch.bfloat16: lib.native("lora_add_bf16")}


def step_has_lora() -> bool:
    """Whether this step's batch runs adapters (outside a runner's forward: assume it does)."""
    if not is_forward_context_available():
        return True
    descriptor = get_forward_context().batch_descriptor
    return descriptor is None or descriptor.has_lora


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    sub_of: torch.Tensor,
) -> None:
    """What the kernel computes, in torch ops (float32 accumulation, one rounding into y)."""
    slots = token_slots[: x.shape[0]].long()
    subs = sub_of.long()
    for s in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == s).nonzero().squeeze(1)
        for j in range(a.shape[1]):
            r = int(ranks[s, j])
            if r == 0:
                continue
            cols = (subs == j).nonzero().squeeze(1)
            h = x[rows].float() @ a[s, j, :r].float().T
            delta = h @ b[s, :r][:, cols].float()
            y[rows.unsqueeze(1), cols] = (y[rows.unsqueeze(1), cols].float() + delta).to(y.dtype)


def lora_add_impl(y, x, token_slots, a, b, ranks, sub_of) -> None:
    if not step_has_lora():
        return
    kernel = _kernels().get(x.dtype) if x.device.type == "cpu" else None
    if (
        kernel is None
        or y.dtype != x.dtype
        or a.dtype != x.dtype
        or x.stride(-1) != 1
        or y.stride(-1) != 1
        or not (a.is_contiguous() and b.is_contiguous() and ranks.is_contiguous())
    ):
        lora_add_reference(y, x, token_slots, a, b, ranks, sub_of)
        return
    slots, subs, max_rank, k = a.shape
    kernel(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0],
        token_slots.data_ptr(), a.data_ptr(), b.data_ptr(), ranks.data_ptr(),
        sub_of.data_ptr(), subs, max_rank, k, y.shape[1], torch.get_num_threads(),
    )  # fmt: skip


# A plain library registration (as cpu_linear's): a few microseconds per call.
_lib = torch.library.Library("compile_runtime", "FRAGMENT")
_lib.define(
    "lora_add_(Tensor(a!) y, Tensor x, Tensor token_slots, Tensor a, Tensor b, Tensor ranks, "
    "Tensor sub_of) -> ()"
)
_lib.impl("lora_add_", lora_add_impl, "CPU")
_lib.impl("lora_add_", lora_add_impl, "CUDA")


@torch.library.register_fake(OP_NAME)
def _lora_add_fake(y, x, token_slots, a, b, ranks, sub_of) -> None:
    return None


def lora_add_(y, x, token_slots, a, b, ranks, sub_of) -> None:
    torch.ops.compile_runtime.lora_add_(y, x, token_slots, a, b, ranks, sub_of)
