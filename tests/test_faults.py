"""The fault matrix, end to end: what a user can get wrong or break, and what they see.

A damaged compile cache (every file kind of an entry), Inductor options, a downgraded
cudagraph_mode nobody would see, CLI input that must end in one line and not a
traceback, and bad requests or a failed step that must not poison the engine.
Model-level faults have their own files: tests/test_softcap.py (attention arguments
the adapter cannot honour), tests/test_trace_guards.py (None-patterns, splitting ops),
tests/test_models_native.py (configs the native models fall back on).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from unittest import mock

import pytest
import torch
from compile_runtime.backends.compiler import CompiledPiece, EagerAdaptor
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

import compile_runtime as cr
import compile_runtime.compiler.graph_compiler
from compile_runtime.cache import manage
from compile_runtime.cache.key import compute_key
from compile_runtime.cli.main import format_error, main
from compile_runtime.config import (
    AttentionCGSupport,
    CompilationMode,
    ConfigError,
    CUDAGraphMode,
    EngineConfig,
    RunnerConfig,
    resolve_cudagraph_mode,
)
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.core import StepFailedError
from compile_runtime.engine.llm import LLM
from testing.toy import SumAttention

counter = cr.compilation_counter
NUM_PIECES = 3  # FaultModel: first, middle (shared by the layer boundary), last


# ---- a model and an eager adaptor whose pieces persist -------------------------------


class FaultLayer(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        # Own layer names: a live model elsewhere must not rename ours (it would change the key).
        self.attn = SumAttention(f"test_faults.layers.{index}.attn")
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(torch.relu(self.attn(q, k, v)))


@cr.compile
class FaultModel(nn.Module):
    def __init__(self, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(FaultLayer(i) for i in range(num_layers))
        self.norm = nn.LayerNorm(8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class SavedEagerAdaptor(EagerAdaptor):
    """The eager adaptor with a cache: a piece is saved as its pickled FX graph (no Inductor)."""

    name = "saved_eager"
    can_save = True

    def compile(self, graph, example_inputs, runtime_shape):
        return CompiledPiece(
            fn=super().compile(graph, example_inputs, runtime_shape).fn, handle=graph
        )

    def save(self, piece, path):
        with open(path, "wb") as f:
            pickle.dump(piece.handle, f)
        return {}

    def load(self, path, meta):
        with open(path, "rb") as f:
            return pickle.load(f)


IDS = torch.arange(7) % 32


def start(cache_dir, num_layers: int = 2, **config) -> tuple[int, int, torch.Tensor]:
    """One start in a fresh model: (pieces compiled, pieces loaded, output)."""
    config = cr.CompilationConfig(backend="eager", cache_dir=str(cache_dir), **config)
    before = counter.clone()
    with mock.patch.object(
        compile_runtime.compiler.graph_compiler, "make_adaptor", lambda *a: SavedEagerAdaptor()
    ):
        torch.manual_seed(0)
        with cr.set_compilation_config(config):
            model = FaultModel(num_layers).eval()
        with torch.no_grad():
            out = model(IDS)
    del model
    gc.collect()  # its attention layers unregister, so the next start traces the same names
    return (
        counter.num_eager_compiles - before.num_eager_compiles,
        counter.num_compiled_artifacts_loaded - before.num_compiled_artifacts_loaded,
        out,
    )


@pytest.fixture
def cli(capsys):
    """Run ``compile-runtime ARGS`` in this process: (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], err
    return lines[0]


# ---- every file of a cache entry, damaged --------------------------------------


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache with two entries (A: no compile sizes, B: compile size 4) and A's output."""
    root = tmp_path_factory.mktemp("warm")
    compiled, loaded, out = start(root)
    assert (compiled, loaded) == (NUM_PIECES, 0)
    start(root, compile_sizes=[4])
    entries = manage.list_entries(str(root))
    assert len(entries) == 2 and all(not e.problem for e in entries)
    return root, out


def _entry(root, sizes: list[int]) -> manage.EntryInfo:
    (entry,) = [e for e in manage.list_entries(str(root)) if e.num_shapes == 1 + len(sizes)]
    return entry


def _edit_json(path, change) -> None:
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump(change(data), f)


