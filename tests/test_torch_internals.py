"""The fence around PyTorch's private APIs (compile_runtime/torch_internals.py).

Each item the fence holds has a contract test here that fails, naming the item, when a
torch release moves or changes what we rely on (the attribute, its parameters, a
classmethod we patch still being one, what it returns). Another test keeps every private
name inside the fence, and one the supported torch range in step with pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compile_runtime import torch_internals as ti

REPO = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("compile_runtime", "backends", "passes")
FENCE = REPO / "compile_runtime" / "torch_internals.py"
aten = torch.ops.aten

# ---- the version gate ------------------------------------------------------------------


def test_pyproject_requires_the_range_the_gate_enforces():
    text = (REPO / "pyproject.toml").read_text()
    found = re.findall(r'^\s*"torch([<>=!~,.\d ]*)",', text, re.M)
    assert found == [ti.TORCH_REQUIREMENT], (
        f"pyproject.toml requires torch{found}, the gate torch{ti.TORCH_REQUIREMENT}: "
        "change both (compile_runtime/torch_internals.py: TORCH_REQUIREMENT)"
    )
    assert ti.torch_release(ti.TESTED_TORCH) is not None
    ti.check_torch_version(ti.TESTED_TORCH)  # the version the error message recommends


def test_the_installed_torch_is_supported():
    ti.check_torch_version()


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu128", "2.12.1", "2.13.0+cpu"])
def test_the_gate_lets_supported_versions_through(version):
    ti.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.14.0", "2.14.0.dev20260101", "3.0.0", "x"])
def test_the_gate_names_the_version_the_range_and_the_fix(version):
    with pytest.raises(RuntimeError) as info:
        ti.check_torch_version(version)
    message = str(info.value)
    assert f"torch {version}" in message
    assert "torch>=2.11,<2.14" in message
    assert "pip install torch==2.13.0" in message


def test_the_engine_and_the_compiler_check_the_version_first(monkeypatch):
    from compile_runtime.compiler.compiled_forward import CompiledForward
    from compile_runtime.config import CompilationConfig
    from compile_runtime.engine.engine_config import decide_engine_config

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    ti._check_installed.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="pip install torch==2.13.0"):
            decide_engine_config("no-such-model-directory", None, "auto", {})
        with pytest.raises(RuntimeError, match="torch 2.10.0"):
            CompiledForward(torch.nn.Linear(2, 2), CompilationConfig(), {})
    finally:
        ti._check_installed.cache_clear()  # checked again, against the real version


def test_importing_the_package_loads_no_inductor_dynamo_or_sympy():
    code = (
        "import sys, compile_runtime, compile_runtime.torch_internals\n"
        "heavy = ('torch._inductor', 'torch._dynamo', 'sympy')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sympy' or "
        "any(m == h or m.startswith(h + '.') for h in heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- nothing outside the fence touches a private name ------------------------------------

# Dotted names (imports, attribute chains, module paths in strings) that are torch's own.
PRIVATE = re.compile(
    r"^torch\.(_(?!_)|utils\._|fx\.experimental\b|ops\.(\w+\.)?_(?!_)|nn\.[\w.]*\._(?!_))"
)
# Private attributes of torch objects (an op's schema and names, a tensor's version).
PRIVATE_ATTRIBUTES = {
    "_schema", "_opname", "_overloadname", "_qualified_op_name", "_version", "_cdata",
    "_construct_storage_from_data_pointer", "_load_library", "_probe_load",
}  # fmt: skip
# (file, what) pairs that stay, each with its reason. Empty: nothing needed one so far.
ALLOWED: dict[tuple[str, str], str] = {}


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[str]:
    """Every private torch name ``source`` uses in code (docstrings and messages may
    mention them: a string counts only when it is a dotted private name as a whole)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f".{node.attr}")
            names = [dotted(node) or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[\w.]+", node.value):
                names = [node.value]
        elif isinstance(node, ast.Call) and dotted(node.func) in ("getattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                if node.args[1].value in PRIVATE_ATTRIBUTES:
                    found.append(f".{node.args[1].value}")
        found += [n for n in names if PRIVATE.match(n)]
    return found


def test_the_scan_finds_each_kind_of_private_use():
    source = """
import torch._dynamo
from torch._inductor.codecache import CppCodeCache
from torch.utils._pytree import tree_flatten
import torch.fx.experimental._config as fx_config
x = torch._C._construct_storage_from_data_pointer
y = torch.ops.mkldnn._linear_pointwise
z = torch.ops._c10d_functional.all_reduce
name = op._schema.name
w = getattr(target, "_overloadname", None)
PRELOAD = ("torch._inductor.compile_fx",)
'''``torch._inductor`` in a docstring is no use'''
message = "a torch._check(...) in a message is none either"
ok = torch.ops.aten.mm.default, torch.fx.Node, torch.compiler.set_stance, torch.__version__
"""
    uses = private_uses(source)
    for expected in [
        "torch._dynamo", "torch._inductor.codecache", "torch.utils._pytree",
        "torch.fx.experimental._config", "torch._C._construct_storage_from_data_pointer",
        "torch.ops.mkldnn._linear_pointwise", "torch.ops._c10d_functional.all_reduce",
        "._schema", "._overloadname", "torch._inductor.compile_fx",
    ]:  # fmt: skip
        assert expected in uses
    assert not [u for u in uses if "aten" in u or "fx.Node" in u or "compiler" in u or "__" in u]
    assert not [u for u in uses if "docstring" in u or "_check" in u]


def test_no_file_outside_the_fence_uses_a_private_torch_name():
    offenders = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == FENCE:
                continue
            rel = str(path.relative_to(REPO))
            uses = [u for u in private_uses(path.read_text()) if (rel, u) not in ALLOWED]
            if uses:
                offenders[rel] = sorted(set(uses))
    assert not offenders, (
        f"private torch names outside compile_runtime/torch_internals.py: {offenders}; "
        "add a named function there (with its contract test here) and call it"
    )


def test_every_allowed_exception_is_still_needed_and_says_why():
    for (rel, use), why in ALLOWED.items():
        assert why.strip(), f"{rel}: {use} is allowed without a reason"
        assert use in private_uses((REPO / rel).read_text()), f"{rel} no longer uses {use}"


def test_the_fence_exports_what_it_defines():
    assert sorted(ti.__all__) == sorted(set(ti.__all__))
    for name in ti.__all__:
        assert hasattr(ti, name), name


def test_every_fenced_item_has_a_contract_test():
    text = Path(__file__).read_text()
    missing = [name for name in ti.__all__ if f"ti.{name}" not in text]
    assert not missing, f"write a contract test for {missing}"


# ---- ops, tensors, storages --------------------------------------------------------------


def test_op_types_names_and_schema():
    add = aten.add.Tensor
    assert isinstance(add, ti.OpOverload) and isinstance(aten.add, ti.OpOverloadPacket)
    assert ti.is_torch_op(add) and ti.is_torch_op(aten.add) and not ti.is_torch_op(torch.add)
    assert ti.op_qualified_name(add) == "aten::add" == ti.op_qualified_name(aten.add)
    assert ti.op_qualified_name(torch.add) is None
    assert ti.op_bare_name(add) == "add" == ti.op_bare_name(aten.add)
    assert ti.op_bare_name(torch.add) is None
    assert ti.op_overload_name(add) == "Tensor" and ti.op_overload_name(aten.add) is None
    schema = ti.op_schema(aten.add_.Tensor)
    assert schema.name == "aten::add_"
    written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert written == ["self"] and len(schema.returns) == 1


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    before = ti.tensor_version(t)
    t.add_(1)
    assert ti.tensor_version(t) == before + 1


def test_storage_over_aliases_memory_it_does_not_own():
    t = torch.arange(4.0)
    storage = t.untyped_storage()
    alias = ti.storage_over(storage.data_ptr(), t.device, storage.nbytes())
    view = torch.empty(0).set_(alias, 0, (4,), (1,))
    t.add_(1)
    assert torch.equal(view, t)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
def test_mkldnn_linear_ops():
    assert isinstance(ti.mkldnn_bf16_supported(), bool)
    weight, bias, x = torch.randn(16, 32), torch.randn(16), torch.randn(5, 32)
    packed = ti.mkldnn_reorder_linear_weight(weight, 32)
    torch.testing.assert_close(ti.mkldnn_linear(x, packed, bias), F.linear(x, weight, bias))
    torch.testing.assert_close(ti.mkldnn_linear(x, packed, None), F.linear(x, weight))


def test_functional_collectives_take_what_we_pass():
    assert list(inspect.signature(ti.functional_all_reduce).parameters) == ["x", "op", "group_name"]
    ops = torch.ops._c10d_functional
    reduce_args = [a.name for a in ti.op_schema(ops.all_reduce.default).arguments]
    assert reduce_args == ["input", "reduce_op", "group_name"]
    assert [a.name for a in ti.op_schema(ops.wait_tensor.default).arguments] == ["tensor"]


def test_dispatch_modes_see_ops_until_disabled():
    class Seen(ti.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(ti.op_schema(func).name)
            return func(*args, **(kwargs or {}))

    mode = Seen()
    with mode:
        torch.ones(2).add(1)
        with ti.disable_dispatch_modes():
            torch.ones(2).mul(3)
    assert "aten::add" in mode.ops and "aten::mul" not in mode.ops


def test_pytree():
    a, b = torch.ones(1), torch.zeros(1)
    tree = {"a": (a, 2), "b": [b]}
    leaves, _ = ti.tree_flatten(tree)
    assert leaves[0] is a and leaves[1] == 2 and leaves[2] is b
    assert [id(x) for x in ti.tree_leaves(tree)] == [id(x) for x in leaves]
    mapped = ti.tree_map_only(torch.Tensor, lambda t: t + 1, tree)
    assert mapped["a"][1] == 2 and mapped["a"][0].item() == 2 and mapped["b"][0].item() == 1


def test_auto_functionalized_are_the_higher_order_ops():
    from torch._ops import HigherOrderOperator

    assert isinstance(ti.auto_functionalized, HigherOrderOperator)
    assert ti.auto_functionalized.name() == "auto_functionalized"
    assert ti.auto_functionalized_v2.name() == "auto_functionalized_v2"


# ---- fake tensors, shapes, Dynamo ----------------------------------------------------------


def test_fake_modes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    fake = mode.from_tensor(torch.ones(2))
    assert ti.detect_fake_mode([fake]) is mode
    assert ti.detect_fake_mode([torch.ones(2)]) is None
    with mode:
        assert isinstance(torch.ones(2), FakeTensor)
        with ti.unset_fake_temporarily():
            assert not isinstance(torch.ones(2), FakeTensor)
    assert ti.traced_code() == []  # outside a trace


def test_symbolic_shape_helpers():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    unbacked = ShapeEnv().create_unbacked_symint()
    assert len(ti.free_unbacked_symbols(unbacked)) == 1
    assert ti.free_unbacked_symbols(3) == set()
    assert ti.statically_known_true(unbacked == unbacked)
    assert not ti.statically_known_true(unbacked == 3)
    assert ti.statically_known_true(2 == 2)


def test_backed_size_oblivious_is_a_patchable_fx_option():
    import torch.fx.experimental._config as fx_config

    before = fx_config.backed_size_oblivious
    with ti.backed_size_oblivious():
        assert fx_config.backed_size_oblivious is True
    assert fx_config.backed_size_oblivious == before


def test_dynamo_trace_hooks_marks_and_sources():
    import torch._dynamo

    assert list(inspect.signature(torch._dynamo.mark_dynamic).parameters)[:2] == ["t", "index"]
    seen = {}

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        seen["sources"] = [ti.dynamo_input_source(n) for n in placeholders]
        seen["files"] = {code.co_filename for code in ti.traced_code()}
        seen["fake"] = ti.detect_fake_mode(example_inputs)
        return gm.forward

    def forward(x):
        return x * 2

    hooked = []
    handle = ti.dynamo_register_bytecode_hook(lambda code, new: hooked.append((code, new)))
    x = torch.randn(4, 3)
    ti.dynamo_mark_dynamic(x, 0)
    try:
        with ti.backed_size_oblivious():
            out = torch.compile(forward, backend=backend, fullgraph=True, dynamic=False)(x)
    finally:
        handle.remove()
    torch.testing.assert_close(out, x * 2)
    new_code = [new for code, new in hooked if code is forward.__code__]
    assert len(new_code) == 1 and isinstance(new_code[0], types.CodeType)
    assert "L['x']" in seen["sources"] and all(s.startswith("L['x']") for s in seen["sources"])
    assert __file__ in seen["files"]
    assert seen["fake"] is not None


def test_dynamo_errors():
    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(ti.dynamo_unsupported()):
        torch.compile(breaks, backend="eager", fullgraph=True)(torch.ones(2))

    def failing(gm, example_inputs):
        raise ValueError("ours")

    with pytest.raises(ti.dynamo_backend_failed()) as info:
        torch.compile(lambda x: x - 1, backend=failing, fullgraph=True)(torch.ones(2))
    assert isinstance(info.value.inner_exception, ValueError)
    assert "inner_exception" in inspect.signature(ti.dynamo_backend_failed().__init__).parameters
    errors = ti.trace_errors()
    assert len(errors) == 4 and all(issubclass(e, Exception) for e in errors)
    assert ti.dynamo_unsupported() in errors


# ---- Inductor ------------------------------------------------------------------------------


def test_inductor_names_we_use():
    for name in ti.INDUCTOR_PRELOAD:
        assert importlib.util.find_spec(name) is not None, name
    options = ti.inductor_options()
    for key in ("cpp.dynamic_threads", "cpp.vec_isa_ok", "fx_graph_cache", "triton.cudagraphs",
                "post_grad_custom_post_pass"):  # fmt: skip
        assert key in options, key
    base = ti.inductor_custom_graph_pass()
    assert inspect.isabstract(base) and base.__abstractmethods__ == {"__call__", "uuid"}
    assert isinstance(ti.inductor_cache_dir(), str)


def test_the_inductor_loaders_we_wrap_are_still_there():
    from torch._inductor.codecache import CppCodeCache, PyCodeCache
    from torch._inductor.cpu_vec_isa import VecISA

    load = CppCodeCache.__dict__["_load_library"]
    assert isinstance(load, classmethod), "CppCodeCache._load_library is no longer a classmethod"
    assert list(inspect.signature(load.__func__).parameters) == ["cls", "path", "key"]
    assert list(inspect.signature(VecISA.__dict__["_probe_load"]).parameters) == [
        "self",
        "output_path",
    ]
    assert isinstance(PyCodeCache.modules, list)
    assert callable(ti.record_inductor_library_loads)  # installed below, by the compile test


def test_trust_cpu_isa_flags_patches_what_exists():
    from torch._inductor import config, cpu_vec_isa

    assert list(inspect.signature(cpu_vec_isa.VecISA.check_build).parameters) == ["self", "code"]
    info = cpu_vec_isa.valid_vec_isa_list.cache_info  # an lru_cache: we clear it
    assert callable(info) and callable(cpu_vec_isa.valid_vec_isa_list.cache_clear)
    before = config.cpp.vec_isa_ok
    with ti.trust_cpu_isa_flags():
        if before is None:
            assert config.cpp.vec_isa_ok is True
            assert cpu_vec_isa.VecISA.check_build(None, "") is True
    assert config.cpp.vec_isa_ok == before


def test_standalone_compile_signatures():
    from torch._inductor import CompiledArtifact, standalone_compile

    assert {"dynamic_shapes", "options"} <= set(inspect.signature(standalone_compile).parameters)
    assert isinstance(CompiledArtifact.__dict__["load"], (staticmethod, classmethod))
    assert {"path", "format"} <= set(inspect.signature(CompiledArtifact.load).parameters)
    assert {"path", "format"} <= set(inspect.signature(CompiledArtifact.save).parameters)


def test_inductor_compiles_saves_and_loads_a_cpu_graph(tmp_path, monkeypatch):
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.cpu_vec_isa import VecISA

    from compile_runtime.cache import kernels

    for cls, name in ((CppCodeCache, "_load_library"), (VecISA, "_probe_load")):
        monkeypatch.setattr(cls, name, cls.__dict__[name])  # put back after the test
    loaded = []
    assert ti.record_inductor_library_loads(loaded.append)

    class Graph(torch.nn.Module):
        def forward(self, x):
            return (x * 2 + 1,)

    x = torch.randn(8)
    artifact = ti.standalone_compile(
        torch.fx.symbolic_trace(Graph()), [x], "from_example_inputs", {"cpp.dynamic_threads": True}
    )
    torch.testing.assert_close(artifact(x)[0], x * 2 + 1)
    assert any(path.endswith(".so") for path in loaded), "Inductor's library loads went unseen"
    assert all(path.startswith(kernels.inductor_cache_dir()) for path in loaded)
    modules = ti.inductor_generated_modules()
    assert any(ti.INDUCTOR_CPU_ALLOCATOR in vars(m) for m in modules)
    assert any(ti.is_inductor_cpp_kernel(v) for m in modules for v in vars(m).values())
    assert ti.artifact_is_saveable(artifact) is True
    path = str(tmp_path / "artifact.bin")
    ti.standalone_save(artifact, path)
    with ti.trust_cpu_isa_flags():
        again = ti.standalone_load(path)
    torch.testing.assert_close(again(x)[0], x * 2 + 1)
