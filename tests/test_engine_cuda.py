"""On CUDA, the whole engine: every graph mode gives transformers' greedy tokens, graphs are
captured where the mode says, and a second engine in the same process gets a KV cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from copier import copy_prompt, make_copier_dir, orbit
from transformers import AutoModelForCausalLM

from compile_runtime.attention.selector import ENV_VAR as ATTENTION_ENV
from compile_runtime.config import CUDAGraphMode
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.counters import compilation_counter
from compile_runtime.engine.llm import LLM
from compile_runtime.worker.kv_sizing import most_blocks_needed

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# float32 as the reference: dtype="auto" runs a float32 checkpoint in bf16 on a GPU, and the tiny
# model has near-ties that bf16 resolves differently (found on the first H200 run).
RUNNER = dict(
    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, device="cuda", dtype="float32"
)
GRAPHS = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}


@pytest.fixture(scope="module")
def reference(model_dirs):
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = model_dirs("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    tokens = []
    for p in PROMPTS:
        out = hf.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=GREEDY.max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        tokens.append(out[0, len(p) :].tolist())
    del hf
    torch.cuda.empty_cache()
    return model_dir, tokens


MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def run(model_dir, cudagraph_mode, **options):
    config = {"backend": "eager", "cudagraph_mode": cudagraph_mode, **GRAPHS}
    before = compilation_counter.num_cudagraph_captured
    with LLM(model_dir, config, **{**RUNNER, **options}) as llm:
        captured = compilation_counter.num_cudagraph_captured - before
        assert (captured > 0) == (cudagraph_mode != "NONE")
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cudagraph_mode", MODES)
def test_triton_in_every_graph_mode_gives_transformers_tokens(
    reference, cudagraph_mode, monkeypatch
):
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    model_dir, expected = reference
    assert run(model_dir, cudagraph_mode) == expected


@pytest.mark.parametrize("cudagraph_mode", ["FULL_AND_PIECEWISE", "PIECEWISE"])
def test_speculative_decode_batches_replay_graphs_and_keep_transformers_tokens(
    reference, model_dirs, tmp_path, cudagraph_mode, monkeypatch
):
    """1 + k tokens per request is the uniform decode batch: FULL graphs of request counts
    times 1 + k under FULL_AND_PIECEWISE (Triton attention supports uniform batches).

    The tiny model's own outputs draft too rarely for a step where every request has k
    drafts, so the replays are checked on one request of the copier (tests/copier.py),
    which drafts k tokens every step (its CPU run: tests/test_spec_decode.py)."""
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    model_dir, expected = reference
    k = 2
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    config = {"backend": "eager", "cudagraph_mode": cudagraph_mode, **GRAPHS}
    with LLM(model_dir, config, speculative_config=spec, **RUNNER) as llm:
        keys = llm.runner.dispatcher.keys
        if cudagraph_mode == "FULL_AND_PIECEWISE":
            assert keys[CUDAGraphMode.FULL] and all(
                d.num_tokens % (1 + k) == 0 and d.uniform for d in keys[CUDAGraphMode.FULL]
            )
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert llm.last_stats.spec_decode.num_draft_tokens > 0
    assert tokens == expected

    copier_dir, f = make_copier_dir(model_dirs("llama"), str(tmp_path / "copier"))
    prompt = copy_prompt(f)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(copier_dir, config, speculative_config=spec, **RUNNER) as llm:
        plan = llm.runner.cudagraph_plan
        forward = plan.decode_model or plan.forward_model  # decode graphs: through the head
        replays = getattr(forward, "num_replays", 0)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        uniform_steps = llm.workload.decode[1 + k]
        if cudagraph_mode == "FULL_AND_PIECEWISE":
            assert forward.num_replays - replays == uniform_steps
    assert out == orbit(f, f[prompt[-1]], 24)
    assert uniform_steps >= 5  # every decode step but the last ran 1 + k tokens


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_flashinfer_graphs_give_its_eager_tokens(model_dirs, arch, monkeypatch):
    """FlashInfer runs in half precision only, so its reference is its own run without graphs;
    Gemma 2 alternates sliding-window layers: one plan per (window, soft cap)."""
    monkeypatch.setenv(ATTENTION_ENV, "flashinfer")
    overrides = {"sliding_window": 8, "attn_logit_softcapping": 20.0} if arch == "gemma2" else {}
    model_dir = model_dirs(arch, head_dim=64, **overrides)
    expected = run(model_dir, "NONE", dtype="bfloat16")
    for mode in MODES[1:]:
        assert run(model_dir, mode, dtype="bfloat16") == expected, mode


def test_second_engine_in_a_process_gets_its_kv_cache(reference):
    model_dir, expected = reference
    first = LLM(model_dir, {"backend": "eager", **GRAPHS}, **RUNNER)
    blocks = first.runner.num_blocks
    assert blocks == most_blocks_needed(8, 128, 16)  # what it can use, not the device
    kv_bytes = sum(
        layer.kv_cache.numel() * layer.kv_cache.element_size() for layer in first.runner.layers
    )
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    first.shutdown()
    assert held - torch.cuda.memory_allocated() >= kv_bytes  # given back at once
    with LLM(model_dir, {"backend": "eager", **GRAPHS}, **RUNNER) as second:
        assert second.runner.num_blocks == blocks
        tokens = [o.outputs[0].token_ids for o in second.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == expected
