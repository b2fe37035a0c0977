"""Logit soft-capping and the transformers adapter's attention arguments, end to end.

Gemma 2 caps its attention logits (``attn_logit_softcapping``), its final
logits (``final_logit_softcapping``) and uses a sliding window on alternate
layers; transformers passes all of that to the attention function as keyword
arguments. Each must reach our attention or fail loudly: ground truth is
transformers' own implementation on the same weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_generate import GREEDY, PROMPTS, reference_tokens
from torch import nn
from transformers import AutoModelForCausalLM

import compile_runtime as cr
from compile_runtime.attention.layer import Attention
from compile_runtime.engine.llm import LLM
from compile_runtime.models.registry import load_model
from compile_runtime.models.transformers_adapter import _attention

# A cap this small saturates tanh on the tiny model's logits: the tokens change with it.
GEMMA2 = {"attn_logit_softcapping": 1.0}
WINDOW = {"sliding_window": 8}  # shorter than two of the prompts


@pytest.mark.parametrize("config", [{"mode": "NONE"}, {"backend": "eager"}], ids=["none", "eager"])
@pytest.mark.parametrize(
    "arch, overrides",
    [("gemma2", GEMMA2), ("mistral", WINDOW)],
    ids=["gemma2-softcap", "mistral-window"],
)
def test_adapter_greedy_matches_transformers(model_dirs, arch, overrides, config):
    """Soft cap (C decode kernel, torch prefill) and sliding windows through the adapter."""
    model_dir = model_dirs(arch, **overrides)
    llm = LLM(model_dir, config, max_num_seqs=4, max_num_batched_tokens=64, use_transformers=True)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir)


@pytest.mark.parametrize(
    "arch, overrides, without",
    [("gemma2", GEMMA2, {"attn_logit_softcapping": None}), ("mistral", WINDOW, {})],
    ids=["gemma2-softcap", "mistral-window"],
)
def test_the_test_models_depend_on_what_they_test(model_dirs, arch, overrides, without):
    """Same weights without the cap (window) generate other tokens: the test above can fail."""
    with_it = reference_tokens(model_dirs(arch, **overrides))
    assert with_it != reference_tokens(model_dirs(arch, **without))


def test_final_logit_soft_cap_is_applied(model_dirs):
    """transformers caps Gemma 2's logits in the CausalLM forward, after the head: so do we."""
    cap = 0.5
    model_dir = model_dirs("gemma2", final_logit_softcapping=cap)
    model = load_model(model_dir, cr.CompilationConfig(mode="NONE"), use_transformers=True)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids[None]).logits[0]
        hidden = model(ids, torch.arange(len(ids)))
        ours = model.compute_logits(hidden)
        uncapped = model.lm_head(hidden)
    assert (ours - theirs).abs().max() < 1e-4
    assert (uncapped - theirs).abs().max() > 0.1  # the cap matters on this model


def test_a_head_transform_the_adapter_lacks_fails_at_load(model_dirs):
    """Cohere scales its logits in the CausalLM forward (``logit_scale``): not reproduced, so
    loading fails instead of sampling from differently scaled logits."""
    with pytest.raises(NotImplementedError, match="cohere: .*transforms the LM head's logits"):
        load_model(model_dirs("cohere"), cr.CompilationConfig(mode="NONE"), use_transformers=True)


def test_unsupported_attention_argument_fails_at_load_with_its_name(model_dirs):
    """gpt_oss passes attention sinks (``s_aux``), which our attention does not implement."""
    model_dir = model_dirs(
        "gpt_oss", head_dim=16, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="gpt_oss .*'s_aux'.*native implementation"):
        LLM(model_dir, {"backend": "eager"}, max_num_seqs=2, use_transformers=True)


# ---- the adapter's attention function, argument by argument --------------------


def _module(**layer_kwargs) -> nn.Module:
    module = nn.Module()
    module.config = SimpleNamespace(model_type="toy")
    module.runtime_attn = Attention(2, 16, 0.25, prefix="toy.attn", **layer_kwargs)
    return module


def _call(module: nn.Module, mask=None, **kwargs):
    q, k, v = (torch.randn(1, 2, 3, 16) for _ in range(3))
    return _attention(module, q, k, v, mask, **{"scaling": 0.25, **kwargs})


@pytest.mark.parametrize(
    "layer_kwargs, call_kwargs, match",
    [
        ({}, {"sinks": torch.zeros(2)}, "toy .*'sinks'"),
        ({}, {"some_new_argument": 1}, "'some_new_argument'"),
        ({}, {"softcap": 30.0}, "softcap=30.0.*logits_soft_cap=None"),
        ({"logits_soft_cap": 30.0}, {}, "softcap=None.*logits_soft_cap=30.0"),
        ({"sliding_window": 4}, {"sliding_window": 8}, "sliding_window=8.*sliding_window=4"),
        ({}, {"scaling": 0.5}, "scaling=0.5.*scale=0.25"),
        ({}, {"dropout": 0.1}, "dropout=0.1.*model.eval"),
        ({}, {"is_causal": False}, "is_causal=False"),
        ({}, {"mask": torch.ones(1, 1, 3, 3, dtype=torch.bool)}, "its own attention mask"),
    ],
)
def test_adapter_refuses_arguments_it_would_ignore(layer_kwargs, call_kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        _call(_module(**layer_kwargs), **call_kwargs)


@pytest.mark.parametrize("scaling", [0.25, None])  # None: transformers' default, head_dim**-0.5
def test_adapter_accepts_arguments_that_match_the_layer(scaling):
    module = _module(logits_soft_cap=30.0, sliding_window=4)
    out, weights = _call(
        module, scaling=scaling, softcap=30.0, sliding_window=4, dropout=0.0, is_causal=True,
        position_ids=torch.arange(3)[None], use_cache=False, cu_seq_lens_q=None,
    )  # fmt: skip
    assert out.shape == (1, 3, 2, 16) and weights is None


def test_layers_whose_metadata_differs_get_a_builder_each(model_dirs, monkeypatch):
    """FlashInfer plans window and cap into the step (GPU only); here the CPU backend is made to
    say the same, and Gemma 2's alternating layers must get two builders and still give
    transformers' tokens."""
    from compile_runtime.cpu.attention import CPUBatchedBackend

    monkeypatch.setattr(
        CPUBatchedBackend,
        "metadata_key",
        classmethod(lambda cls, spec: (spec.sliding_window, spec.logits_soft_cap)),
    )
    model_dir = model_dirs("gemma2", **GEMMA2, **WINDOW)
    llm = LLM(
        model_dir,
        {"backend": "eager"},
        max_num_seqs=4,
        max_num_batched_tokens=64,
        use_transformers=True,
    )
    windows = sorted(str(b.spec.sliding_window) for b, _ in llm.runner.metadata_groups)
    assert windows == ["8", "None"]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir)
