"""The package reads in one direction: no import cycle, every folder names its files, no file
longer than one concept needs.

A cycle hidden in a function-level import or in an ``if TYPE_CHECKING:`` import still ties two
modules together (neither can be read, moved or tested without the other), so both count.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Installed names of the source folders (pyproject.toml's package-dir).
SOURCES = {
    "compile_runtime": REPO / "compile_runtime",
    "compile_runtime.backends": REPO / "backends",
    "compile_runtime.passes": REPO / "passes",
}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def own_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` loads (a.b.func -> a.b), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package
                    for _ in range(child.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:  # `from pkg import submodule` loads the submodule
                    sub = f"{base}.{alias.name}"
                    names.add(sub if sub in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def loaded_packages(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs first: its own and those above
    it, less the importer's own packages (already loading when it runs)."""
    packages = set()
    while "." in target:
        target = target.rpartition(".")[0]
        if target in modules and not (importer + ".").startswith(target + "."):
            packages.add(target)
    return packages


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = {own_module(n, modules) for n in imported_names(module, path, modules)}
        targets |= {p for t in set(targets) if t for p in loaded_packages(t, module, modules)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "compile_runtime.config" in graph and "compile_runtime.cpu.attention" in graph
    assert "compile_runtime.config" in graph["compile_runtime.compiler.decorator"]


def test_importing_a_module_runs_its_packages_init():
    modules = {name: Path() for name in ("a", "a.b", "a.b.c", "d")}
    assert loaded_packages("a.b.c", "d", modules) == {"a", "a.b"}
    assert loaded_packages("a.b.c", "a.b.x", modules) == set()  # inside a.b: already loading


def test_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def is_config(module: str) -> bool:
    """The config layer: the package ``compile_runtime.config`` and its modules."""
    return module == "compile_runtime.config" or module.startswith("compile_runtime.config.")


# Below config: the fence around torch's private APIs (config checks Inductor's options) and
# the platforms' descriptions (config resolves graph modes against the device).
FENCE = "compile_runtime.torch_internals"
PLATFORMS = "compile_runtime.platforms"


def below_config(module: str) -> bool:
    return module == FENCE or (module + ".").startswith(PLATFORMS + ".")


def test_config_is_the_lowest_layer():
    graph = import_graph()
    config_modules = [m for m in graph if is_config(m)]
    assert len(config_modules) > 1, "the graph lost the config package's modules"
    ours = {
        (m, t) for m in config_modules for t in graph[m] if not is_config(t) and not below_config(t)
    }
    assert ours == set(), f"config imports {sorted(ours)}; it must import nothing else of ours"


def test_the_torch_fence_and_the_platforms_import_nothing_else_of_ours():
    graph = import_graph()
    assert graph[FENCE] == set()
    platforms = [m for m in graph if below_config(m) and m != FENCE]
    assert len(platforms) > 2, "the graph lost the platforms package"
    assert {t for m in platforms for t in graph[m] if not below_config(t)} == set()


# A cohesion rule, not a budget: a file may grow while one concept needs it, to this bound;
# past it, it mixes concepts and is split along them.
MAX_LINES = 600


def test_no_library_file_is_longer_than_one_concept_needs():
    long = {
        str(path.relative_to(REPO)): n
        for path in module_files().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these along their concepts: {long}"


def test_every_folder_says_what_it_holds():
    silent = [
        str(path.relative_to(REPO))
        for path in module_files().values()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not silent, f"give these a docstring naming each file's concept: {silent}"


def unnamed_files(init: Path) -> list[str]:
    """The modules of ``init``'s folder its docstring does not name (as ``name`` or name.py)."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return [
        path.stem
        for path in sorted(init.parent.glob("*.py"))
        if path.name != "__init__.py"
        and f"``{path.stem}``" not in doc
        and f"{path.stem}.py" not in doc
    ]


def test_every_folder_names_each_of_its_files(tmp_path):
    missing = {
        str(path.parent.relative_to(REPO)): names
        for path in module_files().values()
        if path.name == "__init__.py" and (names := unnamed_files(path))
    }
    assert not missing, f"name these files in their folder's __init__ docstring: {missing}"
    (tmp_path / "__init__.py").write_text('"""``kept``: named."""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "forgotten.py").write_text("")
    assert unnamed_files(tmp_path / "__init__.py") == ["forgotten"]


def folder_of(module: str) -> str:
    """The top-level folder a module lives in (``compile_runtime.worker.runner`` -> ``worker``;
    the installed ``backends``/``passes`` keep their sub-folder: ``backends.attention``)."""
    parts = module.split(".")[1:]
    if parts and parts[0] in ("backends", "passes"):
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else "<top>"


def two_way_folders(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            pair = (folder_of(module), folder_of(target))
            if pair[0] != pair[1] and "<top>" not in pair:
                edges.setdefault(pair, []).append(f"{module} -> {target}")
    return {
        (a, b): edges[(a, b)][:2] + edges[(b, a)][:2] for a, b in edges if a < b and (b, a) in edges
    }


def test_no_two_folders_depend_on_each_other():
    """A folder below another never imports it back, even for a type: each folder can be
    read knowing only the folders under it."""
    assert two_way_folders({"p.a.x": {"p.b.y"}, "p.b.y": {"p.a.z"}}) == {
        ("a", "b"): ["p.a.x -> p.b.y", "p.b.y -> p.a.z"]
    }
    both = two_way_folders(import_graph())
    assert not both, f"folders that import each other: {both}"


def test_nothing_below_the_command_line_imports_it():
    graph = import_graph()
    front = "compile_runtime.cli"
    assert any(m.startswith(front + ".") for m in graph), "the graph lost the cli package"
    importers = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if not (m + ".").startswith(front + ".")
        for t in targets
        if (t + ".").startswith(front + ".")
    )
    assert not importers, f"only the command line imports the command line: {importers}"
