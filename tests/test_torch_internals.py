"""The fence around PyTorch's private APIs (compile_runtime/torch_internals.py).

Each item the fence holds has a contract test here that fails, naming the item, when a
torch release moves or changes what we rely on (the attribute, its parameters, a
classmethod we patch still being one, what it returns). Another test keeps every private
name inside the fence, and one the supported torch range in step with pyproject.toml.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
