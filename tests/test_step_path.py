"""The files one generate() walks through, counted: the path a newcomer reads stays short, and
runs one way (no file calls back into a file above it on the way down).

One batch-1 ``generate()`` (1 prefill + 5 decode steps) on the tiny Llama, in-process executor,
default compilation config (Inductor pieces, CPU graphs), profiled with ``sys.setprofile``
after a first call has compiled and captured everything.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM

REPO = Path(__file__).resolve().parent.parent
SOURCES = tuple(str(REPO / folder) + "/" for folder in ("compile_runtime", "backends", "passes"))
# Files a batch-1 generate() enters: 44 before issue 42's redesign, 38 after it, 39 when the
# saved program is loaded (program.py); the goal is 20.
MAX_FILES = 39


def walk(run, roots: tuple[str, ...] = SOURCES) -> tuple[Counter[str], set[tuple[str, str]]]:
    """Each file under ``roots`` that ``run()`` enters (how often), and each call that enters a
    file already on its way down (the file, and the files of the stack above it)."""

    def own_file(frame) -> str | None:
        path = frame.f_code.co_filename
        return path.removeprefix(str(REPO) + "/") if path.startswith(roots) else None

    entered: Counter[str] = Counter()
    back_calls: set[tuple[str, str]] = set()

    def profile(frame, event, _arg) -> None:
        if event != "call" or (path := own_file(frame)) is None:
            return
        entered[path] += 1
        down: list[str] = []  # the project files of the stack, outermost first, runs merged
        caller = frame.f_back
        while caller is not None:
            if (above := own_file(caller)) and (not down or down[-1] != above):
                down.append(above)
            caller = caller.f_back
        down.reverse()
        if path in down and down[-1] != path:
            back_calls.add((path, " > ".join(down)))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered, back_calls


def test_walk_sees_a_back_call(tmp_path):
    (tmp_path / "below.py").write_text("def call(f):\n    return f()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import below
    finally:
        sys.path.remove(str(tmp_path))
    roots = (__file__, str(tmp_path) + "/")
    entered, back_calls = walk(lambda: below.call(lambda: None), roots)
    assert entered[str(tmp_path / "below.py")] == 1
    assert [path for path, _ in back_calls] == ["tests/test_step_path.py"]
    assert walk(lambda: below.call(dict), roots)[1] == set()  # down only: no back call


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = LLM(model_dirs("llama"), max_num_seqs=4, max_num_batched_tokens=64, kv_cache_bytes=2**24)
    yield llm
    llm.shutdown()


def test_one_generate_walks_few_files_one_way(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for _ in range(2):  # compiles, then captures (a size's graph at its second use)
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    entered, back_calls = walk(lambda: llm.generate([[5, 6, 7]], params, use_tqdm=False))
    assert llm.last_stats.steps == 6  # 1 prefill + 5 decode steps
    assert "compile_runtime/engine/llm.py" in entered, "the profile saw none of the package"
    listing = "\n".join(f"{n:5d} {path}" for path, n in entered.most_common())
    assert len(entered) <= MAX_FILES, f"{len(entered)} files entered:\n{listing}"
    assert not back_calls, "calls back into a file above: " + "; ".join(
        f"{path} from {down}" for path, down in sorted(back_calls)
    )
