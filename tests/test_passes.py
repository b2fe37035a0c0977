"""Graph passes on small graphs: matches counted, originals gone, numerics kept, near misses left.

Each graph is the real post-grad graph Inductor would hand our pass: the
function is compiled with a post-grad custom pass that grabs the graph and
stops the compile (no code generation), with the token dimension dynamic as
in the runtime. The pass runs on it, and the rewritten graph runs eagerly
(the fused ops' CPU implementations) against the original function.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from compile_runtime.passes import PassManager, Phase, TokenRange
from compile_runtime.passes.activation_fusion import SiluMulFusionPass
from compile_runtime.passes.base import GraphPass
from compile_runtime.passes.cleanup import PostCleanupPass
from compile_runtime.passes.fix_functionalization import FixFunctionalizationPass
from compile_runtime.passes.noop_elimination import NoOpEliminationPass
from compile_runtime.passes.post_grad import PostGradPass
from compile_runtime.passes.rms_norm_fusion import RMSNormFusionPass
from compile_runtime.passes.rotary_fusion import RotaryFusionPass
from torch._higher_order_ops.auto_functionalize import (
    auto_functionalized,
    auto_functionalized_v2,
)
from torch._inductor.custom_graph_pass import CustomGraphPass

import compile_runtime as cr
import compile_runtime.ops  # noqa: F401 - registers the ops

aten = torch.ops.aten
ops = torch.ops.compile_runtime
EPS = 1e-6
N = 12  # tokens


# ---- capturing post-grad graphs -------------------------------------------------


class _Captured(Exception):
    pass


class _Capture(CustomGraphPass):
    def __init__(self):
        self.gm: torch.fx.GraphModule | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.gm = graph.owning_module
        raise _Captured

    def uuid(self):
        return None


def post_grad(fn, *args, dynamic: tuple[int, ...] | None = None) -> torch.fx.GraphModule:
    """The post-grad graph of ``fn(*args)``; dim 0 of args in ``dynamic`` (default: every
    tensor arg with N rows) is the symbolic token count. ``gm.input_sources`` says where
    each input comes from (``L['x']``, ``L['x'].size()[0]``), for ``run_graph``."""
    from torch._inductor.compile_fx import compile_fx

    capture = _Capture()
    sources: list[str] = []

    def backend(gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            sources.append(node.meta["grapharg"].source.name)
        with torch._inductor.config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False):
            return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for i, a in enumerate(args):
        is_token = (i in dynamic) if dynamic is not None else a.dim() >= 1 and a.shape[0] == N
        if isinstance(a, torch.Tensor) and is_token:
            torch._dynamo.mark_dynamic(a, 0)
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    except Exception:
        if capture.gm is None:
            raise
    assert capture.gm is not None
    capture.gm.input_sources = sources
    capture.gm.fn_params = list(inspect.signature(fn).parameters)
    return capture.gm


def run_graph(gm: torch.fx.GraphModule, args) -> list[torch.Tensor]:
    """Run a captured post-grad graph eagerly on real inputs."""
    local = dict(zip(gm.fn_params, args, strict=True))
    values = [eval(source, {"L": local}) for source in gm.input_sources]
    gm.recompile()
    out = gm(*values)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def count(gm: torch.fx.GraphModule, *targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def check_numerics(fn, gm, args, atol=1e-5, rtol=1e-5):
    expected = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    got = run_graph(gm, args)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)


def assert_left_alone(graph_pass: GraphPass, fn, *args) -> None:
    gm = post_grad(fn, *args)
    before = str(gm.graph)
    assert graph_pass.run(gm.graph) == 0
    assert str(gm.graph) == before


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


# ---- the model's own formulas (compile_runtime/models/llama.py) -------------------


def rms(x, w, eps=EPS):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(positions, x, cos_cache, sin_cache):
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---- no-op elimination ------------------------------------------------------------


def test_noop_elimination_removes_views_that_change_nothing():
    def fn(x, y):
        n = x.shape[0]
        a = (x * 2).expand(n, 32) + 1  # 1
        b = (x * 3).permute(0, 1) + 1  # 1
        c = (x * 4).squeeze(1) + 1  # 1 (dim 1 has 32 entries)
        d = (x * 5).as_strided((n, 32), (32, 1)) + 1  # 1
        e = (y * 2)[:, 4:28][:, 2:20][:, 1:]  # a slice chain: 2
        f = (x * 7).unsqueeze(1).squeeze(-2) + 1  # an unsqueeze undone: 2
        return a, b, c, d, e, f

    args = (rand(N, 32), rand(N, 32))
    gm = post_grad(fn, *args)
    assert NoOpEliminationPass().run(gm.graph) == 8
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.slice.Tensor) == 1
    assert set(targets) == {aten.mul.Tensor, aten.add.Tensor, aten.slice.Tensor}
    check_numerics(fn, gm, args)


def test_noop_elimination_leaves_real_views_alone():
    def fn(x):
        n = x.shape[0]
        a = x.view(n, 4, 8).transpose(1, 2).reshape(n, 32)  # a real permutation
        b = (x * 2)[:, 1:][:, ::2]  # a real slice, then a strided one
        c = (x * 3).unsqueeze(1)  # a real new dimension
        d = (x * 4).expand(2, n, 32)  # a real broadcast
        return a, b, c, d

    assert_left_alone(NoOpEliminationPass(), fn, rand(N, 32))


def test_noop_elimination_on_the_dynamo_graph():
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    def fn(x):
        y = x.float().to(torch.float32).view(x.shape[0], 32)  # three no-ops on f32
        return y.reshape(x.shape[0], 4, 8) * 2, x.view(x.shape)  # an output aliasing x stays

    x = rand(N, 32)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(fn, backend=grab, fullgraph=True)(x)
    ((gm, example_inputs),) = graphs
    assert NoOpEliminationPass().run(gm.graph) == 3
    gm.recompile()
    inputs = [N if isinstance(e, torch.SymInt) else x for e in example_inputs]
    for a, b in zip(gm(*inputs), fn(x), strict=True):
        torch.testing.assert_close(a, b)


# ---- RMSNorm -----------------------------------------------------------------------


def test_rms_norm_fusion_replaces_each_norm():
    def fn(x, w1, w2, w3):
        a = rms(x, w1)
        b = rms(a * 2, w2)
        c = rms(b + 1, w3)  # adding a scalar is not a residual add
        return a, b, c

    args = (rand(N, 64), rand(64), rand(64), rand(64))
    gm = post_grad(fn, *args)
    assert count(gm, aten.rsqrt.default) == 3
    graph_pass = RMSNormFusionPass()
    assert graph_pass.run(gm.graph) == 3
    assert graph_pass.last_counts == {"rms_norm": 3, "fused_add_rms_norm": 0}
    assert count(gm, ops.rms_norm.default) == 3
    assert count(gm, aten.rsqrt.default, aten.mean.dim, aten.pow.Tensor_Scalar) == 0
    check_numerics(fn, gm, args)


def test_residual_add_and_rms_norm_fuse():
    def fn(x, r, w1, w2, w3):
        h = x + r
        a = rms(h, w1)
        h = h + a * 3
        b = rms(h, w2)
        return a, b, h, rms(x, w3)  # h is also an output: the op's sum replaces it

    args = (rand(N, 64), rand(N, 64), rand(64), rand(64), rand(64))
    gm = post_grad(fn, *args)
    graph_pass = RMSNormFusionPass()
    assert graph_pass.run(gm.graph) == 3
    assert graph_pass.last_counts == {"rms_norm": 1, "fused_add_rms_norm": 2}
    assert count(gm, ops.fused_add_rms_norm.default) == 2
    assert count(gm, aten.add.Tensor, aten.rsqrt.default) == 0
    check_numerics(fn, gm, args)


def test_residual_add_folded_into_addmm_fuses():
    def fn(x, r, w, norm_w):
        h = r + x @ w  # Inductor folds the add into addmm on CPU
        return rms(h, norm_w), h

    args = (rand(N, 32), rand(N, 64), rand(32, 64), rand(64))
    gm = post_grad(fn, *args)
    assert count(gm, aten.addmm.default) == 1
    assert RMSNormFusionPass().run(gm.graph) == 1
    assert count(gm, ops.fused_add_rms_norm.default) == 1
    assert count(gm, aten.addmm.default) == 0 and count(gm, aten.mm.default) == 1
    check_numerics(fn, gm, args)


def test_rms_norm_fusion_in_bfloat16_keeps_the_model_rounding():
    def fn(x, r, w):
        h = x + r
        return rms(h, w), rms(x, w), h

    bf = torch.bfloat16
    args = (rand(N, 64, dtype=bf), rand(N, 64, dtype=bf), rand(64, dtype=bf))
    gm = post_grad(fn, *args)
    assert RMSNormFusionPass().run(gm.graph) == 2
    assert count(gm, torch.ops.prims.convert_element_type.default) == 0
    check_numerics(fn, gm, args, atol=1e-2, rtol=1e-2)


def eps_outside_rsqrt(x, w):
    x32 = x.float()
    return w * (x32 * (torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)) + EPS))


def mean_over_tokens(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + EPS))


def weight_per_token(x, w_col):
    return rms(x, w_col)  # w_col is [tokens, 1]: not a weight per hidden unit


def mean_of_cubes(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(3).mean(-1, keepdim=True) + EPS))


def eps_as_a_tensor(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def not_rounded_back(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS))  # stays float32


@pytest.mark.parametrize(
    "fn,args",
    [
        (eps_outside_rsqrt, (rand(N, 64), rand(64))),
        (mean_over_tokens, (rand(N, 64), rand(64))),
        (weight_per_token, (rand(N, 64), rand(N, 1))),
        (mean_of_cubes, (rand(N, 64), rand(64))),
        (eps_as_a_tensor, (rand(N, 64), rand(64), torch.tensor(1e-6))),
        (not_rounded_back, (rand(N, 64, dtype=torch.bfloat16), rand(64))),
    ],
    ids=["eps-outside", "mean-dim0", "weight-shape", "cubes", "eps-tensor", "no-round"],
)
def test_rms_norm_near_misses_are_left_alone(fn, args):
    assert_left_alone(RMSNormFusionPass(), fn, *args)


# ---- SiLU and multiply ----------------------------------------------------------------


def test_silu_mul_fusion_replaces_each_gate():
    d = 48

    def fn(t1, t2, t3):
        g, u = t1.split([d, d], dim=-1)
        a = F.silu(g) * u
        b = t2[..., d:] * F.silu(t2[..., :d])  # slices, product the other way round
        g3, u3 = t3.chunk(2, dim=-1)
        c = g3 * torch.sigmoid(g3) * u3  # silu spelled out
        return a, b, c

    args = (rand(N, 2 * d), rand(N, 2 * d), rand(N, 2 * d))
    gm = post_grad(fn, *args)
    assert SiluMulFusionPass().run(gm.graph) == 3
    assert count(gm, ops.silu_and_mul.default) == 3
    assert count(gm, aten.exp.default, aten.sigmoid.default, aten.silu.default) == 0
    assert count(gm, aten.mul.Tensor, aten.split_with_sizes.default, aten.slice.Tensor) == 0
    check_numerics(fn, gm, args)


def test_silu_mul_fusion_in_bfloat16():
    def fn(t):
        g, u = t.split([32, 32], dim=-1)
        return F.silu(g) * u

    args = (rand(N, 64, dtype=torch.bfloat16),)
    gm = post_grad(fn, *args)
    assert SiluMulFusionPass().run(gm.graph) == 1
    check_numerics(fn, gm, args, atol=1e-2, rtol=1e-2)


def silu_of_second_half(t):
    g, u = t.split([32, 32], dim=-1)
    return F.silu(u) * g


def thirds(t):
    a, b, _ = t.split([32, 32, 32], dim=-1)
    return F.silu(a) * b


def halves_of_two_tensors(t1, t2):
    return F.silu(t1[..., :32]) * t2[..., 32:]


def gate_times_itself(t):
    g = t[..., :32]
    return F.silu(g) * g


def activation_kept_in_float32(t):
    g, u = t.split([32, 32], dim=-1)
    return F.silu(g.float()) * u


@pytest.mark.parametrize(
    "fn,args",
    [
        (silu_of_second_half, (rand(N, 64),)),
        (thirds, (rand(N, 96),)),
        (halves_of_two_tensors, (rand(N, 64), rand(N, 64))),
        (gate_times_itself, (rand(N, 64),)),
        (activation_kept_in_float32, (rand(N, 64, dtype=torch.bfloat16),)),
    ],
    ids=["second-half", "thirds", "two-tensors", "gate-squared", "no-round"],
)
def test_silu_mul_near_misses_are_left_alone(fn, args):
    assert_left_alone(SiluMulFusionPass(), fn, *args)


# ---- rotary -------------------------------------------------------------------------------

H, KV, D = 4, 2, 16
QKV = (H + 2 * KV) * D


def rope_caches(dtype=torch.float32):
    freqs = torch.outer(torch.arange(64.0), 1.0 / (10000 ** (torch.arange(0, D, 2.0) / D)))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def attention_inputs(qkv, positions, cos, sin, dtype=None):
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    n = qkv.shape[0]
    q = rotate(positions, q.view(n, H, D), cos, sin).to(qkv.dtype).reshape(n, H * D)
    k = rotate(positions, k.view(n, KV, D), cos, sin).to(qkv.dtype).reshape(n, KV * D)
    return q, k, v


def two_layers(x, w1, w2, positions, cos, sin):
    q1, k1, v1 = attention_inputs(x @ w1, positions, cos, sin)
    q2, k2, v2 = attention_inputs(x @ w2, positions, cos, sin)
    return q1, k1, v1, q2, k2, v2


def rotary_args(dtype=torch.float32):
    cos, sin = rope_caches()
    positions = torch.randint(0, 64, (N,), generator=torch.Generator().manual_seed(1))
    return (
        rand(N, 32, dtype=dtype),
        rand(32, QKV, dtype=dtype),
        rand(32, QKV, dtype=dtype) / 2,
        positions,
        cos,
        sin,
    )


def test_rotary_fusion_pairs_q_and_k_and_fixes_functionalization():
    args = rotary_args()
    gm = post_grad(two_layers, *args)
    assert count(gm, aten.cat.default) == 4
    rotary = RotaryFusionPass()
    assert rotary.run(gm.graph) == 4
    assert rotary.last_counts == {"rotary_qk": 2, "rotary_single": 0}
    fused = [n for n in gm.graph.nodes if n.target is auto_functionalized]
    assert len(fused) == 2 and all(n.kwargs["key"] is not None for n in fused)
    assert count(gm, aten.cat.default, aten.sub.Tensor) == 0
    check_numerics(two_layers, gm, args)

    PostCleanupPass().run(gm.graph)
    assert count(gm, aten.index.Tensor) == 0  # the angle lookups went with the patterns
    assert FixFunctionalizationPass().run(gm.graph) == 2
    assert count(gm, auto_functionalized) == 0
    assert count(gm, ops.rotary_embedding_.default) == 2
    check_numerics(two_layers, gm, args)


def test_rotary_fusion_in_bfloat16_with_a_float32_cache():
    args = rotary_args(torch.bfloat16)
    gm = post_grad(two_layers, *args)
    assert RotaryFusionPass().run(gm.graph) == 4
    assert count(gm, torch.ops.prims.convert_element_type.default) == 0
    check_numerics(two_layers, gm, args, atol=1e-2, rtol=1e-2)


def test_unpaired_rotary_gets_the_op_alone():
    def fn(q, positions, cos, sin):
        return rotate(positions, q, cos, sin)

    cos, sin = rope_caches()
    args = (rand(N, H, D), torch.arange(N), cos, sin)
    gm = post_grad(fn, *args)
    rotary = RotaryFusionPass()
    assert rotary.run(gm.graph) == 1
    assert rotary.last_counts == {"rotary_qk": 0, "rotary_single": 1}
    # q is a graph input: mutating it in place would change the caller's tensor.
    assert FixFunctionalizationPass().run(gm.graph) == 0
    q_before = args[0].clone()
    check_numerics(fn, gm, args)
    assert torch.equal(args[0], q_before)


def sign_flipped(q, positions, cos_cache, sin_cache):
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    x1, x2 = q[..., : D // 2], q[..., D // 2 :]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def interleaved(q, positions, cos_cache, sin_cache):
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    x1, x2 = q[..., ::2], q[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def sin_at_other_positions(q, positions, cos_cache, sin_cache):
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions.flip(0)].unsqueeze(1)
    x1, x2 = q[..., : D // 2], q[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def partial_rotary(q, positions, cos_cache, sin_cache):
    rot, rest = q[..., : D // 2], q[..., D // 2 :]  # rotate half of each head only
    cos = cos_cache[positions, : D // 4].unsqueeze(1)
    sin = sin_cache[positions, : D // 4].unsqueeze(1)
    x1, x2 = rot[..., : D // 4], rot[..., D // 4 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def kept_in_float32(q, positions, cos_cache, sin_cache):
    return rotate(positions, q, cos_cache, sin_cache)  # bf16 q, f32 cache, no .to()


@pytest.mark.parametrize(
    "fn,dtype",
    [
        (sign_flipped, torch.float32),
        (interleaved, torch.float32),
        (sin_at_other_positions, torch.float32),
        (partial_rotary, torch.float32),
        (kept_in_float32, torch.bfloat16),
    ],
    ids=["sign", "interleaved", "positions", "partial", "no-round"],
)
def test_rotary_near_misses_are_left_alone(fn, dtype):
    cos, sin = rope_caches()
    assert_left_alone(RotaryFusionPass(), fn, rand(N, H, D, dtype=dtype), torch.arange(N), cos, sin)


# ---- fix functionalization -------------------------------------------------------------


def inplace_rotary(x, w, positions, cos, sin):
    qkv, n = x @ w, x.shape[0]
    q = qkv[:, : H * D].view(n, H, D)
    k = qkv[:, H * D : (H + KV) * D].view(n, KV, D)
    ops.rotary_embedding_(positions, q, k, cos, sin)
    return qkv * 1


def test_fix_functionalization_restores_an_inplace_op_of_the_model():
    args = rotary_args()[:2] + rotary_args()[3:]
    gm = post_grad(inplace_rotary, *args)
    assert count(gm, auto_functionalized_v2) == 1
    assert FixFunctionalizationPass().run(gm.graph) == 1
    assert count(gm, auto_functionalized_v2) == 0
    assert count(gm, ops.rotary_embedding_.default) == 1
    check_numerics(inplace_rotary, gm, args)


def read_q_after(x, w, positions, cos, sin):
    q, k, v = (x @ w).split([H * D, KV * D, KV * D], dim=-1)
    q = q.view(x.shape[0], H, D)
    return rotate(positions, q, cos, sin), q * 2  # q before rotation, read after the rotary


def read_qkv_after(x, w, positions, cos, sin):
    qkv = x @ w
    q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    q = q.view(x.shape[0], H, D)
    return rotate(positions, q, cos, sin), qkv * 2  # the whole buffer, read after the rotary


def read_v_after(x, w, positions, cos, sin):
    q, k, v = (x @ w).split([H * D, KV * D, KV * D], dim=-1)
    q = q.view(x.shape[0], H, D)
    return rotate(positions, q, cos, sin), v * 2  # another part of the split: no overlap


@pytest.mark.parametrize(
    "fn,fixed", [(read_q_after, 0), (read_qkv_after, 0), (read_v_after, 1)], ids=["q", "qkv", "v"]
)
def test_fix_functionalization_keeps_the_copy_when_the_old_value_is_read(fn, fixed):
    args = rotary_args()[:2] + rotary_args()[3:]
    gm = post_grad(fn, *args)
    assert RotaryFusionPass().run(gm.graph) == 1
    PostCleanupPass().run(gm.graph)
    # Move the reader after the op, where an in-place call would change what it reads.
    (af,) = [n for n in gm.graph.nodes if n.target is auto_functionalized]
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 2]
    af.append(mul)
    assert FixFunctionalizationPass().run(gm.graph) == fixed
    check_numerics(fn, gm, args)


# ---- post-cleanup ---------------------------------------------------------------------------


def test_post_cleanup_removes_dead_nodes_only():
    def fn(x):
        return x * 2

    gm = post_grad(fn, rand(N, 8))
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    with gm.graph.inserting_after(mul):
        dead = gm.graph.call_function(aten.add.Tensor, (mul, 1))
    with gm.graph.inserting_after(dead):
        gm.graph.call_function(aten.neg.default, (dead,))
    assert PostCleanupPass().run(gm.graph) == 2
    assert PostCleanupPass().run(gm.graph) == 0


# ---- the manager ---------------------------------------------------------------------------


def names(manager: PassManager, phase=Phase.POST_GRAD, shape=None, device="cpu"):
    return [p.name for p in manager.active_passes(phase, shape, device)]


def test_fusions_default_to_cuda_only():
    manager = PassManager(cr.PassConfig())
    assert names(manager) == ["noop_elimination", "post_cleanup", "fix_functionalization"]
    assert names(manager, device="cuda") == [
        "noop_elimination",
        "rms_norm_fusion",
        "silu_mul_fusion",
        "rotary_fusion",
        "post_cleanup",
        "fix_functionalization",
    ]
    assert names(manager, Phase.PRE_SPLIT) == ["noop_elimination"]
    forced = PassManager(cr.PassConfig(enable_rms_norm_fusion=True, enable_rotary_fusion=False))
    assert "rms_norm_fusion" in names(forced) and "rotary_fusion" not in names(
        forced, device="cuda"
    )
    off = PassManager(cr.PassConfig(enable_fusion=False, enable_rms_norm_fusion=True))
    assert "rms_norm_fusion" not in names(off, device="cuda")


def flag_variants():
    for name, field in cr.PassConfig.model_fields.items():
        default = field.default
        for value in (True, False, None):
            if value != default and (value is not None or "None" in str(field.annotation)):
                yield name, value


def test_every_flag_changes_the_cache_key():
    base_uuid = PassManager(cr.PassConfig()).uuid()
    base_hash = cr.CompilationConfig().compute_hash()
    assert PassManager(cr.PassConfig()).uuid() == base_uuid
    seen = set()
    for name, value in flag_variants():
        config = cr.PassConfig(**{name: value})
        uuid = PassManager(config).uuid()
        assert uuid != base_uuid, (name, value)
        assert uuid not in seen, (name, value)
        seen.add(uuid)
        assert cr.CompilationConfig(pass_config=config).compute_hash() != base_hash, (name, value)
    assert len(seen) >= 2 * 7 - 4  # every flag, both ways round where it has two
    # What is only for debugging does not change the key.
    assert PassManager(cr.PassConfig(), debug_dump_path="/tmp/x").uuid() == base_uuid


def test_uuid_follows_the_source_and_options_of_each_pass(tmp_path):
    source = (
        "from compile_runtime.passes.base import GraphPass\n"
        "class MyPass(GraphPass):\n"
        "    name = 'mine'\n"
        "    def run(self, graph):\n"
        "        return {}\n"
    )

    def load(body: str):
        path = tmp_path / "my_pass.py"
        path.write_text(source.format(body))
        spec = importlib.util.spec_from_file_location("my_pass", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["my_pass"] = module
        spec.loader.exec_module(module)
        manager = PassManager(cr.PassConfig())
        manager.add_pass(module.MyPass())
        return manager.uuid()

    try:
        assert load("0") == load("0")
        assert load("0") != load("1")
    finally:
        sys.modules.pop("my_pass", None)
    assert RMSNormFusionPass().uuid() != RMSNormFusionPass(fuse_residual_add=False).uuid()
    assert RMSNormFusionPass().uuid() != SiluMulFusionPass().uuid()


def test_token_ranges():
    assert TokenRange().contains(None) and TokenRange().contains(4096)
    small = TokenRange(1, 16)
    assert small.contains(16) and not small.contains(17) and not small.contains(None)
    with pytest.raises(ValueError, match="empty"):
        TokenRange(8, 4)

    class SmallBatchPass(NoOpEliminationPass):
        name = "small_batch"

    manager = PassManager(cr.PassConfig())
    manager.add_pass(SmallBatchPass(TokenRange(1, 16)))
    assert "small_batch" in names(manager, shape=8)
    assert "small_batch" not in names(manager, shape=32)
    assert "small_batch" not in names(manager, shape=None)  # the general graph serves all
    # Inductor's cache tells the compiles apart by what runs on them.
    assert PostGradPass(manager, 8).uuid() != PostGradPass(manager, None).uuid()
    assert PostGradPass(manager, 32).uuid() == PostGradPass(manager, None).uuid()


def test_debug_dump_writes_each_graph_before_and_after_each_pass(tmp_path, caplog):
    def fn(x, w):
        return rms(x, w)

    gm = post_grad(fn, rand(N, 64), rand(64))
    manager = PassManager(cr.PassConfig(enable_rms_norm_fusion=True), debug_dump_path=str(tmp_path))
    with caplog.at_level("INFO", logger="compile_runtime.passes.manager"):
        counts = manager.run(gm.graph, Phase.POST_GRAD)
    assert counts["rms_norm_fusion"] == 1
    assert "rms_norm_fusion 1" in caplog.text
    (folder,) = os.listdir(tmp_path / "passes")
    files = sorted(os.listdir(tmp_path / "passes" / folder))
    assert "01_rms_norm_fusion.before.py" in files and "01_rms_norm_fusion.after.py" in files
    before = (tmp_path / "passes" / folder / "01_rms_norm_fusion.before.py").read_text()
    after = (tmp_path / "passes" / folder / "01_rms_norm_fusion.after.py").read_text()
    assert "def forward" in before and "aten.rsqrt" in before
    assert "compile_runtime.rms_norm" in after and "aten.rsqrt" not in after
    assert manager.matches("rms_norm_fusion") == [1]


def test_inductor_adaptor_installs_the_post_grad_pass():
    from compile_runtime.backends.compiler.inductor import InductorAdaptor

    manager = PassManager(cr.PassConfig())
    adaptor = InductorAdaptor({"max_autotune": False}, pass_manager=manager)
    patches = adaptor.inductor_config(None)
    assert patches["max_autotune"] is False
    assert isinstance(patches["post_grad_custom_post_pass"], CustomGraphPass)
    assert patches["post_grad_custom_post_pass"].uuid() == PostGradPass(manager, None).uuid()

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "theirs"

    theirs = Theirs()
    adaptor = InductorAdaptor({"post_grad_custom_post_pass": theirs}, pass_manager=manager)
    ours, after = adaptor.inductor_config(4)["post_grad_custom_post_pass"]
    assert ours.runtime_shape == 4 and after is theirs