def _damage(kind: str, entry: manage.EntryInfo) -> None:
    key_dir = os.path.dirname(os.path.dirname(entry.path))
    artifact = os.path.join(key_dir, sorted(r["artifact"] for r in entry.artifacts.values())[0])
    if kind == "index.json garbage":
        open(os.path.join(entry.path, "index.json"), "w").write('{"artifacts": {')
    elif kind == "index.json wrong shape":
        _edit_json(os.path.join(entry.path, "index.json"), lambda d: {"artifacts": {"x/y/z": 1}})
    elif kind == "meta.json garbage":
        open(os.path.join(entry.path, "meta.json"), "wb").write(b"\x89PNG\x00\xff")
    elif kind == "meta.json wrong shape":
        _edit_json(os.path.join(entry.path, "meta.json"), lambda d: {**d, "hits": "many"})
    elif kind == "key_factors.json garbage":
        open(os.path.join(key_dir, "key_factors.json"), "w").write("")
    elif kind == "key_factors.json edited":
        _edit_json(os.path.join(key_dir, "key_factors.json"), lambda d: {**d, "world_size": 8})
    elif kind == "artifact truncated":
        with open(artifact, "r+b") as f:
            f.truncate(os.path.getsize(artifact) // 2)
    elif kind == "artifact missing":
        os.unlink(artifact)
    elif kind == "computation_graph.py garbage":
        open(os.path.join(entry.path, "computation_graph.py"), "wb").write(b"\x00" * 10)
    elif kind == "kernel damaged":  # Inductor's CPU kernels ship with an entry
        rel = "test_faults/kernel.so"
        os.makedirs(os.path.join(key_dir, "kernels", "test_faults"))
        open(os.path.join(key_dir, "kernels", rel), "w").write("not the kernel")
        record = {"sha256": "0" * 64, "bytes": 3}
        _edit_json(
            os.path.join(entry.path, "index.json"), lambda d: {**d, "kernels": {rel: record}}
        )
    else:
        raise AssertionError(kind)


# kind -> (a start recompiles, what start-up warns, the CLI problem, verify --fix moves)
KINDS = {
    "index.json garbage": (True, "index.json is damaged", "index.json is damaged", "entry"),
    "index.json wrong shape": (True, "index.json is damaged", "index.json is damaged", "entry"),
    "meta.json garbage": (True, "meta.json is damaged", "meta.json is damaged", "entry"),
    "meta.json wrong shape": (True, "meta.json is damaged", "meta.json is damaged", "entry"),
    # The start knows the factors its key hashes: it writes them again and loads every piece.
    "key_factors.json garbage": (False, "writing it again", "key_factors.json is damaged", "key"),
    "key_factors.json edited": (False, "writing it again", "not to its key", "key"),
    "artifact truncated": (True, "is damaged", "bytes, expected", "entry"),
    "artifact missing": (True, "is damaged", "is missing", "entry"),
    # Readable documentation only: rewritten by every start, never read to load a piece.
    "computation_graph.py garbage": (False, None, None, None),
    "kernel damaged": (False, "Inductor will rebuild it", "fails its sha256", "entry"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_damaged_entry_file_recompiles_at_start(kind, warm, tmp_path, caplog):
    recompiles, warning, _, _ = KINDS[kind]
    root = tmp_path / "cache"
    shutil.copytree(warm[0], root)
    _damage(kind, _entry(root, []))
    with caplog.at_level(logging.WARNING, logger="compile_runtime"):
        compiled, loaded, out = start(root)
    assert torch.equal(out, warm[1])
    assert compiled + loaded == NUM_PIECES
    if recompiles:
        assert compiled > 0
    else:
        assert compiled == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warning in warnings[0], warnings
    # Whatever was damaged is whole again (a kernel: Inductor rebuilds it in its own cache),
    # and the other entry was never touched.
    if kind != "kernel damaged":
        assert all(r["ok"] for r in manage.verify(str(root)))
    with open(os.path.join(_entry(root, []).path, "computation_graph.py")) as f:
        assert f.read().startswith("# Split graph")
    assert start(root, compile_sizes=[4])[:2] == (0, 2 * NUM_PIECES)


@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v[2]])
def test_cache_commands_report_damage_in_one_line_and_fix_moves_it_aside(kind, warm, tmp_path, cli):
    _, _, problem, moves = KINDS[kind]
    root = tmp_path / "cache"
    shutil.copytree(warm[0], root)
    damaged = _entry(root, [])
    good = _entry(root, [4])
    _damage(kind, damaged)
    key_dir = os.path.dirname(os.path.dirname(damaged.path))
    bad_path = key_dir if moves == "key" else damaged.path
    cache = ("cache", "--cache-dir", str(root))

    code, out, err = cli(*cache, "list")
    assert code == 0 and err == "" and good.key in out
    corrupt = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    if "json" in kind:  # list reads the JSON files; it checksums nothing
        assert len(corrupt) == 1 and bad_path in corrupt[0] and problem in corrupt[0]
        assert "verify --fix" in corrupt[0]
    else:
        assert corrupt == []
    code, out, err = cli(*cache, "show", damaged.key)
    assert code == 0 and err == ""
    if "json" in kind:
        assert sum(line.strip().startswith("CORRUPT") for line in out.splitlines()) == 1

    code, out, _ = cli(*cache, "verify")
    assert code == 1 and "1 corrupt" in out
    (row,) = [line for line in out.splitlines() if "CORRUPT" in line]
    assert bad_path in row and problem in row

    code, out, _ = cli(*cache, "verify", "--fix", "--json")
    report = json.loads(out)
    assert code == 0
    (moved,) = [r for r in report if not r["ok"]]
    assert moved["path"] == bad_path and os.path.exists(moved["quarantined_to"])
    assert all(r["ok"] for r in manage.verify(str(root)))
    remaining = manage.list_entries(str(root))
    assert [e.path for e in remaining] == [good.path]  # nothing else was lost
    assert start(root, compile_sizes=[4])[:2] == (0, 2 * NUM_PIECES)


def test_cache_dir_that_is_a_file_is_an_error_not_an_empty_cache(tmp_path, cli):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    code, out, err = cli("cache", "--cache-dir", str(path), "list")
    assert code == 2 and out == "" and "no entries" not in err
    assert "is a file" in one_line_error(err) and str(path) in err
    with pytest.raises(manage.CacheError, match="is a file"):
        start(path)


def _archive(tmp_path, files: dict[str, object]) -> str:
    """A .tar.gz holding one key directory with these JSON files."""
    factors = files.get("key_factors.json", {"device": "cpu"})
    key_dir = tmp_path / "src" / compute_key(factors)
    for name, data in files.items():
        (key_dir / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (key_dir / name).write_text(json.dumps(data))
    archive = str(tmp_path / "entry.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(key_dir, arcname=key_dir.name)
    return archive


@pytest.mark.parametrize(
    "files, message",
    [
        ({"key_factors.json": {"device": "cpu"}}, "has no 'versions'"),
        ({"rank_0/M/index.json": {"artifacts": {}}}, "key_factors.json is missing"),
    ],
)
def test_import_of_an_archive_missing_fields_is_one_line(files, message, tmp_path, cli):
    archive = _archive(tmp_path, files)
    code, out, err = cli("cache", "--cache-dir", str(tmp_path / "c"), "import", archive)
    assert code == 2 and message in one_line_error(err)
    assert manage.key_dirs(str(tmp_path / "c")) == []


# ---- Inductor options -------------------------------------------------------------


@pytest.mark.parametrize(
    "options, hint",
    [
        ({"fx_graph_cach": False}, "did you mean 'fx_graph_cache'"),
        ({"max_autotune": True, "triton.cudagraph": True}, "did you mean 'triton.cudagraphs'"),
        ({"triton": {"cudagraphs": True}}, "dotted keys"),
        ({"no_such_option_anywhere": 1}, "torch._inductor.config"),
    ],
)
def test_unknown_inductor_option_is_rejected_at_config_time(options, hint):
    with pytest.raises(ValidationError) as info:
        cr.CompilationConfig(inductor_compile_config=options)
    message = format_error(info.value)
    bad = [k for k in options if k not in ("max_autotune",)][0]
    assert repr(bad) in message and hint in message and "\n" not in message


def test_valid_inductor_options_pass():
    options = {"fx_graph_cache": False, "triton.cudagraphs": False, "max_autotune": False}
    assert cr.CompilationConfig(inductor_compile_config=options).inductor_compile_config == options


@pytest.mark.slow
def test_inductor_without_fx_graph_cache_runs_warns_once_and_saves_nothing(tmp_path, caplog):
    config = cr.CompilationConfig(
        backend="inductor",
        cache_dir=str(tmp_path),
        inductor_compile_config={"fx_graph_cache": False},
    )
    torch.manual_seed(0)
    with cr.set_compilation_config(config):
        model = FaultModel(num_layers=1).eval()
    torch.manual_seed(0)
    with cr.set_compilation_config(cr.CompilationConfig(mode="NONE")):
        reference = FaultModel(num_layers=1).eval()
    before = counter.clone()
    with caplog.at_level(logging.WARNING, logger="compile_runtime"), torch.no_grad():
        out = model(IDS)
    torch.testing.assert_close(out, reference(IDS))
    assert counter.num_inductor_compiles - before.num_inductor_compiles == 2
    assert counter.num_compiled_artifacts_saved == before.num_compiled_artifacts_saved
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("compile_runtime")]
    assert len(ours) == 1 and "fx_graph_cache=False" in ours[0]
    assert "compile again at the next start" in ours[0]
    assert manage.list_entries(str(tmp_path)) == []  # no empty entry that would never hit


# ---- an explicit cudagraph_mode that is downgraded is a WARNING -------------------


@pytest.mark.parametrize("explicit, level", [(True, logging.WARNING), (False, logging.INFO)])
def test_downgrade_of_an_explicit_mode_warns(explicit, level, caplog):
    with caplog.at_level(logging.INFO, logger="compile_runtime.config"):
        mode = resolve_cudagraph_mode(
            CUDAGraphMode.FULL_AND_PIECEWISE,
            compilation_mode=CompilationMode.PIECEWISE,
            min_cg_support=AttentionCGSupport.NEVER,
            attention_split=True,
            cuda_available=True,
            explicit=explicit,
        )
    assert mode == CUDAGraphMode.PIECEWISE
    (record,) = caplog.records
    assert record.levelno == level and "FULL_AND_PIECEWISE -> PIECEWISE" in record.getMessage()


# ---- the CLI answers in one line ------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-tokens", "0"),
        ("--max-num-seqs", "-1"),
        ("--max-num-batched-tokens", "0"),
        ("--max-model-len", "0"),
        ("--tensor-parallel-size", "0"),
        ("--num-threads", "0"),
        ("--top-k", "-1"),
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--temperature", "-0.5"),
        ("--max-tokens", "many"),
        ("--device", "bogus"),
    ],
)
def test_generate_rejects_bad_sizes_before_the_model_loads(flag, value, cli):
    # No such model directory: an answer naming the flag proves nothing was loaded first.
    code, out, err = cli("generate", "--model", "/nonexistent", "--prompt", "hi", flag, value)
    assert code == 2 and out == ""
    assert f"argument {flag}" in one_line_error(err) and "--help" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_generate_device_cuda_without_cuda(cli):
    code, _, err = cli("generate", "--model", "/nonexistent", "--prompt", "hi", "--device", "cuda")
    assert code == 2 and "use --device cpu" in one_line_error(err)


