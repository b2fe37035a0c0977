"""Native Llama-family models on configs beyond the default: RoPE scaling, other activations,
sliding windows, and the fallback to the transformers adapter for what they cannot run.

Ground truth is transformers' own greedy generate on the same directory. Each
feature's test also checks that the feature changes transformers' tokens (same
weights, feature off), so a native model that ignored it would fail.
"""

from __future__ import annotations

import logging

import pytest
import torch
from compile_runtime.passes.activation_fusion import SiluMulFusionPass
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoModelForCausalLM

import compile_runtime.ops  # noqa: F401 - registers the fused ops the pass inserts
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM
from compile_runtime.models.llama import MLP, CausalLM, activation
from compile_runtime.models.loader import NativeUnsupported
from compile_runtime.models.transformers_adapter import TransformersCausalLM
from testing.model_dirs import make_model_dir, tiny_config

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
RUNNER = dict(max_num_seqs=4, max_num_batched_tokens=64)

# head_dim 16: wavelengths 6, 20, 63, 199, ... positions; an original context of 64
# scales all but the first frequency (llama3), ramps yarn over the first four.
ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    # NTK scaling starts past max_position_embeddings, where the table ends: below, default.
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}
# Positions stay below original_max_position_embeddings: longrope's short factors apply.
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 8.0],
    "long_factor": [8.0] * 8,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """``model_dir(name, arch, **overrides)``: a tiny model directory; same seed, same weights."""
    root = tmp_path_factory.mktemp("native_models")

    def get(name: str, arch: str = "llama", **overrides) -> str:
        return make_model_dir(str(root / name), arch=arch, **overrides)

    return get


_reference: dict[str, list[list[int]]] = {}


def reference_tokens(model_dir: str) -> list[list[int]]:
    if model_dir not in _reference:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _reference[model_dir] = [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    return _reference[model_dir]


def generate(model_dir: str, config: dict) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, config, **RUNNER)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm


@pytest.mark.parametrize("rope", list(ROPE))
def test_rope_scaling_matches_transformers(model_dir, rope):
    path = model_dir(f"llama-{rope}", rope_scaling=ROPE[rope])
    tokens, llm = generate(path, {"backend": "eager"})
    assert isinstance(llm.runner.model, CausalLM)
    assert tokens == reference_tokens(path)
    if rope != "dynamic":
        assert reference_tokens(path) != reference_tokens(model_dir("llama"))


def test_gelu_mlp_matches_transformers(model_dir):
    path = model_dir("llama-gelu", hidden_act="gelu_pytorch_tanh")
    tokens, llm = generate(path, {"backend": "eager"})
    assert isinstance(llm.runner.model, CausalLM)
    assert tokens == reference_tokens(path)
    assert reference_tokens(path) != reference_tokens(model_dir("llama"))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu"])
def test_silu_mul_fusion_fuses_only_silu(act):
    """The fused op computes silu(gate) * up: another activation must be left alone."""
    config = tiny_config("llama", hidden_act=act)
    mlp = MLP(config, activation(config)).eval()
    params = {k: v.detach() for k, v in mlp.named_parameters()}
    x = torch.randn(5, config.hidden_size)
    gm = make_fx(lambda p, x: functional_call(mlp, p, (x,)), tracing_mode="symbolic")(params, x)
    assert SiluMulFusionPass().run(gm.graph) == (act == "silu")
    gm.recompile()
    torch.testing.assert_close(gm(params, x), mlp(x))


def test_mistral_sliding_window_matches_transformers(model_dir):
    """A window of 8 tokens, shorter than most prompts plus their 16 generated tokens."""
    path = model_dir("mistral-window", arch="mistral", sliding_window=8)
    tokens, llm = generate(path, {"backend": "eager"})
    assert [layer.sliding_window for layer in llm.runner.model.attention_layers()] == [8, 8]
    assert tokens == reference_tokens(path)
    assert reference_tokens(path) != reference_tokens(model_dir("mistral", arch="mistral"))


def test_qwen2_windows_only_the_sliding_layers(model_dir):
    """Qwen2 windows the layers from max_window_layers on (config.layer_types), not all."""
    overrides = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    path = model_dir("qwen2-window", arch="qwen2", **overrides)
    tokens, llm = generate(path, {"mode": "NONE"})
    assert [layer.sliding_window for layer in llm.runner.model.attention_layers()] == [None, 8]
    assert tokens == reference_tokens(path)
    assert reference_tokens(path) != reference_tokens(model_dir("qwen2", arch="qwen2"))


def test_unsupported_config_falls_back_to_the_adapter(model_dir, caplog):
    path = model_dir("llama-longrope", rope_scaling=LONGROPE)
    with pytest.raises(NativeUnsupported, match="longrope"):
        CausalLM(tiny_config("llama", rope_scaling=LONGROPE))
    with caplog.at_level(logging.WARNING, logger="compile_runtime"):
        tokens, llm = generate(path, {"mode": "NONE"})
    assert isinstance(llm.runner.model, TransformersCausalLM)
    (warning,) = [
        r.message
        for r in caplog.records
        if r.name == "compile_runtime.models.registry" and r.levelno >= logging.WARNING
    ]
    assert "longrope" in warning and "transformers adapter" in warning
    assert tokens == reference_tokens(path)
    assert reference_tokens(path) != reference_tokens(model_dir("llama"))


def test_unknown_activation_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match="hidden_act 'swiglu_typo'"):
        CausalLM(tiny_config("llama", hidden_act="swiglu_typo"))
