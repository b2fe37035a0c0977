"""The traced program saved beside its pieces: a warm start runs it with no trace and no
compile, and anything it cannot be trusted for is a miss that traces again."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import textwrap

import pytest
import torch

import compile_runtime as cr
from compile_runtime.cache import manage
from compile_runtime.compiler import saved_program
from testing.transformer import build_transformer

SHAPE = dict(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, intermediate=128, vocab=100)


def counts() -> tuple[int, int, int]:
    c = cr.compilation_counter
    return c.num_graphs_seen, c.num_backend_compilations, c.num_programs_loaded


def delta(before: tuple[int, int, int]) -> dict[str, int]:
    changes = (a - b for a, b in zip(counts(), before, strict=True))
    return dict(zip(("traces", "compiles", "programs"), changes, strict=True))


def run(model, n: int) -> torch.Tensor:
    torch.manual_seed(n)
    with torch.no_grad():
        return model(torch.randint(0, SHAPE["vocab"], (n,)), torch.arange(n))


def fresh_model(config):
    torch.manual_seed(0)
    return build_transformer(config, **SHAPE)


def test_warm_start_runs_the_saved_program(tmp_path):
    config = cr.CompilationConfig(backend="inductor", cache_dir=str(tmp_path))
    cold = fresh_model(config)
    before = counts()
    expected = [run(cold, n) for n in (9, 1, 4)]
    assert delta(before) == {"traces": 1, "compiles": 3, "programs": 0}
    del cold
    warm = fresh_model(config)
    before = counts()
    got = [run(warm, n) for n in (9, 1, 4)]
    assert delta(before) == {"traces": 0, "compiles": 0, "programs": 1}
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    record = cr.compiler.decorator.compiled_model(warm)
    assert [p.is_splitting_op for p in record.pieces] == [False, True, False, True, False]


def test_a_second_model_alive_beside_the_first_loads_its_program(tmp_path):
    """Layer names belong to a model: a second instance traces nothing and compiles nothing."""
    config = cr.CompilationConfig(backend="inductor", cache_dir=str(tmp_path))
    first = fresh_model(config)
    expected = run(first, 5)
    before = counts()
    second = fresh_model(config)
    got = run(second, 5)
    assert delta(before) == {"traces": 0, "compiles": 0, "programs": 1}
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(run(first, 5), expected, rtol=0, atol=0)  # each its own layers


def test_a_second_engine_in_one_process_loads_the_first_ones_cache_entry(model_dirs):
    model_dir = model_dirs("llama")
    prompts = ["hello world", "the cat"]
    params = cr.SamplingParams(temperature=0.0, max_tokens=5)
    inductor = {"backend": "inductor"}
    first = cr.LLM(model_dir, inductor, dtype="float32", max_model_len=64)
    expected = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    before = counts()
    second = cr.LLM(model_dir, inductor, dtype="float32", max_model_len=64)
    assert delta(before) == {"traces": 0, "compiles": 0, "programs": 1}
    assert [
        o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)
    ] == expected
    assert [
        o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)
    ] == expected
    second.shutdown()
    first.shutdown()


def test_a_warm_cpu_start_runs_a_small_first_forward_not_the_largest_step(model_dirs):
    """The cold start traces at CPU_TRACE_TOKENS (not max_num_batched_tokens); a warm one (its
    saved program found before the first forward) runs FIRST_FORWARD_TOKENS, and its tokens
    are the same."""
    from compile_runtime.worker.startup import CPU_TRACE_TOKENS, FIRST_FORWARD_TOKENS

    options = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=512)
    config = {"backend": "inductor", "cudagraph_mode": "NONE", "compile_sizes": []}
    params = cr.SamplingParams(temperature=0.0, max_tokens=5)
    engines = [cr.LLM(model_dirs("llama"), config, **options) for _ in range(2)]
    times = [llm.executor.driver_runner.startup for llm in engines]
    assert times[1].saved_program and times[1].first_forward_tokens == FIRST_FORWARD_TOKENS
    assert times[0].first_forward_tokens in (CPU_TRACE_TOKENS, FIRST_FORWARD_TOKENS)  # or warm
    assert f"{FIRST_FORWARD_TOKENS} tokens run" in times[1].summary()
    tokens = [
        [o.outputs[0].token_ids for o in llm.generate(["hi there"], params, use_tqdm=False)]
        for llm in engines
    ]
    assert tokens[0] == tokens[1]
    for llm in engines:
        llm.shutdown()


def test_a_model_attribute_the_trace_bakes_in_changes_the_program_key():
    config = cr.CompilationConfig(backend="eager")
    first = saved_program.model_fingerprint(fresh_model(config))
    model = fresh_model(config)  # the same layer names once the first is gone
    assert saved_program.model_fingerprint(model) == first
    model.norm.eps *= 2
    assert saved_program.model_fingerprint(model) != first


def test_an_argument_the_trace_cannot_key_is_not_saved():
    with pytest.raises(saved_program.NotSaveable, match="'options' is a dict"):
        saved_program.argument_kinds({"x": torch.ones(2), "options": {}}, {"x": 0})
    kinds = saved_program.argument_kinds({"x": torch.ones(3, 4), "flag": True}, {"x": 0})
    assert kinds == {"x": {"tensor": [["*", 4], "torch.float32", "cpu"]}, "flag": {"value": True}}


MODEL_SOURCE = """
import torch
import compile_runtime as cr

