"""Packed-weight files: a second start maps the weights its first start processed.

Each case starts three engines on one model: the cache off (the weights read and processed
as always), a fresh cache (the same, then the file written) and the same cache again (the
weights mapped from the file). All three give the same tokens and bit-identical logprobs.
A file that is damaged or made for something else is never used: it is rebuilt with one
warning. A file that cannot be written costs a warning, nothing else.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

import compile_runtime as cr
from compile_runtime.cache import weight_file
from compile_runtime.cpu.quant_gemm import kernel_available

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 30))]


def _run(model: str, cache_dir: str | None, **options) -> tuple[list, list]:
    config = {"backend": "eager"}
    config.update({"cache_dir": cache_dir} if cache_dir else {"disable_cache": True})
    llm = cr.LLM(
        model,
        config,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=128,
        kv_cache_bytes=32 * 2**20,
        **options,
    )
    try:
        params = cr.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [o.outputs[0].logprobs for o in outs]  # (chosen, top 3) at each step
        return tokens, logprobs
    finally:
        llm.shutdown()


def _three_starts(model: str, cache_dir: str, ranks: int = 1, **options) -> None:
    """``ranks`` > 1: the ranks load in worker processes, whose counters are their own; the
    files (one a rank) are counted instead, and must be left as the first start wrote them."""
    in_process = 1 if ranks == 1 else 0
    reference = _run(model, None, **options)
    with cr.compilation_counter.expect(num_weight_files_saved=in_process):
        first = _run(model, cache_dir, **options)
    written = {path: os.stat(path).st_mtime_ns for path in _files(cache_dir)}
    assert len(written) == ranks
    with cr.compilation_counter.expect(
        num_weight_files_saved=0, num_weight_files_mapped=in_process
    ):
        mapped = _run(model, cache_dir, **options)
    assert {path: os.stat(path).st_mtime_ns for path in _files(cache_dir)} == written
    assert first == reference
    assert mapped == reference  # tokens, and logprobs to the last bit


def _files(cache_dir: str) -> list[str]:
    return [path for path, _, _ in weight_file.list_files(cache_dir)]


@pytest.mark.parametrize(
    "dtype, quantization",
    [("float32", "none"), ("bfloat16", "none"), ("float32", "int8")],
)
def test_mapped_weights_give_the_loaded_models_logits(model_dirs, tmp_path, dtype, quantization):
    if quantization == "int8" and not kernel_available():
        pytest.skip("needs the quantized kernel")
    model_dir = model_dirs("llama", tie_word_embeddings=quantization == "int8")
    _three_starts(model_dir, str(tmp_path), dtype=dtype, quantization=quantization)


@pytest.mark.skipif(not kernel_available(), reason="needs the quantized kernel")
def test_real_q4_1_and_q8_0_blocks_map(tmp_path):
    from compile_runtime.models.smollm2 import smollm2_gguf

    try:
        path = smollm2_gguf()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the real model is not here: {e}")
    _three_starts(path, str(tmp_path), dtype="bfloat16")  # Q4_1 linears, a Q8_0 embedding
    ((_, size, header),) = weight_file.list_files(str(tmp_path))
    flags = {t["name"]: t["flags"] for t in header["tensors"]}
    assert "format:Q8_0" in flags["model.embed_tokens.weight"]
    assert {"packed", "format:Q4_1"} <= set(flags["model.layers.0.mlp.down_proj.weight"])
    assert size <= 1.2 * os.path.getsize(path)


@pytest.mark.slow
def test_lora_and_tensor_parallel_ranks_map(model_dirs, tmp_path):
    model_dir = model_dirs("llama")
    _three_starts(model_dir, str(tmp_path / "lora"), dtype="float32", enable_lora=True)
    _three_starts(model_dir, str(tmp_path / "tp"), 2, dtype="float32", tensor_parallel_size=2)


def _only_file(cache_dir: str) -> str:
    (path,) = _files(cache_dir)
    return path


def _damage_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(len(weight_file.MAGIC) + 8 + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 4096)


def _foreign(path: str) -> None:
    """Another key's file under this key's name (a copy from another machine, say)."""
    info = weight_file.read_header(path)
    tensors = weight_file.open_mapped(path, info["key"])
    weight_file.write(
        path, {**info["key"], "cpu": "another"}, [(n, t, f) for n, (t, f) in tensors.items()]
    )


@pytest.mark.parametrize("damage", [_damage_header, _truncate, _foreign])
def test_a_damaged_or_foreign_file_is_rebuilt_with_one_warning(
    model_dirs, tmp_path, damage, caplog
):
    model_dir = model_dirs("llama")
    cache = str(tmp_path)
    reference = _run(model_dir, cache, dtype="float32")
    path = _only_file(cache)
    damage(path)
    with (
        caplog.at_level("WARNING"),
        cr.compilation_counter.expect(num_weight_files_saved=1, num_weight_files_mapped=0),
    ):
        assert _run(model_dir, cache, dtype="float32") == reference
    warnings = [r for r in caplog.records if "packed weights not used" in r.getMessage()]
    assert len(warnings) == 1
    with cr.compilation_counter.expect(num_weight_files_mapped=1):
        assert _run(model_dir, cache, dtype="float32") == reference
    assert _files(cache) == [path]


def test_another_source_file_cpu_or_kernel_gets_its_own_file(model_dirs, tmp_path, monkeypatch):
    from compile_runtime.models import mapped_weights

    model_dir = model_dirs("llama", num_hidden_layers=1)
    cache = str(tmp_path)
    reference = _run(model_dir, cache, dtype="float32")
    monkeypatch.setattr(mapped_weights, "cpu_identity", lambda: "another CPU")
    with cr.compilation_counter.expect(num_weight_files_saved=1, num_weight_files_mapped=0):
        assert _run(model_dir, cache, dtype="float32") == reference
    monkeypatch.setattr(mapped_weights, "amx_available", lambda: True)  # another kernel choice
    with cr.compilation_counter.expect(num_weight_files_saved=1, num_weight_files_mapped=0):
        _run(model_dir, cache, dtype="float32")
    monkeypatch.undo()
    (weights,) = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    stat = os.stat(os.path.join(model_dir, weights))
    os.utime(os.path.join(model_dir, weights), ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with cr.compilation_counter.expect(num_weight_files_saved=1, num_weight_files_mapped=0):
        assert _run(model_dir, cache, dtype="float32") == reference
    assert len(_files(cache)) == 4


def test_a_full_disk_costs_a_warning_and_leaves_no_partial_file(
    model_dirs, tmp_path, monkeypatch, caplog
):
    model_dir = model_dirs("llama", num_hidden_layers=1)
    reference = _run(model_dir, None, dtype="float32")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weight_file.os, "fsync", full)
    with caplog.at_level("WARNING"), cr.compilation_counter.expect(num_weight_files_saved=0):
        assert _run(model_dir, str(tmp_path), dtype="float32") == reference
    assert "packed weights not saved" in caplog.text and "No space left" in caplog.text
    assert os.listdir(weight_file.weights_folder(str(tmp_path))) == []


SHARE_CHILD = r"""
import json, sys
import compile_runtime as cr
llm = cr.LLM(sys.argv[1], {"backend": "eager", "cache_dir": sys.argv[2]}, dtype="float32",
             max_num_seqs=2, max_model_len=128, kv_cache_bytes=32 * 2**20)
