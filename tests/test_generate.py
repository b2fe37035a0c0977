"""Greedy generation through the runtime equals transformers' own generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import compile_runtime as cr
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

_reference: dict[str, list[list[int]]] = {}


def reference_tokens(model_dir: str) -> list[list[int]]:
    if model_dir not in _reference:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        outs = []
        for p in PROMPTS:
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
        _reference[model_dir] = outs
    return _reference[model_dir]


CONFIGS = {
    "none": {"mode": "NONE"},
    "piecewise-eager": {"backend": "eager"},
    "piecewise-inductor": {"backend": "inductor"},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(model_dirs, arch, config):
    model_dir = model_dirs(arch)
    llm = LLM(model_dir, CONFIGS[config], max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir)
    assert all(
        o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 16
        for o in outputs
    )
    assert outputs[0].outputs[0].text is not None  # the directory has a tokenizer


def test_compiled_runner_traces_once(model_dirs):
    before = cr.compilation_counter.clone()
    llm = LLM(model_dirs("llama"), {"backend": "eager"}, max_num_seqs=4, max_num_batched_tokens=64)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert cr.compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    # Every step size seen was recorded; decode steps of 4 requests are uniform.
    assert llm.workload.num_steps == llm.last_stats.steps
    assert llm.workload.decode[4] > 0


def test_chunked_prefill_and_preemption_keep_greedy_tokens(model_dirs):
    model_dir = model_dirs("llama")
    # A budget of 8 tokens a step chunks the 30-token prompt; 12 blocks of 4
    # tokens cannot hold all four requests at full length, so some are preempted.
    llm = LLM(
        model_dir,
        {"backend": "eager"},
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=4,
        num_gpu_blocks_override=14,
        max_model_len=64,
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir)
    assert llm.core.scheduler.num_preemptions > 0


def test_text_prompts_and_stop_conditions(model_dirs):
    llm = LLM(model_dirs("llama"), {"backend": "eager"}, max_num_seqs=4, max_num_batched_tokens=64)
    (first,) = llm.generate(
        "hello world", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert first.prompt_token_ids == llm.tokenizer("hello world")["input_ids"]
    stop = first.outputs[0].token_ids[2]
    (stopped,) = llm.generate(
        "hello world",
        SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]),
        use_tqdm=False,
    )
    assert (
        stopped.outputs[0].token_ids
        == first.outputs[0].token_ids[: first.outputs[0].token_ids.index(stop) + 1]
    )
    assert stopped.outputs[0].finish_reason == "stop"


def test_runner_rejects_double_execute(model_dirs):
    from compile_runtime.core.scheduler_output import SchedulerOutput
    from compile_runtime.worker.model_runner import ModelRunnerError

    llm = LLM(model_dirs("llama"), {"mode": "NONE"}, max_num_seqs=2, max_num_batched_tokens=32)
    llm.runner.execute_model(SchedulerOutput())  # an empty batch returns at once
    with pytest.raises(ModelRunnerError, match="without sample_tokens"):
        llm.runner.execute_model(SchedulerOutput())
    assert llm.runner.sample_tokens().req_ids == []


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
def test_transformers_adapter_matches_transformers(model_dirs, arch):
    """olmo2 has no native implementation here: it runs through the adapter only."""
    model_dir = model_dirs(arch)
    before = cr.compilation_counter.clone()
    llm = LLM(
        model_dir,
        {"backend": "eager"},
        max_num_seqs=4,
        max_num_batched_tokens=64,
        use_transformers=True,
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir)
    layers = llm.runner.model.config.num_hidden_layers
    assert cr.compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    assert (
        cr.compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen
        == 2 * layers + 1
    )


def test_unknown_architecture_goes_through_adapter_by_default(model_dirs):
    from compile_runtime.models.transformers_adapter import TransformersCausalLM

    llm = LLM(model_dirs("olmo2"), {"mode": "NONE"}, max_num_seqs=2, max_num_batched_tokens=32)
    assert isinstance(llm.runner.model, TransformersCausalLM)
