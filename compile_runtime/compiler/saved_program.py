"""The traced program, saved beside its compiled pieces: a warm start neither traces nor compiles.

What the one Dynamo trace yields, and what is kept of it (``program-<key>.json`` and
``program-<key>.pkl`` in the cache entry of the pieces, so export, import, verify and
clear handle it with them):

* the split graph (FX, pickled before its pieces are compiled) and its piece table:
  which pieces are splitting ops, and for each static piece the compiled artifact
  (piece hash, sizes) and where its token count is found;
* where each graph input comes from, as the expression Dynamo recorded
  (``L['self']._modules['layers']...``, ``L['input_ids'].size()[0]``): the model's
  tensors are looked up once at load, the arguments on every call;
* how the forward's return value is made from the graph's outputs.

A program is found by its *program key*: all a trace depends on that is known
without tracing (the compile key factors but the graph, the model's class, its
tensors' names/shapes/dtypes and plain attributes, the arguments' kinds and
static sizes, grad mode). The source files the trace read are listed with their
digests and checked at load: a changed or missing file is a miss (logged with
its name; ``cache explain`` names it too, through the pieces' key), never a stale
hit. Forwards whose return value is not the graph's output (one tensor, or a
tuple of them) or whose inputs come from elsewhere than the model and its
arguments are not saved, and trace at every start as before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import glob
import hashlib
import importlib
import json
import logging
import os
import pickle
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from compile_runtime.cache.files import read_json, write_atomic, write_json
from compile_runtime.cache.key import key_factors, portable_name
from compile_runtime.compiler.split import Piece, direct_splitting_graph, placeholder_names
from compile_runtime.torch_internals import dynamo_input_source

logger = logging.getLogger(__name__)

VERSION = 1
_ROOT = re.compile(r"^L\['([A-Za-z_][A-Za-z0-9_]*)'\]")
_PLAIN = (int, float, str, bool, type(None))


class NotSaveable(Exception):
    """Why a trace cannot be saved as a program (logged at INFO; the model still runs)."""


# ---- the program key -----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A JSON-able form of an attribute that can shape a trace, or ``...`` to skip it."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), str(value.dtype), value.device.type]}
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return ... if any(v is ... for v in items) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(tuple(getattr(value, f.name) for f in dataclasses.fields(value)))
    to_dict = getattr(value, "to_dict", None)  # transformers configs
    if callable(to_dict):
        try:
            return json.loads(json.dumps(to_dict(), sort_keys=True, default=str))
        except (TypeError, ValueError):
            return ...
    return ...


def model_fingerprint(model: torch.nn.Module) -> str:
    """Digest of what a trace of ``model`` bakes in besides its code: every submodule's
    class and plain attributes (sizes, eps, flags, configs), every tensor's name, shape,
    dtype and device."""
    parts: list[Any] = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = {}
        for key, value in module.__dict__.items():
            if key.startswith("_"):  # torch's bookkeeping, and our compiled forward
                continue
            plain = _plain(value)
            if plain is not ...:
                attrs[key] = plain
        parts.append([name, f"{type(module).__module__}.{type(module).__qualname__}", attrs])
    for kind, tensors in (
        ("param", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, t in tensors:
            parts.append([kind, name, list(t.shape), str(t.dtype), t.device.type, t.requires_grad])
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def argument_kinds(arguments: dict[str, Any], dims: dict[str, Any]) -> dict[str, Any]:
    """What of each argument a trace bakes in: None, a plain value, or a tensor's dtype,
    device and static sizes (dynamic dims as ``*``)."""
    out: dict[str, Any] = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            dynamic = dims.get(name, [])
            dynamic = [dynamic] if isinstance(dynamic, int) else list(dynamic)
            shape = ["*" if d in dynamic else s for d, s in enumerate(value.shape)]
            out[name] = {"tensor": [shape, str(value.dtype), value.device.type]}
        elif isinstance(value, _PLAIN):
            out[name] = {"value": value}
        else:
            raise NotSaveable(f"argument {name!r} is a {type(value).__name__}")
    return out


def program_factors(
    model: torch.nn.Module,
    config: Any,
    arguments: dict[str, Any],
    dims: dict[str, Any],
    *,
    pass_uuid: str,
    device: torch.device | None,
    world_size: int,
    pipeline_stage: str = "0 of 1",
) -> dict[str, Any]:
    factors = key_factors(
        config,
        graph_hash="",
        sources={},
        pass_uuid=pass_uuid,
        device=device,
        world_size=world_size,
        pipeline_stage=pipeline_stage,
    )
    del factors["graph"], factors["sources"]
    return {
        **factors,
        "program": VERSION,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "fingerprint": model_fingerprint(model),
        "arguments": argument_kinds(arguments, dims),
        "grad_enabled": torch.is_grad_enabled(),
    }


def program_key(factors: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


# ---- what the cold start saves -------------------------------------------------------------


def _code_of(graph: torch.fx.GraphModule, what: str) -> tuple[str, dict[str, Any]]:
    """The Python FX generates for ``graph``'s forward, with its globals by reference."""
    if any(n.op == "get_attr" for n in graph.graph.nodes):
        raise NotSaveable(f"the {what} reads attributes of its module")
    code = graph.graph.python_code(root_module="self")
    names: dict[str, Any] = {}
    for name, value in code.globals.items():
        if isinstance(value, types.ModuleType):
            names[name] = ("module", value.__name__)
        else:
            try:
                names[name] = ("object", pickle.dumps(value))
            except Exception as e:  # noqa: BLE001
                raise NotSaveable(f"the {what} uses {name!r}, which does not pickle ({e})") from e
    return code.src, names


