"""backends/ and passes/ install inside the compile_runtime namespace; the C sources ship."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import compile_runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_namespace_imports():
    import compile_runtime.backends
    import compile_runtime.passes

    assert pathlib.Path(compile_runtime.backends.__file__).parent == ROOT / "backends"
    assert pathlib.Path(compile_runtime.passes.__file__).parent == ROOT / "passes"


def _source_packages() -> set[str]:
    names = set()
    for top, prefix in [
        ("compile_runtime", "compile_runtime"),
        ("backends", "compile_runtime/backends"),
        ("passes", "compile_runtime/passes"),
    ]:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            names.add(f"{prefix}/{rel}".rstrip("/.") if str(rel) != "." else prefix)
    return names


def test_wheel_holds_every_package_the_c_sources_and_nothing_at_top(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files}
    assert tops == {"compile_runtime", f"compile_runtime-{compile_runtime.__version__}.dist-info"}
    packaged = {f.rsplit("/", 1)[0] for f in files if f.endswith("/__init__.py")}
    assert packaged == _source_packages()
    # the C kernels compile on the machine they run on: their sources and headers ship
    c_sources = {
        f"compile_runtime/cpu/csrc/{p.name}" for p in (ROOT / "compile_runtime/cpu/csrc").iterdir()
    }
    assert c_sources and c_sources <= set(files)