@pytest.fixture
def model_copy(model_dirs, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dirs("llama"), path)
    return path


EAGER_CLI = ("-O", json.dumps({"backend": "eager", "cudagraph_mode": "NONE"}))


def test_generate_with_corrupt_config_json(model_copy, cli):
    (model_copy / "config.json").write_text('{"model_type": "llama",')
    code, _, err = cli("generate", "--model", str(model_copy), "--prompt", "hi", *EAGER_CLI)
    assert code == 2 and "config.json" in one_line_error(err)


def test_generate_with_truncated_safetensors(model_copy, cli):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = cli("generate", "--model", str(model_copy), "--prompt", "hi", *EAGER_CLI)
    line = one_line_error(err)
    assert code == 2 and str(weights) in line and "truncated" in line


def test_generate_max_model_len_reaches_the_engine(model_dirs, cli):
    args = ("--prompt", "hi", "--max-tokens", "8", "--max-model-len", "6", *EAGER_CLI)
    code, _, err = cli("generate", "--model", model_dirs("llama"), *args)
    assert code == 2 and "max_model_len=6" in one_line_error(err)


def test_explain_nonexistent_model(tmp_path, cli):
    code, _, err = cli("cache", "--cache-dir", str(tmp_path), "explain", "--model", "/nonexistent")
    assert code == 2 and "/nonexistent" in one_line_error(err)


