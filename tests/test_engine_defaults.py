"""What a user gets without options: sizes from the model and machine, dtype, every EOS id."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch

import compile_runtime as cr
from compile_runtime.config import ConfigError, RunnerConfig
from compile_runtime.models import dtype as dtype_module
from compile_runtime.models.dtype import resolve_dtype
from compile_runtime.worker import kv_sizing
from compile_runtime.worker.kv_sizing import kv_bytes_per_token, size_runner_config

EAGER = {"backend": "eager"}
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64.
SMOLLM2 = SimpleNamespace(
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    hidden_size=576,
    max_position_embeddings=8192,
)


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(SMOLLM2, torch.float32) == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token(SMOLLM2, torch.bfloat16) == 30 * 2 * 3 * 64 * 2
    assert kv_bytes_per_token(SMOLLM2, torch.float32, tp_size=3) == 30 * 2 * 1 * 64 * 4


def test_cpu_budget_is_a_fraction_of_available_ram(monkeypatch):
    monkeypatch.setattr(kv_sizing, "available_memory", lambda: 10 * 2**30)
    c = size_runner_config(RunnerConfig(), SMOLLM2, torch.float32, "cpu")
    assert c.kv_cache_bytes == 2 * 2**30  # the default fraction, 0.2
    c = size_runner_config(
        RunnerConfig(kv_cache_memory_fraction=0.5), SMOLLM2, torch.float32, "cpu", tp_size=2
    )
    assert c.kv_cache_bytes == 10 * 2**30 // 4  # half, shared by two ranks
    assert c.max_model_len == 8192


def test_max_model_len_is_the_models_positions_when_the_cache_holds_them():
    c = size_runner_config(RunnerConfig(kv_cache_bytes=2**30), SMOLLM2, torch.float32, "cpu")
    assert c.max_model_len == 8192


def test_max_model_len_is_capped_by_the_cache_with_a_warning(caplog):
    per_token = kv_bytes_per_token(SMOLLM2, torch.float32)
    budget = per_token * 16 * 101  # 100 blocks of 16 tokens after the null block
    with caplog.at_level(logging.WARNING):
        c = size_runner_config(RunnerConfig(kv_cache_bytes=budget), SMOLLM2, torch.float32, "cpu")
    assert c.max_model_len == 1600
    assert "8192 positions" in caplog.text and "--kv-cache-bytes" in caplog.text


def test_a_cache_without_one_block_names_the_flag():
    with pytest.raises(ConfigError, match="kv-cache-bytes"):
        size_runner_config(RunnerConfig(kv_cache_bytes=1000), SMOLLM2, torch.float32, "cpu")


def test_values_the_user_set_are_kept():
    c = RunnerConfig(kv_cache_bytes=2**20, max_model_len=64)
    c = size_runner_config(c, SMOLLM2, torch.float32, "cpu")
    assert (c.kv_cache_bytes, c.max_model_len) == (2**20, 64)


def test_on_cuda_max_model_len_is_the_models_positions():
    c = size_runner_config(RunnerConfig(), SMOLLM2, torch.bfloat16, "cuda")
    assert c.max_model_len == 8192 and c.kv_cache_bytes is None  # the GPU sizes by memory


@pytest.mark.parametrize(
    "stored, quantized, fast, expected",
    [
        (torch.float32, False, True, torch.float32),
        (None, False, True, torch.float32),
        (torch.bfloat16, False, True, torch.bfloat16),
        (torch.float16, False, True, torch.bfloat16),
        (torch.bfloat16, False, False, torch.float32),
        (None, True, True, torch.bfloat16),
        (None, True, False, torch.float32),
    ],
)
def test_auto_dtype_on_cpu(monkeypatch, stored, quantized, fast, expected):
    monkeypatch.setattr(dtype_module, "cpu_has_fast_bf16", lambda: fast)
    config = SimpleNamespace(dtype=stored)
    assert resolve_dtype("auto", config, "cpu", quantized=quantized) == expected


def test_named_dtypes_and_errors():
    config = SimpleNamespace(dtype=torch.float32)
    assert resolve_dtype("bfloat16", config, "cpu", quantized=False) == torch.bfloat16
    assert resolve_dtype(torch.float16, config, "cpu", quantized=False) == torch.float16
    with pytest.raises(ValueError, match="'fp33'.*auto"):
        resolve_dtype("fp33", config, "cpu", quantized=False)


def test_a_model_with_few_positions_runs_without_options(model_dirs):
    model_dir = model_dirs("llama", max_position_embeddings=96)
    llm = cr.LLM(model_dir, EAGER)
    assert llm.runner_config.max_model_len == 96
    assert llm.dtype == torch.float32  # a float32 checkpoint stays float32
    (out,) = llm.generate([5, 6, 7], cr.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_every_eos_id_of_config_and_generation_config_stops(model_dirs, tmp_path):
    src = model_dirs("llama")
    model_dir = str(tmp_path / "eos")
    os.makedirs(model_dir)
    for name in os.listdir(src):  # links to the shared model's files, not its config
        if name != "generation_config.json":  # (writing through a link would change it)
            os.symlink(os.path.join(src, name), os.path.join(model_dir, name))
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7, 9]}, f)  # as Llama 3 Instruct lists <|eot_id|>
    llm = cr.LLM(model_dir, EAGER, kv_cache_bytes=2**24)
    assert llm.core.eos_token_ids == (2, 7, 9)
    for eos in (7, 9):
        forced = cr.SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0})
        (out,) = llm.generate([5, 6], forced, use_tqdm=False)
        assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
        # min_tokens holds every EOS id back, not only the first.
        held = cr.SamplingParams(temperature=0, max_tokens=3, min_tokens=3, logit_bias={eos: 100.0})
        (out,) = llm.generate([5, 6], held, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3 and not {7, 9, 2} & set(out.outputs[0].token_ids)


def test_start_up_reads_the_model_config_once(model_dirs, monkeypatch):
    from transformers import AutoConfig

    reads = []
    read = AutoConfig.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        reads.append(args[0] if args else kwargs)
        return read(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(counting))
    model_dir = model_dirs("llama")
    with cr.LLM(model_dir, EAGER, kv_cache_bytes=2**24):
        pass
    assert reads == [model_dir]  # the engine's: the checks, tokenizer and runner get it


def test_the_engine_decides_every_size_and_carries_the_model_config(model_dirs):
    """One frozen EngineConfig holds what every rank reads: the runner's sizes, the graph sizes
    and the model's config; it pickles whole to a worker, which decides no size again."""
    import pickle

    from compile_runtime.engine.engine_config import decide_engine_config
    from compile_runtime.planner.capture_sizes import CPU_MAX_CAPTURE_SIZE

    options = {"device": "cpu", "kv_cache_bytes": 2**24, "max_num_batched_tokens": 48}
    config = decide_engine_config(model_dirs("llama"), EAGER, "float32", options)
    assert config.runner_config.max_model_len is not None
    assert config.runner_config.num_threads is not None
    sizes = config.cudagraph_capture_sizes
    assert sizes and max(sizes) <= min(48, CPU_MAX_CAPTURE_SIZE) and list(sizes) == sorted(sizes)
    assert config.hf_config.model_type == "llama"
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again.hf_config.to_dict() == config.hf_config.to_dict()
    # the model's config is carried, not compared, printed or dumped
    assert config.model_copy(update={"hf_config": None}) == config
    assert "hf_config" not in repr(config) and "hf_config" not in config.model_dump()
    explicit = {**EAGER, "cudagraph_capture_sizes": [1, 3, 100]}
    config = decide_engine_config(model_dirs("llama"), explicit, "float32", options)
    assert config.cudagraph_capture_sizes == (1, 3)  # bounded by the tokens of a step
    with pytest.raises(ConfigError, match="hf_config"):
        decide_engine_config(model_dirs("llama"), EAGER, "float32", {"hf_config": None})


def test_a_runner_decides_no_size():
    with pytest.raises(ConfigError, match="max_model_len and kv_cache_bytes left to the engine"):
        RunnerConfig().check_decided(on_cpu=True)
    RunnerConfig(max_model_len=64).check_decided(on_cpu=False)  # CUDA: measured at start-up
    assert RunnerConfig(max_model_len=64, max_num_seqs=2).max_num_tokens == 128
