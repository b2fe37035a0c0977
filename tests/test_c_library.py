"""The C kernels' builder: headers typed into ctypes, every input file in the digest."""

from __future__ import annotations

import ctypes
import logging
import pathlib

import pytest

from compile_runtime.cpu.c_header import HeaderError, parse_header
from compile_runtime.cpu.c_library import CSRC, c_compiler, load_c_library
from compile_runtime.cpu.native_function import NativeFunction

HEADER = """/* a header as ours are written */
#pragma once
#include <stdint.h>

// the kernel
void kernel(const float* x, int64_t n, const uint16_t* w, int flag,
            void* const* fns, double* out);
int probe(void);
int64_t count(const int32_t* ids, int64_t n);
"""


def test_a_header_declares_the_ctypes_types():
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    assert parse_header(HEADER, "t.h") == {
        "kernel": ((ptr, i64, ptr, ctypes.c_int, ptr, ptr), None),
        "probe": ((), ctypes.c_int),
        "count": ((ptr, i64), i64),
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("void f(__m512* v);", "unknown C type '__m512'"),
        ("void f(long n);", "unknown C type 'long'"),
        ("struct s f(int n);", "cannot read the type 'struct s'"),
        ("void f(int64_t);", "a type and a name"),
        ("void f();", "a type and a name"),
        ("void f(int n)", "does not end with ';'"),
        ("#define N 4\nvoid f(int n);", "only #pragma once and #include"),
        ("int f(int n); int f(int m);", "f is declared twice"),
        ("static int x;", "not a function prototype"),
    ],
)
def test_anything_else_in_a_header_is_an_error_naming_it(text, error):
    with pytest.raises(HeaderError, match=f"t.h: .*{error}"):
        parse_header(text, "t.h")


def test_every_library_header_parses():
    libraries = sorted(p.stem for p in pathlib.Path(CSRC).glob("*.c"))
    assert "gemv" in libraries and "paged_decode" in libraries
    for name in libraries:
        assert parse_header((pathlib.Path(CSRC) / f"{name}.h").read_text(), f"{name}.h")


def test_a_declared_float_argument_is_refused_for_a_native_function():
    (declared,) = parse_header("void scale(float* x, float s);", "t.h").values()
    with pytest.raises(TypeError, match="floating point"):
        NativeFunction(None, "scale", declared.argtypes)


def _write(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)


LIBRARY = {
    "common.h": "#define BIAS 0\n",
    "t.h": "#include <stdint.h>\nint64_t t_add(int64_t a, int64_t b);\nvoid t_scale(float* x, float s);\n",
    "t.c": '#include "common.h"\n#include "t.h"\n'
    "int64_t t_add(int64_t a, int64_t b) { return a + b + BIAS; }\n"
    "void t_scale(float* x, float s) { *x *= s; }\n",
}


@pytest.mark.skipif(c_compiler() is None, reason="needs a C compiler")
def test_editing_any_file_of_a_library_rebuilds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPILE_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    _write(src, LIBRARY)
    first = load_c_library("t", "a test library", folder=str(src))
    assert first.native("t_add")(2, 3) == 5
    x = ctypes.c_float(1.5)
    first.function("t_scale")(ctypes.addressof(x), 2.0)  # plain ctypes takes a float
    assert x.value == 3.0
    with pytest.raises(TypeError, match="floating point"):
        first.native("t_scale")

    paths = {first.path}
    (src / "t.h").write_text(LIBRARY["t.h"] + "/* edited */\n")
    paths.add(load_c_library("t", "a test library", folder=str(src)).path)
    (src / "common.h").write_text("#define BIAS 10\n")  # included by t.c, not by t.h
    edited = load_c_library("t", "a test library", folder=str(src))
    assert edited.native("t_add")(2, 3) == 15
    paths.add(edited.path)
    assert len(paths) == 3
    _write(src, LIBRARY)
    assert load_c_library("t", "a test library", folder=str(src)).path == first.path


@pytest.mark.skipif(c_compiler() is None, reason="needs a C compiler")
def test_the_compiler_checks_a_definition_against_its_header(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("COMPILE_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    _write(tmp_path, {**LIBRARY, "t.h": LIBRARY["t.h"].replace("int64_t b", "int b")})
    with caplog.at_level(logging.WARNING):
        assert load_c_library("t", "a test library", folder=str(tmp_path)) is None
    assert "conflicting types" in caplog.text
    assert not list((tmp_path / "cache" / ".cpu_kernels").glob("*.so"))


def test_a_library_must_include_its_header(tmp_path):
    _write(tmp_path, {**LIBRARY, "t.c": LIBRARY["t.c"].replace('#include "t.h"\n', "")})
    with pytest.raises(ValueError, match="t.c must include t.h"):
        load_c_library("t", "a test library", folder=str(tmp_path))


@pytest.mark.skipif(c_compiler() is None, reason="needs a C compiler")
def test_a_library_built_ahead_is_built_once_and_waited_for(tmp_path, monkeypatch):
    """``build_ahead`` (an engine's start) compiles in a background thread; a load of the
    same library while it builds waits for that build instead of starting its own."""
    import threading

    from compile_runtime.cpu import c_library

    monkeypatch.setenv("COMPILE_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    _write(tmp_path, LIBRARY)
    builds, started, release = [], threading.Event(), threading.Event()
    real_build = c_library._build

    def slow_build(*args):
        builds.append(threading.current_thread().name)
        started.set()
        release.wait(30)  # the load below comes while this build is under way
        real_build(*args)

    monkeypatch.setattr(c_library, "_build", slow_build)
    c_library.build_ahead(("t",), folder=str(tmp_path))
    assert started.wait(30)
    threading.Timer(0.2, release.set).start()
    lib = load_c_library("t", "a test library", folder=str(tmp_path))
    assert lib.native("t_add")(2, 3) == 5
    assert builds == ["cr-build-kernels"]  # one build, in the background thread