def test_pydantic_errors_become_one_line_per_field(cli):
    code, _, err = cli("config", "show", "-O", '{"mode": "FAST", "compile_sizes": [0]}')
    line = one_line_error(err)
    assert code == 2 and line.startswith("compile-runtime: error: CompilationConfig: ")
    assert "mode: unknown CompilationMode 'FAST'" in line
    assert "compile_sizes: size 0 is not positive" in line and "pydantic.dev" not in line


def test_unexpected_errors_keep_their_traceback(tmp_path, cli):
    """A bug must stay visible: only known user errors are shortened."""
    with mock.patch.object(manage, "list_entries", side_effect=RuntimeError("a bug")):
        with pytest.raises(RuntimeError, match="a bug"):
            main(["cache", "--cache-dir", str(tmp_path), "list"])


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "compile_runtime.cli", "cache", "--cache-dir", str(path), "list"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("compile-runtime: error: ") and "is a file" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---- bad requests and failed steps: the engine stays usable ----------------------------
# One bad request or one failed step must not poison the engine; bad sizes fail at start-up.
#
# One engine serves the whole module: each test leaves it as a user would find it
# after an error, and checks that the next call still gives transformers' greedy
# tokens with every KV cache block back in the pool.

PROMPTS = [[5, 6, 7], list(range(10, 30)), [100]]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
VOCAB = 512  # testing.model_dirs' vocab_size
EAGER = {"backend": "eager", "cudagraph_mode": "NONE"}