def _function(src: str, names: dict[str, Any], filename: str) -> Callable[..., Any]:
    namespace = {
        name: importlib.import_module(value) if kind == "module" else pickle.loads(value)
        for name, (kind, value) in names.items()
    }
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - FX's code, from our cache
    return namespace["forward"]


class SavedModule:
    """The split graph run from the code FX generated for it at the trace: its pieces are
    attributes, as in the GraphModule it was (no FX, no tracing, at a warm start)."""

    def __init__(self, src: str, names: dict[str, Any]):
        self.code = src
        self.forward = types.MethodType(_function(src, names, "<saved split graph>"), self)

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)


@dataclasses.dataclass
class ProgramCode:
    """The program as code: the split graph's forward and every splitting piece's, as FX
    wrote them; the FX graphs themselves (pickled) only for inspection (``compiled_model``,
    ``verify``), unpickled when asked for since that costs time in proportion to depth."""

    top: tuple[str, dict[str, Any]]
    splitting: dict[str, tuple[str, dict[str, Any]]]
    arg_names: dict[str, list[str]]  # each static piece's input names
    graphs: bytes  # pickle of the split graph before its pieces were replaced
    pieces_table: list[tuple[str, int, bool]]

    def split_module(self) -> SavedModule:
        return SavedModule(*self.top)

    def splitting_functions(self) -> dict[str, Callable[..., Any]]:
        return {
            name: functools.partial(_function(src, names, f"<saved {name}>"), None)
            for name, (src, names) in self.splitting.items()
        }

    def pieces(self) -> list[Piece]:
        split_gm = pickle.loads(self.graphs)
        return [
            Piece(name, index, split_gm.get_submodule(name), is_splitting)
            for name, index, is_splitting in self.pieces_table
        ]

    def readable(self) -> str:
        return "# Split graph of a saved program\n" + self.top[0]


def program_code(split_gm: torch.fx.GraphModule, pieces: list[Piece]) -> ProgramCode:
    """The program of a split graph, taken before its pieces are replaced."""
    return ProgramCode(
        top=_code_of(split_gm, "split graph"),
        splitting={
            p.name: _code_of(direct_splitting_graph(p.graph), f"splitting piece {p.name}")
            for p in pieces
            if p.is_splitting_op
        },
        arg_names={p.name: placeholder_names(p.graph) for p in pieces if not p.is_splitting_op},
        graphs=pickle.dumps(split_gm),
        pieces_table=[(p.name, p.index, p.is_splitting_op) for p in pieces],
    )


@dataclasses.dataclass
class ProgramDraft:
    """What the graph compiler knows of a program once the pieces are compiled; the output
    plan is added when the first call returns (``save``)."""

    code: ProgramCode
    inputs: list[str]  # the source expression of every graph input
    num_outputs: int
    pieces: list[dict[str, Any]]  # the piece table (program.py: DraftBuilder.finish)
    records: list[dict[str, Any]]  # PieceRecord fields, for CompileResult
    entry_dir: str
    entry_factors: dict[str, Any]
    sources: dict[str, str]  # absolute path -> digest of every traced file


