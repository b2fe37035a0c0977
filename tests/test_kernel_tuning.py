"""The CPU linear kernels chosen by measuring them (compile_runtime/cpu/kernel_tuning.py): chosen, saved,
read back with no timing, measured again for another CPU or other shapes, a damaged or
foreign table ignored with one warning; every kernel it may choose computes F.linear."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from compile_runtime.cli.main import main
from compile_runtime.config import CompilationConfig
from compile_runtime.cpu import kernel_tuning
from compile_runtime.cpu import linear as cpu_linear
from compile_runtime.cpu.linear import (
    ROW_BUCKETS,
    bucket_index,
    built_in_kernel,
    candidates,
    run_kernel,
)
from compile_runtime.cpu.packed_weights import lookup
from compile_runtime.models.registry import load_model

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # of the output's largest magnitude


@pytest.fixture
def passes(monkeypatch):
    """The kernel passes timed, counted."""
    counted: list[str] = []
    real = kernel_tuning._time_pass

    def counting(name, x, pairs):
        counted.append(name)
        return real(name, x, pairs)

    monkeypatch.setattr(kernel_tuning, "_time_pass", counting)
    return counted


@pytest.fixture(scope="module")
def model(model_dirs):
    return load_model(model_dirs("llama"), CompilationConfig(), dtype=torch.float32)


def _weights(model) -> dict[str, list[torch.nn.Parameter]]:
    layers = kernel_tuning._float_layers(model)
    return {name: kernel_tuning._weights(group) for name, group in layers.items()}


def _path(root, table) -> str:
    return os.path.join(root, kernel_tuning.FOLDER, f"{table.key}.json")


def test_rows_fall_in_the_bucket_at_or_above_them():
    assert [bucket_index(r) for r in (1, 2, 3, 4, 5, 16, 17, 128, 129, 256, 4096)] == [
        0, 1, 2, 2, 3, 4, 5, 7, 8, 8, 8,
    ]  # fmt: skip
    assert all(ROW_BUCKETS[bucket_index(r)] == r for r in ROW_BUCKETS)


def test_another_kernel_replaces_the_built_in_one_only_by_the_margin():
    assert kernel_tuning._choose({"gemv": 1.0, "onednn": 0.97}, "gemv") == "gemv"
    assert kernel_tuning._choose({"gemv": 1.0, "onednn": 0.90}, "gemv") == "onednn"
    assert kernel_tuning._choose({"onednn": 2.0, "linear": 1.0}, "gemv") == "linear"  # not timed


def test_measures_once_then_reads_the_saved_table(model, tmp_path, passes):
    first = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    assert first.timings > 0 and first.timings == len(passes) and first.complete
    assert os.path.exists(_path(tmp_path, first))
    groups = _weights(model)
    assert sorted(first.shapes) == sorted(groups)
    for name, weights in groups.items():
        choice = first.shapes[name]
        assert choice.weights == len(weights) and len(choice.kernels) == len(ROW_BUCKETS)
        assert all(lookup(w).kernels == tuple(choice.kernels) for w in weights)
        assert set(choice.kernels) <= set(cpu_linear.KERNELS)
    timed = len(passes)
    second = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    assert len(passes) == timed and second.timings == 0  # read, not measured
    assert {n: c.kernels for n, c in second.shapes.items()} == {
        n: c.kernels for n, c in first.shapes.items()
    }


def test_another_cpu_threads_or_shapes_make_another_table(model, tmp_path, passes, monkeypatch):
    first = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    shapes = list(first.shapes)
    assert kernel_tuning.table_key(shapes) == first.key
    assert kernel_tuning.table_key(shapes[:-1]) != first.key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert kernel_tuning.table_key(shapes) != first.key
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(kernel_tuning, "cpu_identity", lambda: "model name\t: Another CPU\n")
    timed = len(passes)
    other = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    assert other.key != first.key and len(passes) > timed and other.cpu == "Another CPU"
    assert len(os.listdir(tmp_path / kernel_tuning.FOLDER)) == 2


@pytest.mark.parametrize(
    "damage", ["not json", "truncated", "foreign", "wrong buckets", "unknown kernel"]
)
def test_a_damaged_or_foreign_table_is_ignored_with_one_warning(
    model, tmp_path, passes, caplog, damage
):
    table = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    path = _path(tmp_path, table)
    text = open(path).read()
    data = json.loads(text)
    if damage == "not json":
        text = "\x00garbage"
    elif damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "foreign":  # another machine's table under this name
        data["key"] = "0" * 24
        text = json.dumps(data)
    elif damage == "wrong buckets":
        next(iter(data["shapes"].values()))["kernels"] = ["gemv"]
        text = json.dumps(data)
    else:
        next(iter(data["shapes"].values()))["kernels"][0] = "fastest"
        text = json.dumps(data)
    with open(path, "w") as f:
        f.write(text)
    timed = len(passes)
    with caplog.at_level(logging.WARNING, logger=kernel_tuning.__name__):
        again = kernel_tuning.tune_linear_kernels(model, root=str(tmp_path))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0].getMessage()
    assert again.timings > 0 and len(passes) > timed  # measured again, and saved whole
    assert kernel_tuning._read(path, table.key, list(table.shapes)) is not None


def test_a_spent_budget_keeps_the_built_in_choices(model):
    groups = _weights(model)
    table = kernel_tuning.measure(groups, "k", budget_s=0.0)
    assert not table.complete and table.timings == 0
    for name, weights in groups.items():
        entry = lookup(weights[0])
        built_in = [built_in_kernel(entry, weights[0].dtype, rows) for rows in ROW_BUCKETS]
        assert table.shapes[name].kernels == built_in


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_it_may_choose_computes_f_linear(dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    entry = cpu_linear.pack_weight(weight) if cpu_linear.can_pack(weight) else None
    for rows in (*ROW_BUCKETS, 3, 300):
        x = torch.randn(rows, 64, dtype=dtype)
        ref = F.linear(x.double(), weight.double(), bias.double())
        ran = []
        for name in candidates(weight, entry, rows):
            out = run_kernel(name, x, weight, entry, bias)
            if out is None:
                continue
            ran.append(name)
            assert out.shape == ref.shape and out.dtype == dtype
            error = (out.double() - ref).abs().max() / ref.abs().max()
            assert error <= TOLERANCE[dtype], (name, rows, float(error))
        assert "linear" in ran


def test_a_tuned_weight_runs_its_kernel_and_keeps_it_when_processed_again(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(40, 24), requires_grad=False)
    layer.linear_kernels = ("linear",) * len(ROW_BUCKETS)  # as the tuning leaves it
    entry = cpu_linear.process_weights_after_loading(layer)
    assert entry.kernels == layer.linear_kernels

    def refuse(*args):
        raise AssertionError("the GEMV ran, not the tuned kernel")

    monkeypatch.setattr(cpu_linear, "gemv_linear", refuse)
    x = torch.randn(1, 24)
    out = torch.ops.compile_runtime.cpu_linear(x, layer.weight, None)
    assert (out - F.linear(x, layer.weight)).abs().max() < 1e-5
    assert cpu_linear.process_weights_after_loading(layer).kernels == entry.kernels  # a reload


def test_an_engine_tunes_at_its_first_start_and_only_then(model_dirs, passes, monkeypatch):
    from compile_runtime.engine.llm import LLM

    monkeypatch.setenv(kernel_tuning.ENV_VAR, "1")
    directory = model_dirs("llama", hidden_size=96)  # shapes no other test tuned
    options = {"max_model_len": 64, "kv_cache_bytes": 2**22}
    with LLM(directory, {"backend": "eager"}, **options) as llm:
        weights = _weights(llm.runner.model)
    assert passes and all(lookup(w).kernels is not None for ws in weights.values() for w in ws)
    timed = len(passes)
    with LLM(directory, {"backend": "eager"}, **options):
        pass
    assert len(passes) == timed
    monkeypatch.setenv(kernel_tuning.ENV_VAR, "0")
    with LLM(directory, {"backend": "eager"}, **options) as llm:
        weights = _weights(llm.runner.model)
        assert all(lookup(w).kernels is None for ws in weights.values() for w in ws)


def test_the_cli_tunes_and_the_cache_listing_shows_the_table(model_dirs, tmp_path, capsys):
    assert main(["tune", "--model", model_dirs("llama"), "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "float32:" in printed and "measured in" in printed
    assert main(["cache", "--cache-dir", str(tmp_path), "list"]) == 0
    listed = capsys.readouterr().out
    assert "kernel tuning" in listed and "float32:" in listed
    table = next((tmp_path / kernel_tuning.FOLDER).iterdir())
    table.write_text("{")
    assert main(["cache", "--cache-dir", str(tmp_path), "list"]) == 0
    assert "cannot be read" in capsys.readouterr().out