@pytest.fixture(scope="module")
def llm(model_dirs):
    # block_size 4: the prompts hold several blocks each, so a leaked block shows. No prefix
    # cache: every good call must take the same steps (test_prefix_cache covers faults with it).
    return LLM(
        model_dirs("llama"),
        EAGER,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def expected(model_dirs):
    hf = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32).eval()
    return [
        hf.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def good_call_steps(llm, expected):
    """Steps of the good call on the fresh engine: later good calls must match it."""
    assert_good_call(llm, expected)
    return llm.last_stats.steps


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running, every block back in the pool."""
    s = llm.core.scheduler
    assert not s.has_unfinished() and not s.requests
    assert s.block_pool.num_free == s.block_pool.num_usable


def assert_good_call(llm: LLM, expected, steps: int | None = None) -> None:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.last_stats.output_tokens == len(PROMPTS) * MAX_TOKENS
    if steps is not None:
        assert llm.last_stats.steps == steps
    assert_idle(llm)
    # The runner holds at most this call's requests (finished ones leave at the next step).
    assert set(llm.runner.input_batch.requests) <= {o.request_id for o in outputs}
    assert llm.runner.execute_state is None


# ---------------------------------------------------------------- rejected before queueing


@pytest.mark.parametrize(
    "prompts,params,match",
    [
        ([[5, VOCAB, 7]], GREEDY, rf"prompt token id {VOCAB} \(position 1\) is outside the vocab"),
        ([[5, -1]], GREEDY, r"prompt token id -1 .*outside the vocabulary \[0, 512\)"),
        (
            [[5, 6]],
            SamplingParams(temperature=0, logit_bias={VOCAB + 3: 1.0}),
            rf"logit_bias token id {VOCAB + 3} is outside the vocabulary",
        ),
        ([[5, 6]], SamplingParams(logit_bias={-2: 1.0}), "logit_bias token id -2"),
        ([[]], GREEDY, "empty prompt"),
        (
            [list(range(60))],
            GREEDY,
            r"prompt of 60 tokens plus max_tokens=6 exceeds max_model_len=64",
        ),
        # The third of three is bad: the first two must not stay queued either.
        ([[5, 6], [7, 8], [9, 10**6]], GREEDY, r"prompt 2 of 3: .*token id 1000000"),
        (
            [[5, 6], [7, 8], [9]],
            [GREEDY, GREEDY, SamplingParams(logit_bias={VOCAB: -1.0})],
            r"prompt 2 of 3: .*logit_bias token id 512",
        ),
    ],
)
def test_bad_request_queues_nothing_and_engine_stays_correct(
    llm, expected, good_call_steps, prompts, params, match
):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    assert_good_call(llm, expected, good_call_steps)


# ---------------------------------------------------------------- a step that raises


def fail_once(monkeypatch, obj, name: str, at_call: int) -> list[int]:
    """Make ``obj.name`` raise on its ``at_call``-th call (from 1), then behave again."""
    original = getattr(obj, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


@pytest.mark.parametrize(
    "where",
    [
        "execute_model",  # before the runner applies the step
        "compute_logits",  # inside the forward step, after the batch took the step's requests
        "sample_on_every_rank",  # in sample_tokens, after execute_model succeeded
    ],
)
@pytest.mark.parametrize("at_call", [1, 3])  # the first prefill; mid-generation
def test_failed_step_aborts_the_call_frees_blocks_and_engine_goes_on(
    llm, expected, good_call_steps, monkeypatch, where, at_call
):
    from compile_runtime.worker import model_runner

    runner = llm.runner
    targets = {"compute_logits": runner.model, "sample_on_every_rank": model_runner}
    calls = fail_once(monkeypatch, targets.get(where, runner), where, at_call)
    with pytest.raises(StepFailedError, match="RuntimeError: injected fault") as exc:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    err = exc.value
    assert err.failed_req_ids and set(err.failed_req_ids) <= set(err.aborted_req_ids)
    assert f"request(s) {', '.join(err.failed_req_ids)} (prompt(s) " in str(err)
    assert "ready for the next generate()" in str(err)
    assert_idle(llm)
    assert runner.execute_state is None
    assert calls[0] >= at_call
    assert_good_call(llm, expected, good_call_steps)


def test_interrupt_mid_generation_leaves_nothing_queued(llm, expected, monkeypatch):
    """Not wrapped (the caller asked to stop), but the call's requests are cleaned up."""

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.runner, "execute_model", interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert_good_call(llm, expected)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 0}, "block_size=0"),
        ({"max_num_batched_tokens": -4}, "max_num_batched_tokens=-4"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes=0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override=1"),
        ({"num_threads": 0}, "num_threads=0"),
        ({"blocksize": 16}, "blocksize: unknown field"),
    ],
)
def test_runner_config_rejects_bad_sizes_in_one_line(kwargs, field):
    with pytest.raises(ConfigError) as exc:
        RunnerConfig(**kwargs)
    message = str(exc.value)
    assert message.startswith(f"RunnerConfig.{field}") and "\n" not in message
    config = RunnerConfig()
    with pytest.raises(ConfigError, match="block_size=0: the configuration is frozen"):
        config.block_size = 0  # decided once: a changed size is a new config
    assert config.block_size == 16


