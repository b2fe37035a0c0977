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
# Files a batch-1 generate() enters (prefill, decode, the saved program loaded): a ceiling
# that fails on regression; one concept per file and a Python prefill make ~24 the floor.
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


# One steady batch-1 decode step of the real model (SmolLM2-135M's Q4_1 file, its defaults:
# bf16 activations, CPU graphs), replayed: at most 15 files, 60 calls, no file entered more
# than twice. (Before the step path was trimmed: 97 calls in 27 files, one file 18 times.)
MAX_STEP_FILES = 15
MAX_STEP_CALLS = 60
MAX_STEP_PER_FILE = 2


@pytest.fixture(scope="module")
def real_llm(gguf_path):
    llm = LLM(gguf_path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    yield llm
    llm.shutdown()


def test_one_decode_step_makes_few_calls(real_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    real_llm.generate([[5, 6, 7]], params, use_tqdm=False)  # compiles and captures
    core = real_llm.core
    req = core.make_request([5, 6, 7], params)
    core.check(req)
    core.add([req])
    for _ in range(3):  # the prefill, then decodes until every size on the way is captured
        core.step()
    calls: list[tuple[str, str]] = []

    def profile(frame, event, _arg) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(SOURCES):
            calls.append((path.removeprefix(str(REPO) + "/"), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        out = core.step()
    finally:
        sys.setprofile(None)
    assert out.decode_only and [t[0] for t in out.tokens] == [req.req_id]
    assert real_llm.runner.full_graphs, "the step replayed no FULL graph"
    (_, gives_logits), *_ = real_llm.runner.full_graphs.values()
    assert gives_logits, "the decode graph stops before the LM head"
    entered = Counter(path for path, _ in calls)
    listing = "\n".join(f"{n:5d} {path}" for path, n in entered.most_common())
    listing += "\n" + "\n".join(f"{path} {name}" for path, name in calls)
    assert len(entered) <= MAX_STEP_FILES, f"{len(entered)} files entered:\n{listing}"
    assert len(calls) <= MAX_STEP_CALLS, f"{len(calls)} calls:\n{listing}"
    most = entered.most_common(1)[0][1]
    assert most <= MAX_STEP_PER_FILE, f"a file entered {most} times:\n{listing}"
    core.abort([req.req_id])


def test_the_lm_heads_resolved_kernel_notices_a_weight_written_in_place():
    """The quantized LM head finds its kernel call once (cpu/quant_gemm.py
    ``resolve_quant_linear``), not every step: it gives cpu_linear's logits, and a weight
    written in place afterwards (its version moves) runs unpacked, never read as packed."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    import torch

    from compile_runtime.cpu import quant_formats as qf
    from compile_runtime.cpu.quant_gemm import kernel_available, quant_linear
    from compile_runtime.distributed.vocab import ParallelLMHead

    if not kernel_available():
        pytest.skip("no quantized kernel on this CPU")
    rng = np.random.default_rng(0)
    from gguf.quants import quantize

    weights = rng.standard_normal((40, 64)).astype(np.float32)
    blocks = quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    w = torch.nn.Parameter(torch.from_numpy(qf.from_gguf_blocks(blocks, qf.Q8_0)), False)
    qf.pack_rows(w)  # the parameter's own record, as after loading
    head = ParallelLMHead(40, 64)
    head.weight = w
    head.use_packed_weight = True
    hidden = torch.randn(2, 64)
    for _ in range(2):  # found, then reused
        torch.testing.assert_close(
            head.compute_logits(hidden), quant_linear(hidden, w, None), rtol=0, atol=0
        )
    assert head._resolved[1] is not None
    with torch.no_grad():
        w.copy_(torch.from_numpy(qf.from_gguf_blocks(blocks, qf.Q8_0)))  # row layout again
    assert not qf.is_packed(w)
    torch.testing.assert_close(
        head.compute_logits(hidden), quant_linear(hidden, w, None), rtol=0, atol=0
    )
