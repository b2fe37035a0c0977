"""The Llama and Qwen3 models compiled with every pass on generate what they generate with passes off."""

from __future__ import annotations

import pytest
from compile_runtime.passes import Phase

from compile_runtime.compiler.decorator import compiled_model
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ALL_ON = {
    "enable_noop_elimination": True,
    "enable_rms_norm_fusion": True,
    "enable_silu_mul_fusion": True,
    "enable_rotary_fusion": True,
    "enable_post_cleanup": True,
    "enable_fix_functionalization": True,
}
ALL_OFF = {name: False for name in ALL_ON}
RUNNER = dict(max_num_seqs=4, max_num_batched_tokens=64)


def generate(model_dir: str, config: dict) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, config, **RUNNER)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm


def post_grad_counts(llm: LLM) -> list[dict[str, int]]:
    """Per compiled piece, in compile order: the ops each fusion put in (details summed)."""
    manager = compiled_model(llm.runner.model.model).pass_manager
    graphs: dict[str, dict[str, int]] = {}
    for r in manager.records:
        if r.phase == Phase.POST_GRAD:
            counts = graphs.setdefault(r.graph, {})
            counts.update(r.details)
            counts[r.pass_name] = r.matches
    return list(graphs.values())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_all_passes_on_generate_the_same_greedy_tokens(model_dirs, arch):
    model_dir = model_dirs(arch)
    reference, _ = generate(model_dir, {"backend": "eager", "pass_config": ALL_OFF})
    tokens, llm = generate(
        model_dir,
        {
            "backend": "inductor",
            "pass_config": ALL_ON,
            # Neither cache may skip the compile: the passes must run to be counted.
            "disable_cache": True,
            "inductor_compile_config": {"fx_graph_cache": False},
        },
    )
    assert tokens == reference

    # Three unique pieces: embedding + layer 0 up to attention, one layer's worth
    # shared by the middle, and the last attention output + MLP + final norm.
    first, middle, last = post_grad_counts(llm)
    norms_before_rotary = 3 if arch == "qwen3" else 1  # qwen3: q_norm and k_norm too
    assert first["rms_norm"] == norms_before_rotary and first["fused_add_rms_norm"] == 0
    assert first["rotary_qk"] == 1 and first["fix_functionalization"] == 1
    assert middle["fused_add_rms_norm"] == 2 and middle["silu_and_mul"] == 1
    assert middle["rms_norm"] == norms_before_rotary - 1
    assert middle["rotary_qk"] == 1 and middle["fix_functionalization"] == 1
    assert last["fused_add_rms_norm"] == 2 and last["silu_and_mul"] == 1
    assert last["rotary_qk"] == 0
