"""The user documentation (README.md, docs/, the mkdocs site) stays true to the repository.

* The site builds: ``mkdocs build --strict`` (every page in the nav, every link and anchor
  found). ``mkdocs`` comes with the ``dev`` extra that ``make test`` installs; without it
  that one test skips.
* The README stays a front page: at most 250 lines.
* docs/results.md is exactly what ``python benchmarks/results_page.py`` writes from the
  records in docs/results/, and every record names its date, CPU and command.
* Every repository path written in backticks (inline or in a code block) exists: a word
  with a ``/`` whose first folder is one at the repository's top (``benchmarks/vs_vllm.py``,
  ``scripts/gpu_check.sh``), or any word with a ``/`` that ends in a source file's extension
  (so ``compile_runtime/cpu/linear.py``, relative to nothing, fails too). Paths the repository ignores
  (built or downloaded: ``.models/``, ``benchmarks/.peers/``) are not checked.
  Dotted names of ours (``compile_runtime.models.smollm2``) must name a module, or a module
  and something it defines.
* No page cites an issue by number ("issue 12", "#12"): the docs speak to users.
* Examples that claim to run, run. The convention: a fenced ``python`` block whose first line
  is the comment ``# runs``. Each such block is executed as written, except that
  ``compile_runtime.LLM`` builds a cheap engine (no compilation: ``mode="NONE"``; small
  sizes), shared by the blocks that ask for the same model: the blocks check the API they
  show, not the compiler. The model they name through ``smollm2_gguf()`` is replaced by the
  suite's tiny local model (``model_dirs``, with a chat template), so they run in seconds and
  need no download. Keep them few and short (``max_tokens`` small).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCE_SUFFIXES = (
    ".py",
    ".c",
    ".h",
    ".sh",
    ".md",
    ".json",
    ".toml",
    ".yml",
    ".yaml",
    ".txt",
    ".png",
)
RUNS_MARK = "# runs"


def load_results_page():
    spec = importlib.util.spec_from_file_location(
        "results_page", REPO / "benchmarks" / "results_page.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pages_exist():
    names = {p.name for p in PAGES}
    for page in (
        "index",
        "architecture",
        "serving",
        "cpu",
        "gpu",
        "quantization",
        "lora",
        "parallel",
        "cli",
        "troubleshooting",
        "results",
    ):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "results" / "index.html").exists()


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if p.parent.name == "docs" and f" {p.name}" not in nav]
    assert not missing, f"add these pages to mkdocs.yml's nav: {missing}"


def test_readme_is_a_front_page():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"


def test_results_page_is_written_from_the_records():
    page = load_results_page()
    assert (REPO / "docs" / "results.md").read_text() == page.render(), (
        "docs/results.md is stale: run python benchmarks/results_page.py"
    )
    for path in sorted((REPO / "docs" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        assert doc["records"], path.name
        for record in doc["records"]:
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]), (path.name, record)
            assert record["cpu"].strip() and record["command"].strip(), (path.name, record)


def test_results_page_keeps_the_latest_run(tmp_path):
    page = load_results_page()
    old = {"date": "2026-01-01", "cpu": "C", "command": "python x.py", "w": "a", "tok_s": 1}
    new = dict(old, date="2026-02-01", tok_s=2)
    other = dict(old, w="b", tok_s=3)
    (tmp_path / "x.json").write_text(
        json.dumps(
            {
                "benchmark": "x",
                "title": "X",
                "description": "d",
                "configuration": ["w"],
                "records": [new, old, other],
            }
        )
    )
    text = page.render(tmp_path)
    assert "| 2 |" in text and "| 3 |" in text and "| 1 |" not in text
    assert text.index("2026-02-01") < text.index("2026-01-01")  # newest first


def ignored_prefixes() -> list[str]:
    """Anchored folders of .gitignore (/benchmarks/results/ -> benchmarks/results/)."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip().lstrip("/") for line in lines if line.strip().startswith("/")]


