"""The declarations of a kernel library's header, as ctypes types.

Each library in ``csrc/`` declares its exported functions once, in ``<name>.h``: the C file
includes it, so the compiler checks every definition against its declaration, and ctypes is
typed from the same lines, so a Python wrapper cannot disagree with the C it calls. The
parser takes only what our headers hold: ``#pragma once``, ``#include`` lines, comments and
prototypes such as ``void name(const float* x, int64_t n);``, every parameter named. Any
pointer is a ``c_void_p``; a type it does not know, or anything else, is an error naming it.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any, NamedTuple

_SCALARS: dict[str, Any] = {
    "int": ctypes.c_int,
    "int8_t": ctypes.c_int8,
    "uint8_t": ctypes.c_uint8,
    "int16_t": ctypes.c_int16,
    "uint16_t": ctypes.c_uint16,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_NOT_NAMES = {"*", "const", "void", *_SCALARS}
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DIRECTIVE = re.compile(r"#\s*(pragma\s+once|include\s*[<\"][^>\"]+[>\"])\s*")
_PROTOTYPE = re.compile(r"(?P<ret>[\w\s*]+?)\s*\b(?P<name>[A-Za-z_]\w*)\s*\((?P<params>[^()]*)\)")
_TOKEN = re.compile(r"[A-Za-z_]\w*|\*")


class HeaderError(ValueError):
    """A header holds something the parser does not take (it is stricter than C on purpose)."""


class Declaration(NamedTuple):
    argtypes: tuple[Any, ...]
    restype: Any  # None for void


def _ctype(tokens: list[str], where: str) -> Any:
    """``const uint16_t *`` and the like, as tokens, to its ctypes type."""
    words = [t for t in tokens if t not in ("const", "*")]
    if len(words) != 1:
        raise HeaderError(f"{where}: cannot read the type {' '.join(tokens)!r}")
    (word,) = words
    if word not in _SCALARS and not (word == "void" and "*" in tokens):
        raise HeaderError(f"{where}: unknown C type {word!r}")
    return ctypes.c_void_p if "*" in tokens else _SCALARS[word]


def _parameter(text: str, where: str) -> Any:
    tokens = _TOKEN.findall(text)
    *kind, name = tokens or [""]
    if "".join(tokens) != re.sub(r"\s", "", text) or not kind or name in _NOT_NAMES:
        raise HeaderError(f"{where}: a parameter must be a type and a name, got {text.strip()!r}")
    return _ctype(kind, where)


def parse_header(text: str, where: str) -> dict[str, Declaration]:
    """Every function ``text`` declares, by name; ``where`` (the file) names it in errors."""
    lines = []
    for line in _COMMENT.sub(" ", text).splitlines():
        if line.lstrip().startswith("#"):
            if not _DIRECTIVE.fullmatch(line.strip()):
                raise HeaderError(f"{where}: only #pragma once and #include, got {line.strip()!r}")
            continue
        lines.append(line)
    *statements, rest = " ".join(lines).split(";")
    if rest.strip():
        raise HeaderError(f"{where}: {rest.strip()!r} does not end with ';'")
    declarations: dict[str, Declaration] = {}
    for statement in statements:
        match = _PROTOTYPE.fullmatch(statement.strip())
        if match is None:
            raise HeaderError(f"{where}: not a function prototype: {statement.strip()!r}")
        name, params = match["name"], match["params"].strip()
        at = f"{where}: {name}"
        if name in declarations:
            raise HeaderError(f"{at} is declared twice")
        ret = _TOKEN.findall(match["ret"])
        restype = None if ret == ["void"] else _ctype(ret, at)
        argtypes = () if params == "void" else tuple(_parameter(p, at) for p in params.split(","))
        declarations[name] = Declaration(argtypes, restype)
    return declarations
