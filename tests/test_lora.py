"""LoRA adapters on a tiny Llama: greedy fp32 tokens equal transformers + PEFT per adapter and
in a batch mixing two adapters and the base model; one trace with LoRA enabled; no-LoRA
batches run the no-LoRA key; slots evict the least recently used adapter; bad adapters are
one-line errors while the engine keeps serving; the prefix cache keeps adapters apart."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import compile_runtime as cr
from compile_runtime.counters import compilation_counter
from compile_runtime.lora import LoRAAdapterError, LoRARequest
from testing.lora_adapters import make_peft_adapter, peft_greedy

PROMPTS = [[5, 17, 33, 8, 2, 40], [7, 7, 9, 1], [3, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = 10
GREEDY = cr.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def base_dir(model_dirs):
    return model_dirs("llama")


@pytest.fixture(scope="module")
def hf_model(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """Two adapters of different ranks on different modules (fused parts split: q and v of
    qkv, gate and up of gate_up), the second with rsLoRA scaling, a third for eviction."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "a1": dict(r=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=1),
        "a2": dict(r=4, target_modules=["k_proj", "o_proj", "gate_proj"], seed=2, use_rslora=True),
        "a3": dict(r=2, target_modules=["up_proj"], seed=3),
    }
    return {
        name: LoRARequest(name, i, make_peft_adapter(hf_model, str(root / name), **spec))
        for i, (name, spec) in enumerate(specs.items(), 1)
    }


@pytest.fixture(scope="module")
def reference(hf_model, adapters):
    out = {"base": peft_greedy(hf_model, None, PROMPTS, MAX_TOKENS)}
    for name, request in adapters.items():
        out[name] = peft_greedy(hf_model, request.lora_path, PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def llm(base_dir):
    engine = cr.LLM(
        base_dir, {"backend": "eager"}, dtype="float32", enable_lora=True, max_loras=2,
        max_lora_rank=8, max_num_seqs=8, max_model_len=64,
    )  # fmt: skip
    yield engine
    engine.shutdown()


def _tokens(llm, lora_request, prompts=PROMPTS):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora_request,
        use_tqdm=False,
    )  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def test_tokens_equal_peft_per_adapter_and_mixed(llm, adapters, reference):
    assert reference["a1"] != reference["base"] and reference["a2"] != reference["base"]
    assert _tokens(llm, None) == reference["base"]
    assert _tokens(llm, adapters["a1"]) == reference["a1"]
    assert _tokens(llm, adapters["a2"]) == reference["a2"]
    mixed = [None, adapters["a1"], adapters["a2"]]
    assert _tokens(llm, mixed) == [reference["base"][0], reference["a1"][1], reference["a2"][2]]


def test_one_trace_and_lora_in_the_dispatch_key(base_dir, adapters, reference):
    """The default (Inductor, CPU graphs): one trace for LoRA and no-LoRA steps; a no-LoRA
    step dispatches to the key without LoRA, one with an adapter to its LoRA key."""
    traces = compilation_counter.num_graphs_seen
    llm = cr.LLM(base_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                 max_num_seqs=8, max_model_len=64)  # fmt: skip
    try:
        runner = llm.runner
        keys = runner.dispatcher.keys
        assert any(d.has_lora for ks in keys.values() for d in ks)
        assert any(not d.has_lora for ks in keys.values() for d in ks)
        seen = []
        dispatch = runner.dispatcher.dispatch

        def spy(*args, **kwargs):
            mode, descriptor = dispatch(*args, **kwargs)
            seen.append((mode, descriptor))
            return mode, descriptor

        runner.dispatcher.dispatch = spy
        assert _tokens(llm, None) == reference["base"]
        assert seen and not any(d.has_lora for _, d in seen)
        seen.clear()
        assert _tokens(llm, [None, adapters["a1"], None]) == [
            reference["base"][0], reference["a1"][1], reference["base"][2],
        ]  # fmt: skip
        assert seen and all(d.has_lora for _, d in seen)
        assert any(mode != cr.CUDAGraphMode.NONE for mode, _ in seen)  # replayed graphs
        assert compilation_counter.num_graphs_seen - traces == 1
    finally:
        llm.shutdown()


def test_least_recently_used_adapter_is_evicted(llm, adapters, reference):
    lora = llm.runner.lora
    for name in ("a1", "a2"):
        _tokens(llm, adapters[name], PROMPTS[:1])
    evictions = lora.num_evictions
    assert _tokens(llm, adapters["a3"]) == reference["a3"]  # a third adapter, two slots
    assert lora.num_evictions == evictions + 1
    assert adapters["a1"].lora_int_id not in lora.slot_of  # the least recently used
    assert adapters["a2"].lora_int_id in lora.slot_of
    assert _tokens(llm, adapters["a1"]) == reference["a1"]  # loaded again, still right


def test_more_adapters_than_slots_in_one_call_all_finish(llm, adapters, reference):
    """Three adapters, two slots: the scheduler never runs more than two in a step."""
    order = [adapters["a1"], adapters["a2"], adapters["a3"]]
    assert _tokens(llm, order) == [reference[r.lora_name][i] for i, r in enumerate(order)]


