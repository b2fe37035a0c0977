"""Every use of PyTorch's private APIs, behind one fence.

Nothing else in ``compile_runtime``, ``backends`` or ``passes`` touches a private torch
name (``torch._inductor``, ``torch._dynamo``, ``torch._C._*``, ``torch.utils._*``,
``torch.fx.experimental``, an op's ``_schema``, ...). ``tests/test_torch_internals.py``
checks that (a scan of the sources) and every item here against the installed torch, so
an upgrade that moves one fails there first, by name, not deep in a compile.

Each item's "checked:" comment names the torch versions it was read against: 2.13.0 (CPU,
the test machine) and 2.11 (the GPU machines), the range ``check_torch_version`` enforces.
Only modules ``import torch`` has loaded already are imported at the top; Inductor,
Dynamo and sympy load inside the functions that need them (importing ``compile_runtime``
loads none of them). This module imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

# Loaded by ``import torch`` itself; re-exported as they are. checked: 2.13.0, 2.11
import torch.fx.experimental._config as _fx_config
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_dispatch_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

# ---- the supported torch versions -------------------------------------------------------

# pyproject.toml's requirement reads the same (tests/test_torch_internals.py checks it).
TORCH_REQUIREMENT = ">=2.11,<2.14"
TESTED_TORCH = "2.13.0"  # what `pip install` should bring back
_LOWEST, _BELOW = (
    tuple(map(int, v.split("."))) for v in re.findall(r"\d+\.\d+", TORCH_REQUIREMENT)
)


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.13.0+cpu" -> (2, 13)); None if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def check_torch_version(version: str | None = None) -> None:
    """Raise RuntimeError when torch (``version``: the installed one) is outside
    ``TORCH_REQUIREMENT``: the private APIs fenced here were checked on those releases only."""
    if version is None:
        return _check_installed()
    release = torch_release(version)
    if release is not None and _LOWEST <= release < _BELOW:
        return None
    raise RuntimeError(
        f"compile_runtime needs torch{TORCH_REQUIREMENT}, but this Python has torch {version}: "
        "it uses PyTorch internals (compile_runtime/torch_internals.py) checked on those "
        f"releases only. Install a supported one: pip install torch=={TESTED_TORCH}"
    )


_check_installed = functools.cache(lambda: check_torch_version(torch.__version__))


# ---- ops, tensors and storages ----------------------------------------------------------


# checked: 2.13.0, 2.11
def is_torch_op(target: Any) -> bool:
    """``target`` is a registered op (``aten.mm.default``) or its packet (``aten.mm``)."""
    return isinstance(target, (OpOverload, OpOverloadPacket))


# checked: 2.13.0, 2.11
def op_schema(op: OpOverload) -> Any:
    """The op's ``torch._C.FunctionSchema`` (``.name``, ``.arguments``, ``.returns``)."""
    return op._schema


# checked: 2.13.0, 2.11 (older overloads without _schema: name())
def op_qualified_name(target: Any) -> str | None:
    """``namespace::name`` of an op or packet; None for anything else."""
    if isinstance(target, OpOverload):
        # Older overloads had no _schema attribute: their name() says the same.
        return target._schema.name if hasattr(target, "_schema") else target.name()
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name
    return None


# checked: 2.13.0, 2.11
def op_bare_name(target: Any) -> str | None:
    """The op's name without namespace or overload ("nonzero"); None for a non-op."""
    if isinstance(target, OpOverload):
        return target._opname
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


# checked: 2.13.0, 2.11
def op_overload_name(target: Any) -> str | None:
    """The overload's name ("default", "Tensor"); None for a packet or a non-op."""
    return getattr(target, "_overloadname", None)


# checked: 2.13.0, 2.11
# ``tensor_version(tensor)``: the tensor's in-place version counter (moves at every in-place
# write). An attrgetter, not a def: read on every packed-weight lookup (each step's LM head),
# where a Python frame costs more than the read.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


# checked: 2.13.0, 2.11
def storage_over(data_ptr: int, device: torch.device, nbytes: int) -> Any:
    """An untyped storage over memory it does not own (nor keep allocated)."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


# checked: 2.13.0, 2.11
def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


# checked: 2.13.0, 2.11
def mkldnn_reorder_linear_weight(weight: torch.Tensor, batch_size: int) -> torch.Tensor:
    """oneDNN's blocked copy of a float32 linear weight, for ``mkldnn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)


# checked: 2.13.0, 2.11
def mkldnn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``x @ weight.T + bias`` on oneDNN's blocked copy of the weight (no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# checked: 2.13.0, 2.11
def functional_all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """A traceable all-reduce (``_c10d_functional``); its result waits on the collective."""
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(x, op, group_name)
    )


