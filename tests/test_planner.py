"""Capture sizes planned from a workload: exact optimum, never worse than the default ladder."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

import compile_runtime as cr
from compile_runtime.cli.main import main
from compile_runtime.graphs.dispatcher import CudagraphDispatcher
from compile_runtime.planner import (
    Workload,
    WorkloadError,
    default_ladder_with_k,
    ladder_cost,
    load_workload,
    plan_report,
    plan_sizes,
)
from compile_runtime.planner.capture_sizes import resolve_capture_sizes
from compile_runtime.planner.sizes import default_capture_sizes

histograms = st.dictionaries(st.integers(1, 16), st.integers(1, 50), min_size=1, max_size=8)


def brute_force_waste(histogram: dict[int, int], k: int) -> int:
    """Least padding over every ladder of at most k integer sizes that covers the largest count."""
    top = max(histogram)
    return min(
        ladder_cost(histogram, [*rest, top]).padded_tokens
        for r in range(k)
        for rest in itertools.combinations(range(1, top), r)
    )


@settings(max_examples=150, deadline=None)
@given(histograms, st.integers(1, 5))
def test_plan_equals_brute_force_optimum(histogram, k):
    sizes = plan_sizes(histogram, k)
    assert len(sizes) <= k and sizes == sorted(set(sizes))
    assert max(sizes) == max(histogram)  # every step gets a graph
    assert ladder_cost(histogram, sizes).padded_tokens == brute_force_waste(histogram, k)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.integers(1, 600), st.integers(1, 1000), min_size=1, max_size=60),
    st.integers(1, 70),
    st.randoms(use_true_random=False),
)
def test_plan_never_pads_more_than_a_default_ladder_with_as_many_sizes(histogram, k, rnd):
    report = plan_report(histogram, k, max_size=512)
    plan = report.plan
    assert plan.padded_tokens <= report.default_same_k.padded_tokens
    assert report.default_same_k.num_sizes == plan.num_sizes
    # Same coverage: every step of <= 512 tokens is in a graph in both.
    assert plan.covered_steps == report.default_same_k.covered_steps
    assert plan.covered_steps == sum(c for n, c in histogram.items() if n <= 512)
    # Nor more than any other choice of that many default sizes that covers the same steps.
    if plan.sizes:
        ladder = [s for s in default_capture_sizes(528) if s < plan.sizes[-1]]
        top = next(s for s in default_capture_sizes(528) if s >= plan.sizes[-1])
        rest = rnd.sample(ladder, min(len(ladder), plan.num_sizes - 1))
        assert plan.padded_tokens <= ladder_cost(histogram, [*rest, top]).padded_tokens


def test_more_sizes_than_counts_pads_nothing():
    histogram = {1: 5, 7: 2, 33: 1}
    assert plan_sizes(histogram, 3) == [1, 7, 33]
    assert plan_sizes(histogram, 10) == [1, 7, 33]
    assert ladder_cost(histogram, plan_sizes(histogram, 10)).padded_tokens == 0


def test_steps_above_max_size_are_uncovered_not_planned():
    histogram = {4: 10, 100: 3, 2000: 2}
    report = plan_report(histogram, 2, max_size=512)
    assert report.sizes == [4, 100]
    assert report.plan.uncovered_steps == 2
    assert report.plan.padded_tokens == 0
    assert plan_sizes({2000: 1}, 4, max_size=512) == []


def test_default_baseline_is_thinned_not_truncated():
    # Steps up to 200 tokens: the 4-size default baseline must still cover 200.
    histogram = {n: 1 for n in range(1, 201)}
    baseline = default_ladder_with_k(histogram, 4, 512)
    assert len(baseline) == 4 and baseline[-1] >= 200 and baseline[-1] in default_capture_sizes(512)


def test_plan_sizes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_graphs"):
        plan_sizes({1: 1}, 0)
    with pytest.raises(ValueError, match="max_size"):
        plan_sizes({1: 1}, 1, max_size=0)


# ---- workload files ----------------------------------------------------------------


def recorded(tmp_path, steps):
    rec = Workload()
    for n, decode in steps:
        rec.record(n, decode)
    path = tmp_path / "workload.json"
    rec.save(str(path))
    return str(path)


def test_load_recorded_workload_round_trips(tmp_path):
    path = recorded(tmp_path, [(4, True), (4, True), (37, False), (5, False)])
    w = load_workload(path)
    assert dict(w.decode) == {4: 2} and dict(w.mixed) == {37: 1, 5: 1}
    assert w.num_steps == 4 and w.num_tokens == 50 and w.combined()[4] == 2


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"mixed": {"x": 1}}', "expected a token count"),
        ('{"mixed": {"0": 1}}', ">= 1"),
        ('{"decode": {"3": -1}}', "number of steps"),
        ('{"version": 2, "mixed": {}}', "version 2"),
        ('{"mixed": {}, "decode": {}}', "no steps"),
    ],
)
def test_bad_workload_files_name_the_file_and_the_fix(tmp_path, content, match):
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(WorkloadError, match=match) as info:
        load_workload(path)
    assert str(path) in str(info.value) and "--record-workload" in str(info.value)


def test_plain_histogram_is_read_as_mixed_steps(tmp_path):
    path = tmp_path / "w.json"
    path.write_text('{"3": 2, "9": 1}')
    assert dict(load_workload(path).mixed) == {3: 2, 9: 1}


# ---- auto:FILE in the config --------------------------------------------------------


def test_auto_capture_sizes_plan_at_start_up(tmp_path):
    path = recorded(tmp_path, [(n, True) for n in (1, 2, 3, 3, 5, 17, 40, 40)] + [(700, False)])
    config = cr.CompilationConfig(cudagraph_capture_sizes=f"auto:{path}:3")
    planned = plan_sizes({1: 1, 2: 1, 3: 2, 5: 1, 17: 1, 40: 2}, 3)
    assert resolve_capture_sizes(config) == planned == [5, 17, 40]
    # The config stays a plain string: hashable, serialisable, round-trips.
    again = cr.CompilationConfig.model_validate_json(config.to_json())
    assert again.cudagraph_capture_sizes == f"auto:{path}:3"
    assert again.compute_hash() == config.compute_hash()
    # K defaults to the default ladder's count up to the largest step (here 40: 8 sizes).
    default_k = cr.CompilationConfig(cudagraph_capture_sizes=f"auto:{path}")
    assert resolve_capture_sizes(default_k) == [1, 2, 3, 5, 17, 40]
    # The runner's tokens per step cap the plan (the plan is redone under the cap).
    assert resolve_capture_sizes(default_k, max_num_tokens=20) == [1, 2, 3, 5, 17]
    dispatcher = CudagraphDispatcher(config, max_num_tokens=256)
    dispatcher.initialize_keys(cr.CUDAGraphMode.PIECEWISE)
    assert [dispatcher.padded_size(n) for n in (1, 5, 6, 40, 41)] == [5, 5, 17, 40, None]


@pytest.mark.parametrize(
    "spec, match",
    [("1,2,4", "not understood"), ("auto:", "names no file"), ("auto:w.json:0", "K must be")],
)
def test_bad_auto_specs_are_rejected_when_the_config_is_built(spec, match):
    with pytest.raises(ValueError, match=match):
        cr.CompilationConfig(cudagraph_capture_sizes=spec)


def test_auto_with_a_missing_file_fails_at_start_up_naming_it(tmp_path):
    config = cr.CompilationConfig(cudagraph_capture_sizes=f"auto:{tmp_path}/none.json")
    with pytest.raises(ValueError, match="none.json.*does not exist.*record-workload"):
        resolve_capture_sizes(config)


# ---- CLI ----------------------------------------------------------------------------


def test_plan_sizes_cli_prints_table_and_snippet(tmp_path, capsys):
    path = recorded(tmp_path, [(n % 24 + 1, True) for n in range(200)] + [(300, False)] * 3)
    assert main(["plan-sizes", "--workload", path, "--max-graphs", "4"]) == 0
    out = capsys.readouterr().out
    assert "plan (exact DP)" in out and "default, thinned to 4" in out and "default as is" in out
    assert "cudagraph_capture_sizes=" in out and f"auto:{path}:4" in out

    assert main(["plan-sizes", "--workload", path, "--max-graphs", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    hist = load_workload(path).combined()
    assert data["sizes"] == plan_sizes(hist, 4) and data["sizes"][-1] == 300
    assert data["plan"]["padded_tokens"] <= data["default_same_k"]["padded_tokens"]
    assert data["config"] == {"cudagraph_capture_sizes": data["sizes"]}

    # --max-size below the prefills: those steps are uncovered and said to be.
    assert main(["plan-sizes", "--workload", path, "--max-graphs", "4", "--max-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "3 steps" in out and "run without one" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["plan-sizes", "--workload", "/nonexistent/w.json", "--max-graphs", "4"],
        ["plan-sizes", "--workload", "W", "--max-graphs", "0"],
        ["plan-sizes", "--workload", "W", "--max-graphs", "x"],
        ["plan-sizes", "--max-graphs", "4"],
    ],
)
def test_plan_sizes_cli_bad_arguments_exit_2(argv, capsys):
    try:  # argparse exits; errors found later are returned as the exit status
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


def test_recorded_generation_plans_the_sizes_of_the_next_start(model_dirs, tmp_path):
    from compile_runtime.core.sampling_params import SamplingParams
    from compile_runtime.engine.llm import LLM

    model = model_dirs("llama")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(model, {"backend": "eager"}, **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7], list(range(10, 40)), [100]], params, use_tqdm=False)
    path = str(tmp_path / "recorded.json")
    llm.save_workload(path)
    histogram = load_workload(path).combined()
    assert sum(histogram.values()) == llm.last_stats.steps

    planned = cr.CompilationConfig(backend="eager", cudagraph_capture_sizes=f"auto:{path}:2")
    again = LLM(model, planned, **kw)
    assert again.runner.dispatcher.capture_sizes == plan_sizes(histogram, 2, 64)
    assert again.runner.dispatcher.capture_sizes[-1] == max(histogram)
