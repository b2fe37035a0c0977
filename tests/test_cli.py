from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import compile_runtime as cr


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_runtime.cli", *args], capture_output=True, text=True
    )


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"compile-runtime {cr.__version__}"


def test_config_show_prints_json_and_resolution():
    out = run_cli("config", "show", "-O", '{"cudagraph_mode": "FULL", "backend": "eager"}')
    assert out.returncode == 0, out.stderr
    body, _, summary = out.stdout.rpartition("# resolved:")
    data = json.loads(body)
    assert data["cudagraph_mode"] == "FULL" and data["backend"] == "eager"
    if torch.cuda.is_available():  # ALWAYS attention support keeps FULL as asked
        assert "cudagraph_mode=FULL (decode=FULL, mixed=FULL)" in summary
    else:  # without CUDA every graph mode resolves to NONE, with a warning
        assert "cudagraph_mode=NONE (decode=NONE, mixed=NONE)" in summary
        assert "CUDA is not available: cudagraph_mode FULL -> NONE" in out.stderr


def test_config_show_bad_input_is_usage_error():
    out = run_cli("config", "show", "-O", '{"mode": "FAST"}')
    assert out.returncode == 2 and "mode" in out.stderr
    assert run_cli("config").returncode == 2


def test_serve_on_a_cpu_runs_the_model_in_a_worker_process(monkeypatch):
    """serve's default executor on a CPU is mp (the step loop off the server's GIL); an
    explicit --distributed-executor-backend is kept."""
    import compile_runtime.server.run as run
    from compile_runtime.cli import main as cli
    from compile_runtime.cli import serve

    seen = []
    monkeypatch.setattr(
        serve, "engine_from_args", lambda args: seen.append(args.distributed_executor_backend)
    )
    monkeypatch.setattr(run, "serve", lambda args, llm: 0)
    assert cli.main(["serve", "--model", "m", "--device", "cpu"]) == 0
    assert cli.main(["serve", "--model", "m", "--device", "cpu", "--distributed-executor-backend",
                     "uni"]) == 0  # fmt: skip
    assert seen == ["mp", "uni"]


def test_quantization_reaches_the_engine(monkeypatch):
    from compile_runtime.cli import main as cli
    from compile_runtime.engine import llm as llm_module

    seen = []
    monkeypatch.setattr(llm_module, "LLM", lambda *a, **kw: seen.append(kw["quantization"]))
    cli.engine_from_args(
        cli.build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"])
    )
    args = ["generate", "--model", "m", "--prompt", "x", "--quantization", "none"]
    cli.engine_from_args(cli.build_parser().parse_args(args))
    assert seen == ["auto", "none"]
    with pytest.raises(SystemExit) as info:  # argparse names the choices
        cli.main(["generate", "--model", "m", "--prompt", "x", "--quantization", "q2"])
    assert info.value.code == 2