# ---- fake tensors, shapes, tracing context ----------------------------------------------


# checked: 2.13.0, 2.11
def detect_fake_mode(inputs: Any) -> Any:
    """The FakeTensorMode the inputs' fake tensors belong to (or the tracing one), or None."""
    return torch._guards.detect_fake_mode(inputs)


# checked: 2.13.0, 2.11
def traced_code() -> list[types.CodeType]:
    """The code objects Dynamo read in the trace under way (empty outside one)."""
    context = torch._guards.TracingContext.try_get()
    return list(getattr(context, "traced_code", None) or [])


# checked: 2.13.0, 2.11
def free_unbacked_symbols(value: Any) -> set[Any]:
    """The data-dependent (unbacked) shape symbols in ``value``; loads sympy."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as free

    return set(free(value))


# checked: 2.13.0, 2.11
def statically_known_true(expr: Any) -> bool:
    """True only if ``expr`` holds for every value of its symbols (adds no guard); sympy."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return bool(known(expr))


# checked: 2.13.0, 2.11
def backed_size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Trace sizes 0 and 1 like any other size instead of specialising on them."""
    return _fx_config.patch(backed_size_oblivious=True)


# ---- Dynamo -----------------------------------------------------------------------------


# checked: 2.13.0, 2.11
def dynamo_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    import torch._dynamo

    torch._dynamo.mark_dynamic(tensor, dim)


# checked: 2.13.0, 2.11
def dynamo_register_bytecode_hook(hook: Callable[[types.CodeType, types.CodeType], Any]) -> Any:
    """Call ``hook(code, new_code)`` for every frame Dynamo converts; returns a handle whose
    ``remove()`` takes it off."""
    from torch._dynamo.convert_frame import register_bytecode_hook

    return register_bytecode_hook(hook)


# checked: 2.13.0, 2.11
def dynamo_unsupported() -> type[Exception]:
    """What Dynamo raises at a graph break under ``fullgraph=True``."""
    from torch._dynamo.exc import Unsupported

    return Unsupported


# checked: 2.13.0, 2.11
def dynamo_backend_failed() -> type[Exception]:
    """What Dynamo raises when the backend fails; ``.inner_exception`` is the backend's."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed


# checked: 2.13.0, 2.11
def trace_errors() -> tuple[type[Exception], ...]:
    """What a failed trace raises besides a graph break: Dynamo's UserError (a guard on
    tensor data) and the shape checks' errors (a dynamic size the code made constant)."""
    from torch._dynamo.exc import UserError
    from torch.fx.experimental.symbolic_shapes import (
        ConstraintViolationError,
        GuardOnDataDependentSymNode,
    )

    return (dynamo_unsupported(), UserError, ConstraintViolationError, GuardOnDataDependentSymNode)


# checked: 2.13.0, 2.11 (Source.name a method or a property)
def dynamo_input_source(node: torch.fx.Node) -> str | None:
    """Where Dynamo took a placeholder's value from (``L['input_ids']``), or None."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = source.name if source is not None else None
    return name() if callable(name) else name  # a method in some releases, a property in others


# ---- Inductor ---------------------------------------------------------------------------

# Imported ahead in standby worker processes: most of what a compile loads.
# checked: 2.13.0, 2.11
INDUCTOR_PRELOAD = ("torch._inductor.compile_fx",)
# The global Inductor's generated CPU modules allocate their buffers through.
# checked: 2.13.0, 2.11
INDUCTOR_CPU_ALLOCATOR = "empty_strided_cpu"


# checked: 2.13.0, 2.11
def inductor_options() -> dict[str, Any]:
    """Every option of ``torch._inductor.config`` (dotted keys) and its value."""
    from torch._inductor import config

    return config.get_config_copy()


# checked: 2.13.0, 2.11
def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


# checked: 2.13.0, 2.11
def inductor_custom_graph_pass() -> type:
    """The base class of Inductor's ``post_grad_custom_post_pass`` (with ``uuid()``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


# checked: 2.13.0, 2.11
def standalone_compile(
    graph: torch.fx.GraphModule, example_inputs: list[Any], dynamic_shapes: str, patches: dict
) -> Any:
    """Inductor's compile of one FX graph, as a ``CompiledArtifact`` (callable, saveable)."""
    from torch._inductor import standalone_compile as compile_graph

    return compile_graph(
        graph, example_inputs, dynamic_shapes=dynamic_shapes, options={"config_patches": patches}
    )