llm.generate([[5, 6, 7]], cr.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
usage, current = {}, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and len(fields) >= 5:
        current = fields[-1] if len(fields) >= 6 else None
    elif current and current.endswith(".crw") and len(fields) == 3 and fields[2] == "kB":
        usage[fields[0][:-1]] = usage.get(fields[0][:-1], 0) + int(fields[1]) * 1024
print(json.dumps(usage))
sys.stdout.flush()
sys.stdin.readline()  # holds the mapping until the parent is done
"""


@pytest.mark.slow
def test_a_second_process_shares_the_mapped_pages(model_dirs, tmp_path):
    model_dir = model_dirs("llama", hidden_size=256, intermediate_size=1024)
    cache = str(tmp_path)
    _run(model_dir, cache, dtype="float32")  # writes the file
    path = _only_file(cache)
    stored = sum(t["nbytes"] for t in weight_file.read_header(path)["tensors"])

    def start() -> tuple[subprocess.Popen, dict]:
        proc = subprocess.Popen(
            [sys.executable, "-c", SHARE_CHILD, model_dir, cache],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return proc, json.loads(proc.stdout.readline())

    first, alone = start()
    second, together = start()
    try:
        assert alone["Rss"] >= 0.9 * stored  # every weight read once, from the file's pages
        assert together["Shared_Clean"] >= 0.9 * stored  # the same pages as the first's
        assert together["Private_Dirty"] < 0.1 * stored
    finally:
        for proc in (first, second):
            proc.communicate("\n", timeout=60)


def test_cache_list_shows_and_clear_removes_packed_weights(model_dirs, tmp_path):
    model_dir = model_dirs("llama", num_hidden_layers=1)
    cache = str(tmp_path)
    _run(model_dir, cache, dtype="float32")
    path = _only_file(cache)
    cli = [sys.executable, "-m", "compile_runtime.cli", "cache", "--cache-dir", cache]
    listed = subprocess.run([*cli, "list"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert os.path.basename(path) in listed.stdout and "packed weights" in listed.stdout
    kept = subprocess.run([*cli, "prune", "--older-than", "30d"], capture_output=True, text=True)
    assert kept.returncode == 0 and os.path.exists(path), kept.stderr
    cleared = subprocess.run([*cli, "clear"], capture_output=True, text=True)
    assert cleared.returncode == 0, cleared.stderr
    assert not os.path.exists(path)


def test_a_warm_start_reads_traces_compiles_and_captures_nothing(model_dirs, tmp_path, monkeypatch):
    """The second start of an Inductor-compiled model: weights mapped (the checkpoint never
    opened), the saved program run (no Dynamo trace, no Inductor compile), no graph captured
    (CPU graphs come at each size's second step); the same tokens."""
    from compile_runtime.models import loader

    model_dir = model_dirs("llama")
    options = dict(dtype="float32", max_num_seqs=2, max_model_len=128, kv_cache_bytes=2**25)
    config = {"backend": "inductor", "cache_dir": str(tmp_path)}
    params = cr.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cold = cr.LLM(model_dir, config, **options)
    expected = [o.outputs[0].token_ids for o in cold.generate(PROMPTS, params, use_tqdm=False)]
    cold.shutdown()

    def no_reading(*args, **kwargs):
        raise AssertionError("a warm start read the checkpoint")

    monkeypatch.setattr(loader, "iterate_checkpoint", no_reading)
    with cr.compilation_counter.expect(
        num_graphs_seen=0,
        num_inductor_compiles=0,
        num_cudagraph_captured=0,
        num_programs_loaded=1,
        num_weight_files_mapped=1,
    ):
        warm = cr.LLM(model_dir, config, **options)
    try:
        assert warm.startup.saved_program and "captured on first use" in warm.startup.summary()
        outs = warm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        warm.shutdown()


def test_prune_counts_packed_weights_and_takes_the_least_recently_mapped_first(
    model_dirs, tmp_path
):
    from compile_runtime.cache import manage

    cache = str(tmp_path)
    small, large = model_dirs("llama", num_hidden_layers=1), model_dirs("llama")
    _run(small, cache, dtype="float32")
    _run(large, cache, dtype="float32")
    old, new = sorted(_files(cache), key=os.path.getsize)  # the one-layer model's file first
    os.utime(old, ns=(10**9, os.stat(old).st_mtime_ns))  # mapped long ago
    _run(small, cache, dtype="float32")  # maps it: used now
    assert os.stat(old).st_atime > os.stat(new).st_atime
    entries = sum(
        os.path.getsize(os.path.join(d, f)) for k in manage.key_dirs(cache)
        for d, _, fs in os.walk(os.path.join(cache, k)) for f in fs
    )  # fmt: skip
    removed = manage.prune(cache, max_size=entries + os.path.getsize(old))
    assert os.path.relpath(new, cache) in removed and os.path.exists(old)