def draft_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """The source expression of every placeholder; NotSaveable when one is not ``L[...]``."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = dynamo_input_source(node)
        if not isinstance(name, str) or not _ROOT.match(name):
            raise NotSaveable(f"graph input {node.name} comes from {name!r}")
        names.append(name)
    return names


def output_plan(out: Any, num_outputs: int) -> str:
    if isinstance(out, torch.Tensor) and num_outputs == 1:
        return "single"
    if (
        isinstance(out, tuple)
        and len(out) == num_outputs
        and all(isinstance(t, torch.Tensor) for t in out)
    ):
        return "tuple"
    raise NotSaveable(f"the forward returns {type(out).__name__}, not the graph's outputs")


def save(
    draft: ProgramDraft, key: str, factors: dict[str, Any], out: Any, none_pattern: Any
) -> None:
    record = {
        "version": VERSION,
        "key": key,
        "factors": factors,
        "inputs": draft.inputs,
        "output": output_plan(out, draft.num_outputs),
        "pieces": draft.pieces,
        "records": draft.records,
        "entry_factors": draft.entry_factors,
        "sources": {
            portable_name(path): {"path": path, "digest": digest}
            for path, digest in sorted(draft.sources.items())
        },
        "none_pattern": [list(p[:2]) + [repr(p[2]), p[3]] for p in none_pattern],
    }
    write_atomic(os.path.join(draft.entry_dir, f"program-{key}.pkl"), pickle.dumps(draft.code))
    write_json(os.path.join(draft.entry_dir, f"program-{key}.json"), record)  # last: publishes


# ---- what the warm start loads -------------------------------------------------------------


@dataclasses.dataclass
class SavedProgram:
    record: dict[str, Any]
    code: ProgramCode
    entry_dir: str


def _current_path(portable: str, saved_path: str) -> str | None:
    """Where the file a trace read lives now: its saved path, or a loaded module's file
    with the same package-relative name (after ``cache import`` on another machine)."""
    if os.path.isfile(saved_path) and portable_name(saved_path) == portable:
        return saved_path
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.endswith(os.path.basename(portable)) and portable_name(path) == portable:
            return path
    return None


def _stale_source(record: dict[str, Any]) -> str | None:
    from compile_runtime.cache.key import source_digests

    for portable, saved in record["sources"].items():
        path = _current_path(portable, saved["path"])
        if path is None:
            return f"source file {portable} is not found"
        if source_digests([path]).get(portable) != saved["digest"]:
            return f"source file {portable} changed since the program was saved"
    return None


def find(root: str, key: str, rank: int, model_tag: str) -> SavedProgram | None:
    """The saved program of ``key`` whose sources are unchanged, or None (reason logged)."""
    pattern = os.path.join(glob.escape(root), "*", f"rank_{rank}", model_tag, f"program-{key}.json")
    paths = sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True)
    reasons = []
    for path in paths:
        try:
            record = read_json(path)
            if record.get("version") != VERSION or record.get("key") != key:
                raise ValueError("another version")
            stale = _stale_source(record)
            if stale:
                reasons.append(stale)
                continue
            with open(path[: -len(".json")] + ".pkl", "rb") as f:
                code = pickle.load(f)
            if not isinstance(code, ProgramCode):
                raise TypeError(f"holds a {type(code).__name__}")
        except Exception as e:  # a damaged program is a miss: trace and save it again
            reasons.append(f"{path} does not load ({type(e).__name__}: {e})")
            continue
        return SavedProgram(record, code, os.path.dirname(path))
    if reasons:
        logger.warning("%s: saved program not used (%s); tracing again", model_tag, reasons[0])
    return None


def make_gather(
    inputs: list[str], self_name: str, model: torch.nn.Module
) -> Callable[[dict[str, Any]], list[Any]]:
    """``gather(L)``: the graph's inputs for a call whose arguments are ``L`` (by name).

    The model's own tensors are looked up now, once; argument expressions become
    one generated function, so a call costs a list display, not an interpreter.
    """
    constants: list[Any] = []
    parts = []
    for expr in inputs:
        if _ROOT.match(expr).group(1) == self_name:
            constants.append(eval(expr, {"L": {self_name: model}}))  # noqa: S307 - Dynamo's own
            parts.append(f"C[{len(constants) - 1}]")
        else:
            parts.append(expr)
    fn = eval(f"lambda C, L: [{', '.join(parts)}]", {})  # noqa: S307 - from Dynamo's sources
    return functools.partial(fn, constants)  # called with the arguments