# checked: 2.13.0, 2.11 (an artifact without is_saveable: saveable)
def artifact_is_saveable(artifact: Any) -> bool:
    """False when Inductor kept nothing to save (its caches off); older artifacts: always."""
    return getattr(artifact, "is_saveable", lambda: True)()


# checked: 2.13.0, 2.11
def standalone_save(artifact: Any, path: str) -> None:
    artifact.save(path=path, format="binary")


# checked: 2.13.0, 2.11
def standalone_load(path: str) -> Any:
    from torch._inductor import CompiledArtifact

    return CompiledArtifact.load(path=path, format="binary")


# checked: 2.13.0, 2.11 (loaders moved: patches nothing, returns False)
def record_inductor_library_loads(record: Callable[[str], None]) -> bool:
    """Call ``record(path)`` for every C++ kernel library (and vector-ISA probe library)
    Inductor loads from now on. False, patching nothing, where its loaders moved."""
    try:
        from torch._inductor.codecache import CppCodeCache
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return False
    load_library = CppCodeCache.__dict__.get("_load_library")
    probe_load = VecISA.__dict__.get("_probe_load")
    if not isinstance(load_library, classmethod) or probe_load is None:
        return False
    inner = load_library.__func__

    def _load_library(cls, path: str, key: str) -> Any:
        record(path)
        return inner(cls, path, key)

    def _probe_load(self, output_path: str) -> Any:
        record(output_path)
        return probe_load(self, output_path)

    CppCodeCache._load_library = classmethod(_load_library)
    VecISA._probe_load = _probe_load
    return True


# checked: 2.13.0, 2.11
def inductor_generated_modules() -> list[types.ModuleType]:
    """The Python modules Inductor generated (and loaded) in this process."""
    from torch._inductor.codecache import PyCodeCache

    return list(PyCodeCache.modules)


# checked: 2.13.0, 2.11
def is_inductor_cpp_kernel(value: Any) -> bool:
    """``value`` is a C++ kernel of a generated module: the ``kernel`` function of a
    library Inductor built (called with raw pointers and sizes)."""
    return (
        type(value) is types.BuiltinFunctionType
        and value.__name__ == "kernel"
        and getattr(value.__self__, "__file__", "").endswith(".so")
    )


# checked: 2.13.0, 2.11
@contextlib.contextmanager
def trust_cpu_isa_flags() -> Iterator[None]:
    """Skip Inductor's CPU-ISA probe while loading saved kernels.

    Loading a CPU artifact asks which vector ISA to use only to find its kernel's file;
    the probe behind the answer builds and dlopens a test program per ISA in child
    processes (a large part of a warm start). The kernels are built already, for this CPU
    capability (part of the cache key), so the CPU's own flags answer. A compile later in
    the process probes as usual: the list computed here is dropped.
    """
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:  # the user decided
        yield
        return
    probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    # AVX-512's bf16 and VNNI checks build and dlopen a program each even then, after the
    # CPU's flag said yes (~70 ms each): the flag answers.
    trusted = mock.patch.object(cpu_vec_isa.VecISA, "check_build", lambda self, code: True)
    try:
        with config.patch({"cpp.vec_isa_ok": True}), trusted:
            yield
    finally:
        if not probed:
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


__all__ = [
    "INDUCTOR_CPU_ALLOCATOR",
    "INDUCTOR_PRELOAD",
    "TESTED_TORCH",
    "TORCH_REQUIREMENT",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "artifact_is_saveable",
    "auto_functionalized",
    "auto_functionalized_v2",
    "backed_size_oblivious",
    "check_torch_version",
    "detect_fake_mode",
    "disable_dispatch_modes",
    "dynamo_backend_failed",
    "dynamo_input_source",
    "dynamo_mark_dynamic",
    "dynamo_register_bytecode_hook",
    "dynamo_unsupported",
    "free_unbacked_symbols",
    "functional_all_reduce",
    "inductor_cache_dir",
    "inductor_custom_graph_pass",
    "inductor_generated_modules",
    "inductor_options",
    "is_inductor_cpp_kernel",
    "is_torch_op",
    "mkldnn_bf16_supported",
    "mkldnn_linear",
    "mkldnn_reorder_linear_weight",
    "op_bare_name",
    "op_overload_name",
    "op_qualified_name",
    "op_schema",
    "record_inductor_library_loads",
    "standalone_compile",
    "standalone_load",
    "standalone_save",
    "statically_known_true",
    "storage_over",
    "tensor_version",
    "torch_release",
    "trace_errors",
    "traced_code",
    "tree_flatten",
    "tree_leaves",
    "tree_map_only",
    "trust_cpu_isa_flags",
    "unset_fake_temporarily",
]