def code_text(markdown: str) -> list[str]:
    """The text of every inline code span and fenced code block."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M))
    return blocks + inline


def repository_paths(markdown: str) -> set[str]:
    top = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    paths = set()
    for text in code_text(markdown):
        for word in text.split():
            word = word.strip("'\"(),;[]{}").split("::")[0].rstrip(":.")
            if "/" not in word or any(c in word for c in "<>*~$|=") or "://" in word:
                continue
            if word.startswith(("/", ".", "-")):
                continue
            if word.split("/")[0] in top or word.endswith(SOURCE_SUFFIXES):
                paths.add(word)
    return paths


def test_paths_in_backticks_exist():
    ignored = ignored_prefixes()
    missing = {
        f"{page.relative_to(REPO)}: {path}"
        for page in PAGES
        for path in repository_paths(page.read_text())
        if not any((path.rstrip("/") + "/").startswith(p) for p in ignored)
        and not (REPO / path).exists()
    }
    assert not missing, f"these paths do not exist (moved? write the new path): {sorted(missing)}"


PACKAGE_DIRS = {"compile_runtime.backends": "backends", "compile_runtime.passes": "passes"}


def module_file(parts: list[str]) -> Path | None:
    """The repository file of a dotted module name, or None."""
    name = ".".join(parts)
    for package, folder in PACKAGE_DIRS.items():
        if name == package or name.startswith(package + "."):
            parts = [folder, *name[len(package) + 1 :].split(".")] if name != package else [folder]
            break
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def unresolved_name(dotted: str) -> bool:
    """True unless ``dotted`` is a module of ours, or a module and a name it defines (a class,
    function or assignment), or a string the module's folder spells out (a logger's name)."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        path = module_file(parts[:i])
        if path is None:
            continue
        rest = parts[i:]
        if not rest:
            return False
        text = path.read_text()
        if len(rest) == 1 and re.search(
            rf"^\s*(?:class|def)\s+{rest[0]}\b|^{rest[0]}\s*[:=]|import .*\b{rest[0]}\b", text, re.M
        ):
            return False
        return not any(f'"{dotted}"' in f.read_text() for f in path.parent.rglob("*.py"))
    return True


def test_module_names_in_backticks_exist():
    missing = {
        f"{page.relative_to(REPO)}: {name}"
        for page in PAGES
        for text in code_text(page.read_text())
        for name in re.findall(r"\bcompile_runtime(?:\.[A-Za-z_]\w*)+", text)
        if unresolved_name(name)
    }
    assert not missing, f"these names do not exist (moved? write the new name): {sorted(missing)}"
    assert unresolved_name("compile_runtime.no_such_module")
    assert not unresolved_name("compile_runtime.models.smollm2.smollm2_gguf")


def test_readme_links_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert not missing, missing


def test_path_check_catches_a_moved_file():
    found = repository_paths(
        "see `benchmarks/vs_vllm.py` and `compile_runtime/ops/cpu_linear.py`, `a/b`\n"
    )
    assert found == {"benchmarks/vs_vllm.py", "compile_runtime/ops/cpu_linear.py"}
    assert not (REPO / "compile_runtime/ops/cpu_linear.py").exists()


ISSUE = re.compile(r"\bissues?\s*(?:#|no\.?\s*)?\d+|(?<![\w&/#])#\d+\b", re.I)


def test_no_issue_numbers():
    cited = {
        f"{page.relative_to(REPO)}: {m.group(0)}"
        for page in PAGES
        for m in ISSUE.finditer(page.read_text())
    }
    assert not cited, f"the docs speak to users, not to the tracker: {sorted(cited)}"
    assert ISSUE.search("as issue 43 says") and ISSUE.search("see #58")
    assert not ISSUE.search("issues a warning") and not ISSUE.search("`&#58;`")


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, code in enumerate(
            re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        ):
            if code.startswith(RUNS_MARK + "\n"):
                blocks.append((f"{page.relative_to(REPO)}[{i}]", code))
    return blocks


def test_there_are_runnable_examples():
    names = [name for name, _ in runnable_blocks()]
    assert any(n.startswith("README.md") for n in names), names
    assert len(names) >= 2, names


class SharedEngine:
    """One engine for every example that asks for the same model and options (each start
    reads the model again): the examples' ``shutdown()`` and ``with`` leave it running, and
    the module's teardown stops it."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture(scope="module")
def example_model(model_dirs, tmp_path_factory) -> str:
    """The suite's tiny local model (random weights, a small tokenizer) with a chat template."""
    from serving import chat_model_dir

    return chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("docs")))


@pytest.fixture(scope="module")
def engines():
    built: dict[str, object] = {}
    yield built
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("name,code", runnable_blocks(), ids=[n for n, _ in runnable_blocks()])
def test_example_runs(name, code, example_model, engines, monkeypatch, capsys):
    import compile_runtime as cr
    import compile_runtime.models.smollm2 as smollm2

    monkeypatch.setattr(smollm2, "smollm2_gguf", lambda *args, **kwargs: example_model)

    real_llm = cr.LLM
    used = []

    def cheap_llm(model, compilation_config=None, **options):
        options.setdefault("max_num_seqs", 4)
        key = json.dumps([model, options], sort_keys=True, default=str)
        if key not in engines:
            engines[key] = real_llm(model, {"mode": "NONE", "cudagraph_mode": "NONE"}, **options)
        used.append(key)
        return SharedEngine(engines[key])

    monkeypatch.setattr(cr, "LLM", cheap_llm)
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})
    assert used, f"{name} built no engine"
    assert capsys.readouterr().out.strip(), f"{name} printed nothing"
