"""LoRA adapters through `compile-runtime serve`: a request's model names its adapter
(--lora-modules, or loaded at run time), the answers equal offline generation with the same
adapter (which equals PEFT: tests/test_lora.py), concurrent requests for different adapters
and the base model share steps, and unknown or bad adapters are OpenAI-shaped errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil

import pytest
import torch
from serving import CONFIG, MAX_MODEL_LEN, RunningServer, chat_model_dir, get, http

import compile_runtime as cr
from compile_runtime.lora import LoRARequest
from testing.lora_adapters import make_peft_adapter

pytestmark = pytest.mark.slow
import openai  # noqa: E402  (serving skips the module without it)

PROMPTS = ["hello world", "the quick brown fox", "one two three"]
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def chat_model(model_dirs, tmp_path_factory):
    return chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def adapter_dirs(chat_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("served_adapters")
    return {
        "a1": make_peft_adapter(hf, str(root / "a1"), r=8, target_modules=["q_proj", "up_proj"], seed=5),
        "a2": make_peft_adapter(hf, str(root / "a2"), r=4, target_modules=["o_proj", "v_proj"], seed=6),
    }  # fmt: skip


@pytest.fixture(scope="module")
def offline(chat_model, adapter_dirs):
    """Offline texts per adapter name (None: the base model), greedy, 12 tokens."""
    llm = cr.LLM(chat_model, CONFIG, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                 enable_lora=True, max_loras=2, max_lora_rank=8)  # fmt: skip
    params = cr.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    for i, name in enumerate([None, "a1", "a2"]):
        lora = name and LoRARequest(name, i, adapter_dirs[name])
        outs = llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
        out[name] = [o.outputs[0].text for o in outs]
    llm.shutdown()
    return out


@pytest.fixture(scope="module")
def server(chat_model, adapter_dirs):
    s = RunningServer(
        chat_model, *LORA_FLAGS, "--lora-modules", f"a1={adapter_dirs['a1']}",
        "--allow-runtime-lora-updating", "--lora-root", os.path.dirname(adapter_dirs["a1"]),
    )  # fmt: skip
    yield s
    s.stop()


def complete(server, model, prompt):
    out = server.client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text, out.model


def test_models_list_the_base_and_its_adapters(server, adapter_dirs):
    cards = {m.id: m for m in server.client.models.list()}
    assert list(cards) == [server.model, "a1"]
    assert cards["a1"].parent == server.model and cards["a1"].root == "a1"  # no path


def test_answers_equal_offline_per_adapter_and_mixed(server, offline, adapter_dirs):
    status, text = http(
        server.url + "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapter_dirs["a2"]}
    )
    assert status == 200 and "added successfully" in text, text
    for name in (None, "a1", "a2"):
        for i, prompt in enumerate(PROMPTS):
            text, model = complete(server, name or server.model, prompt)
            assert text == offline[name][i] and model == (name or server.model)
    jobs = [(name, i) for name in (None, "a1", "a2") for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(
            pool.map(lambda j: complete(server, j[0] or server.model, PROMPTS[j[1]])[0], jobs)
        )
    assert texts == [offline[name][i] for name, i in jobs]
    chat = server.client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert chat.model == "a1" and chat.choices[0].message.content is not None


def test_unknown_adapter_is_404_and_bad_directory_400(server, adapter_dirs):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        complete(server, "nope", PROMPTS[0])
    bad = pathlib.Path(adapter_dirs["a1"]).parent / "bad"
    shutil.copytree(adapter_dirs["a1"], bad)
    os.remove(bad / "adapter_model.safetensors")
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert status == 400 and "no LoRA adapter is available" in body["error"]["message"]
    config = json.loads((bad / "adapter_config.json").read_text())
    config["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(config))
    shutil.copy(os.path.join(adapter_dirs["a1"], "adapter_model.safetensors"), bad)
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert status == 400 and "use_dora" in body["error"]["message"]
    assert complete(server, "a1", PROMPTS[0])[0]  # the others are still served


def test_unload_then_the_name_is_unknown(server, adapter_dirs):
    body = {"lora_name": "gone", "lora_path": adapter_dirs["a2"]}
    assert http(server.url + "/v1/load_lora_adapter", body)[0] == 200
    assert complete(server, "gone", PROMPTS[0])[0]
    assert http(server.url + "/v1/unload_lora_adapter", {"lora_name": "gone"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete(server, "gone", PROMPTS[0])
    status, body = server.post("/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert status == 404 and "cannot be found" in body["error"]["message"]
    assert get(server.url + "/health")[0] == 200