SCALE = {scale}


@cr.compile
class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * SCALE
"""


def write_model(path, scale: float):
    path.write_text(textwrap.dedent(MODEL_SOURCE.format(scale=scale)))


def test_a_changed_source_file_is_a_miss_named_in_the_log_and_by_explain(
    tmp_path, monkeypatch, caplog
):
    module_dir = tmp_path / "src"
    module_dir.mkdir()
    module_file = module_dir / "scaled_model_for_program_test.py"
    write_model(module_file, 2.0)
    monkeypatch.syspath_prepend(str(module_dir))
    module = importlib.import_module("scaled_model_for_program_test")
    cache = tmp_path / "cache"
    config = cr.CompilationConfig(backend="inductor", cache_dir=str(cache))
    x = torch.randn(3, 8)

    def start():
        torch.manual_seed(0)
        with cr.set_compilation_config(config):
            model = module.Scaled()
        before = counts()
        with torch.no_grad():
            out = model(x)
        return out, delta(before)

    first, d = start()
    assert d["traces"] == 1
    again, d = start()
    assert d == {"traces": 0, "compiles": 0, "programs": 1}
    write_model(module_file, 3.0)  # the same shapes: only the source says it changed
    module = importlib.reload(module)
    with caplog.at_level(logging.WARNING):
        changed, d = start()
    assert d["traces"] == 1 and d["programs"] == 0
    assert "scaled_model_for_program_test.py changed since the program was saved" in caplog.text
    torch.testing.assert_close(changed, first * 1.5)
    old, new = sorted(manage.key_dirs(str(cache)), key=lambda k: (cache / k).stat().st_mtime)
    diff = manage.explain(manage.factors_of(str(cache), old), manage.factors_of(str(cache), new))
    assert "sources.scaled_model_for_program_test.py" in [path for path, _, _ in diff]
    sys.modules.pop("scaled_model_for_program_test", None)


def test_a_damaged_program_traces_again_and_is_saved_anew(tmp_path, caplog):
    config = cr.CompilationConfig(backend="inductor", cache_dir=str(tmp_path))
    expected = run(fresh_model(config), 5)
    (pickle_file,) = tmp_path.glob("*/rank_0/*/program-*.pkl")
    pickle_file.write_bytes(b"not a pickle")
    before = counts()
    with caplog.at_level(logging.WARNING):
        got = run(fresh_model(config), 5)
    assert delta(before)["traces"] == 1 and "does not load" in caplog.text
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    before = counts()
    run(fresh_model(config), 5)
    assert delta(before) == {"traces": 0, "compiles": 0, "programs": 1}
    (record,) = tmp_path.glob("*/rank_0/*/program-*.json")
    assert json.loads(record.read_text())["output"] == "single"


def test_the_engine_starts_warm_from_its_saved_program(model_dirs, tmp_path):
    """Two `compile-runtime generate` processes: the second neither traces nor compiles, gives
    the same tokens, and its start-up line says so."""
    import os
    import subprocess

    env = {**os.environ, "COMPILE_RUNTIME_CACHE_DIR": str(tmp_path / "cache")}
    command = [
        sys.executable,
        "-m",
        "compile_runtime.cli",
        "generate",
        "--model",
        model_dirs("llama"),
        "--prompt",
        "hello world",
        "--max-tokens",
        "6",
        "--max-model-len",
        "64",
        "-O",
        '{"backend": "inductor"}',
    ]
    runs = [subprocess.run(command, capture_output=True, text=True, env=env) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    cold, warm = (r.stdout.splitlines() for r in runs)
    assert cold[0] == warm[0]  # the same generated text
    assert "trace" in cold[-1] and "compile" in cold[-1]
    assert "saved program" in warm[-1] and "no trace, no compile" in warm[-1]
