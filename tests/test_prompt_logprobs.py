"""Prompt logprobs: every prompt token's logprob given the tokens before it, equal to
transformers' forward, however the prompt is chunked, preempted or cached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM

EAGER = {"backend": "eager"}
PROMPT = list(range(40, 75))  # 35 tokens: several 4-token blocks, several 8-token chunks
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)


@pytest.fixture(scope="module")
def reference(model_dirs):
    """transformers' log-softmax at every prompt position, for the next prompt token."""
    model_dir = model_dirs("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0], dim=-1)
    return model_dir, logprobs


def check(prompt_logprobs, logprobs: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for position, (chosen, top) in enumerate(prompt_logprobs[1:], 1):
        row = logprobs[position - 1]
        assert chosen == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        assert len(top) == 3 and top[0][0] == int(row.argmax())
        assert top[0][1] == pytest.approx(row.max().item(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_over_chunks(reference):
    model_dir, logprobs = reference
    llm = LLM(model_dir, EAGER, max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
    (out,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    check(out.prompt_logprobs, logprobs)
    plain = llm.generate(
        [PROMPT], PARAMS.model_copy(update={"prompt_logprobs": None}), use_tqdm=False
    )
    assert (
        plain[0].prompt_logprobs is None
        and plain[0].outputs[0].token_ids == out.outputs[0].token_ids
    )


def test_requests_with_prompt_logprobs_bypass_the_prefix_cache(reference):
    model_dir, logprobs = reference
    llm = LLM(model_dir, EAGER, max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    llm.generate([PROMPT], PARAMS.model_copy(update={"prompt_logprobs": None}), use_tqdm=False)
    (out,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)  # the prompt's blocks are cached
    assert llm.last_stats.prefix_cache.hits == 0  # but this request computes all of it
    check(out.prompt_logprobs, logprobs)
    llm.generate([PROMPT], PARAMS.model_copy(update={"prompt_logprobs": None}), use_tqdm=False)
    assert llm.last_stats.prefix_cache.hits > 0  # the cache itself is still there


def test_prompt_logprobs_survive_preemption(reference):
    model_dir, logprobs = reference
    llm = LLM(
        model_dir,
        EAGER,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=4,
        num_gpu_blocks_override=20,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    params = PARAMS.model_copy(update={"max_tokens": 20})
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    for out in outs:
        check(out.prompt_logprobs, logprobs)


def test_negative_prompt_logprobs_is_rejected():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