def test_two_bad_fields_give_one_line_each():
    with pytest.raises(ConfigError) as exc:
        RunnerConfig(block_size=0, max_num_seqs=-1)
    lines = str(exc.value).splitlines()
    assert len(lines) == 2 and {line.split("=")[0] for line in lines} == {
        "RunnerConfig.block_size",
        "RunnerConfig.max_num_seqs",
    }


def test_engine_config_checks_device_and_travels_to_workers():
    base = dict(
        model_dir="m", compilation_config=cr.CompilationConfig(), runner_config=RunnerConfig()
    )
    with pytest.raises(ConfigError, match=r"EngineConfig.device='bogus': unknown device .*'cpu'"):
        EngineConfig(**base, device="bogus")
    with pytest.raises(ConfigError, match="EngineConfig.tensor_parallel_size=0"):
        EngineConfig(**base, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="EngineConfig.dtype=torch.int64"):
        EngineConfig(**base, dtype=torch.int64)
    config = EngineConfig(**base, device="cpu", dtype=torch.bfloat16)
    again = pickle.loads(pickle.dumps(config))  # the mp executor sends it to spawned workers
    assert again == config and again.dtype is torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_is_rejected_before_loading(model_dirs):
    with pytest.raises(ConfigError, match=r"device='cuda': CUDA is not available.*device='cpu'"):
        LLM(model_dirs("llama"), EAGER, device="cuda")


def test_max_model_len_past_the_models_positions_is_rejected_at_start_up(model_dirs):
    with pytest.raises(ConfigError) as exc:
        LLM(model_dirs("llama"), EAGER, max_model_len=513)
    message = str(exc.value)
    assert "max_model_len=513" in message and "max_position_embeddings=512" in message
    assert "set max_model_len (--max-model-len) to at most 512" in message and "\n" not in message


def test_bad_llm_sizes_fail_before_start_up(model_dirs):
    with pytest.raises(ConfigError, match="RunnerConfig.block_size=0"):
        LLM(model_dirs("llama"), EAGER, block_size=0)
    with pytest.raises(ConfigError, match="EngineConfig.tensor_parallel_size=0"):
        LLM(model_dirs("llama"), EAGER, tensor_parallel_size=0)


def test_llm_names_a_misspelt_option_before_anything_starts(model_dirs):
    with pytest.raises(
        ConfigError, match=r"LLM\(max_num_seq=\.\.\.\): unknown option; did you mean 'max_num_seqs'"
    ):
        LLM(model_dirs("llama"), EAGER, max_num_seq=4)
