"""On CUDA: the fused ops' Triton kernels behind torch.ops, and the passes' defaults (fusions on)."""

from __future__ import annotations

import pytest
import torch
from test_passes_model import ALL_OFF, GREEDY, PROMPTS, RUNNER, post_grad_counts

import compile_runtime.ops  # noqa: F401 - registers the ops
from compile_runtime.engine.llm import LLM
from compile_runtime.ops.fused import _rms_norm_torch, _rotary_torch, _silu_and_mul_torch

pytestmark = pytest.mark.cuda
ops = torch.ops.compile_runtime


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_dispatch_to_the_kernels_and_match_the_cpu_code(dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(33, 256, generator=g).to(dtype), torch.randn(33, 256, generator=g).to(dtype)
    w = torch.randn(256, generator=g).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm(x.cuda(), w.cuda(), 1e-6).cpu(), _rms_norm_torch(x, w, 1e-6), **tol
    )
    out, summed = ops.fused_add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    torch.testing.assert_close(summed.cpu(), x + r, **tol)
    torch.testing.assert_close(out.cpu(), _rms_norm_torch(x + r, w, 1e-6), **tol)
    torch.testing.assert_close(ops.silu_and_mul(x.cuda()).cpu(), _silu_and_mul_torch(x), **tol)

    qkv = torch.randn(33, 8 * 32, generator=g).to(dtype)
    cos, sin = torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)
    positions = torch.randint(0, 64, (33,), generator=g)
    expected = qkv.clone()
    _rotary_torch(
        positions, expected[:, :128].view(33, 4, 32), expected[:, 128:192].view(33, 2, 32), cos, sin
    )
    got = qkv.cuda()
    ops.rotary_embedding_(
        positions.cuda(),
        got[:, :128].view(33, 4, 32),
        got[:, 128:192].view(33, 2, 32),
        cos.cuda(),
        sin.cuda(),
    )
    torch.testing.assert_close(got.cpu(), expected, **tol)


def test_default_passes_fuse_on_cuda_and_keep_greedy_tokens(model_dirs):
    model_dir = model_dirs("llama")
    common = dict(disable_cache=True, cudagraph_mode="NONE")
    # float32: "auto" would run this float32 checkpoint in bf16 on a GPU, where the tiny model's
    # near-ties fall either way between two correct roundings (seen on the first H200 run).
    engine = dict(device="cuda", dtype="float32", **RUNNER)
    reference = LLM(model_dir, {"pass_config": ALL_OFF, **common}, **engine)
    ref_tokens = [
        o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    llm = LLM(
        model_dir,
        {"inductor_compile_config": {"fx_graph_cache": False}, **common},
        **engine,
    )
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == ref_tokens
    first, middle, last = post_grad_counts(llm)
    assert middle["fused_add_rms_norm"] == 2 and middle["silu_and_mul"] == 1
    assert middle["rotary_qk"] == 1 and middle["fix_functionalization"] == 1
