"""The batched LoRA op: the C kernel equals the torch reference (and PEFT's formula) per
token and adapter, skips tokens without one, and a no-LoRA step skips the op."""

from __future__ import annotations

import pytest
import torch

from compile_runtime.cpu import lora as cpu_lora
from compile_runtime.cpu.lora import lora_add_, lora_add_reference
from compile_runtime.forward_context import BatchDescriptor, set_forward_context

needs_kernel = pytest.mark.skipif(not cpu_lora._kernels(), reason="no C compiler here")


def _case(dtype, n=7, slots=3, rank=8, in_features=40, parts=(24, 8, 8)):
    g = torch.Generator().manual_seed(0)
    out = sum(parts)
    a = torch.randn(slots, len(parts), rank, in_features, generator=g).to(dtype)
    b = torch.randn(slots, rank, out, generator=g).to(dtype)  # B^T per slot
    ranks = torch.tensor([[8, 4, 0], [2, 2, 2], [8, 8, 8]], dtype=torch.int32)[:slots]
    for s in range(slots):  # zero past each rank, as the slots hold them
        for j in range(len(parts)):
            a[s, j, ranks[s, j] :] = 0
    sub_of = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(parts)).int()
    x = torch.randn(n, in_features, generator=g).to(dtype)
    y = torch.randn(n, out, generator=g).to(dtype)
    token_slots = torch.tensor([0, -1, 2, 1, 0, -1, 2, -1, -1], dtype=torch.int32)
    return y, x, token_slots, a, b, ranks, sub_of


def _peft_formula(y, x, token_slots, a, b, ranks, sub_of):
    """y + B_s A_s x per token, part by part, in float64."""
    want = y.double().clone()
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        for j in range(a.shape[1]):
            r = int(ranks[s, j])
            cols = (sub_of == j).nonzero().squeeze(1)
            h = a[s, j, :r].double() @ x[t].double()
            want[t, cols] += b[s, :r][:, cols].double().T @ h
    return want


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_the_reference_and_the_formula(dtype, tol):
    y, *args = _case(dtype)
    by_kernel, by_reference = y.clone(), y.clone()
    lora_add_(by_kernel, *args)
    lora_add_reference(by_reference, *args)
    want = _peft_formula(y, *args)
    scale = want.abs().max()
    assert (by_kernel.double() - want).abs().max() / scale < tol
    assert (by_reference.double() - want).abs().max() / scale < tol
    untouched = args[1][: y.shape[0]] < 0
    assert torch.equal(by_kernel[untouched], y[untouched])  # no adapter: not a bit changed


@needs_kernel
def test_rows_and_threads_at_prefill_size():
    y, x, _, a, b, ranks, sub_of = _case(torch.float32, n=300, rank=8)
    slots = torch.randint(
        -1, 3, (300,), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    by_kernel, by_reference = y.clone(), y.clone()
    lora_add_(by_kernel, x, slots, a, b, ranks, sub_of)
    lora_add_reference(by_reference, x, slots, a, b, ranks, sub_of)
    torch.testing.assert_close(by_kernel, by_reference, rtol=1e-5, atol=1e-5)


def test_a_step_without_adapters_skips_the_op():
    y, *args = _case(torch.float32)
    before = y.clone()
    with set_forward_context(None, batch_descriptor=BatchDescriptor(7, has_lora=False)):
        lora_add_(y, *args)
    assert torch.equal(y, before)
    with set_forward_context(None, batch_descriptor=BatchDescriptor(7, has_lora=True)):
        lora_add_(y, *args)
    assert not torch.equal(y, before)


def test_op_compiles_in_place():
    y, *args = _case(torch.float32)

    def f(x, y, token_slots, a, b, ranks, sub_of):
        y = y * 1.0
        lora_add_(y, x, token_slots[: x.shape[0]], a, b, ranks, sub_of)
        return y

    x = args[0]
    want = f(x, y, *args[1:])
    got = torch.compile(f, backend="inductor", fullgraph=True)(x, y, *args[1:])
    torch.testing.assert_close(got, want)