def _broken(tmp_path, source: LoRARequest, name: str, edit) -> LoRARequest:
    target = tmp_path / name
    shutil.copytree(source.lora_path, target)
    edit(str(target))
    return LoRARequest(name, 90 + len(name), str(target))


def _set_config(**fields):
    def edit(path):
        config_path = os.path.join(path, "adapter_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config.update(fields)
        with open(config_path, "w") as f:
            json.dump(config, f)

    return edit


def test_bad_adapters_are_one_line_errors_and_the_engine_keeps_serving(
    llm, adapters, reference, tmp_path, base_dir
):
    a1 = adapters["a1"]
    cases = {
        "missing": (
            lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")),
            "adapter_model.safetensors: missing",
        ),
        "dora": (_set_config(use_dora=True), "use_dora"),
        "saves": (_set_config(modules_to_save=["lm_head"]), "modules_to_save"),
    }
    for name, (edit, needle) in cases.items():
        bad = _broken(tmp_path, a1, name, edit)
        with pytest.raises(ValueError, match=needle) as info:
            _tokens(llm, bad)
        assert "\n" not in str(info.value)
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        llm.core.adapters.check(LoRARequest("nowhere", 77, str(tmp_path / "nowhere")))
    assert _tokens(llm, [a1, None, adapters["a2"]]) == [
        reference["a1"][0], reference["base"][1], reference["a2"][2],
    ]  # fmt: skip


def test_rank_over_the_limit_and_another_model_are_named(tmp_path, model_dirs, adapters):
    from transformers import AutoConfig

    from compile_runtime.lora.adapter import load_adapter, projection_shapes

    config = AutoConfig.from_pretrained(model_dirs("llama"))
    shapes = projection_shapes(config)
    with pytest.raises(LoRAAdapterError, match=r"rank 8, over max_lora_rank=4.*>= 8"):
        load_adapter(adapters["a1"], shapes, config.num_hidden_layers, max_rank=4)
    wider = dict(shapes, q_proj=(shapes["q_proj"][0] * 2, shapes["q_proj"][1]))
    with pytest.raises(LoRAAdapterError, match="trained for another model"):
        load_adapter(adapters["a1"], wider, config.num_hidden_layers, max_rank=64)


def test_an_engine_without_lora_refuses_an_adapter(base_dir, adapters):
    llm = cr.LLM(base_dir, {"backend": "eager"}, max_num_seqs=4, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            _tokens(llm, adapters["a1"])
    finally:
        llm.shutdown()


def test_prefix_cache_keeps_adapters_apart(llm, adapters, reference):
    long_prompt = list(range(3, 43))  # several full blocks
    before = llm.prefix_cache_stats.hits
    base = _tokens(llm, None, [long_prompt])
    tuned = _tokens(llm, adapters["a2"], [long_prompt])
    assert llm.prefix_cache_stats.hits == before  # no block computed without a2 reused by it
    assert tuned != base
    again = _tokens(llm, adapters["a2"], [long_prompt])
    assert llm.prefix_cache_stats.hits > before and again == tuned


@pytest.mark.slow
def test_tensor_parallel_adapters_give_the_one_rank_tokens(base_dir, adapters, reference):
    """TP=2 over worker processes: each rank holds its share of every adapter (B's rows on
    column-parallel q/k/v and gate/up, A's columns on row-parallel o and down)."""
    llm = cr.LLM(base_dir, {"backend": "eager"}, dtype="float32", tensor_parallel_size=2,
                 enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                 max_model_len=64)  # fmt: skip
    try:
        mixed = [adapters["a1"], None, adapters["a2"]]
        assert _tokens(llm, mixed) == [
            reference["a1"][0], reference["base"][1], reference["a2"][2],
        ]  # fmt: skip
    finally:
        llm.shutdown()


def test_adapters_on_quantized_base_weights(base_dir, hf_model, adapters, tmp_path):
    """Q8_0 base weights (quantization="int8"): the LoRA op adds to the quantized layer's
    output the same way; an adapter whose B is zero changes no token, a real one does."""
    zero = make_peft_adapter(
        hf_model, str(tmp_path / "zero"), r=4, target_modules=["q_proj", "down_proj"], scale=0.0
    )
    llm = cr.LLM(base_dir, {"backend": "eager"}, dtype="float32", quantization="int8",
                 enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                 max_model_len=64)  # fmt: skip
    try:
        base = _tokens(llm, None)
        assert _tokens(llm, LoRARequest("zero", 50, zero)) == base
        assert _tokens(llm, adapters["a1"]) != base
    finally:
        llm.shutdown()


def test_micro_batches_keep_each_tokens_adapter(base_dir, adapters, reference):
    """A step split into two micro-batches maps each half's tokens to their own adapters."""
    llm = cr.LLM(base_dir, {"backend": "eager"}, dtype="float32", enable_lora=True,
                 max_loras=2, max_lora_rank=8, max_num_seqs=8, max_model_len=64,
                 enable_microbatching=True, microbatching_token_threshold=2)  # fmt: skip
    try:
        mixed = [adapters["a2"], None, adapters["a1"]]
        assert _tokens(llm, mixed) == [
            reference["a2"][0], reference["base"][1], reference["a1"][2],
        ]  # fmt: skip
        assert llm.runner.unreplayed["micro-batched"] > 0
    finally:
        llm.shutdown()
