"""LoRA on the real model (SmolLM2-135M-Instruct, dequantized fp32 as transformers reads the
GGUF file): greedy tokens equal transformers + PEFT for two adapters of different ranks and
modules, alone and in one batch with the base model, offline and by chat."""

from __future__ import annotations

import pytest

import compile_runtime as cr
from compile_runtime.lora import LoRARequest
from compile_runtime.models.gguf import gguf_model_dir
from testing.lora_adapters import make_peft_adapter, peft_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def messages():
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def prompts(gguf_path, messages) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_model_dir(gguf_path))
    return [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        for m in messages
    ]


@pytest.fixture(scope="module")
def adapters(smollm2_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("real_adapters")
    a1 = make_peft_adapter(
        smollm2_hf, str(root / "a1"), r=8, target_modules=["q_proj", "v_proj", "o_proj"],
        seed=11, scale=0.05,
    )  # fmt: skip
    a2 = make_peft_adapter(
        smollm2_hf, str(root / "a2"), r=16, target_modules=["gate_proj", "up_proj", "down_proj"],
        seed=12, scale=3.0, lora_alpha=32,
    )  # fmt: skip
    return LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)


@pytest.fixture(scope="module")
def reference(smollm2_hf, adapters, prompts):
    return {
        None: peft_greedy(smollm2_hf, None, prompts, MAX_TOKENS),
        **{
            a.lora_name: peft_greedy(smollm2_hf, a.lora_path, prompts, MAX_TOKENS) for a in adapters
        },
    }


def test_tokens_equal_transformers_and_peft(gguf_path, adapters, prompts, messages, reference):
    a1, a2 = adapters
    assert reference["a1"] != reference[None] and reference["a2"] != reference[None]
    llm = cr.LLM(gguf_path, dtype="float32", quantization="none", enable_lora=True, max_loras=2,
                 max_lora_rank=16)  # fmt: skip
    try:
        params = cr.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

        def run(lora):
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, lora_request=lora,
                use_tqdm=False,
            )  # fmt: skip
            return [o.outputs[0].token_ids for o in outs]

        assert run(a1) == reference["a1"]
        assert run(a2) == reference["a2"]
        assert run([a2, None]) == [reference["a2"][0], reference[None][1]]
        assert run([None, a1]) == [reference[None][0], reference["a1"][1]]
        chat = llm.chat(messages, params, use_tqdm=False, lora_request=[a1, a2])
        assert [o.outputs[0].token_ids for o in chat] == [reference["a1"][0], reference["a2"][1]]
    finally:
        llm.shutdown()
