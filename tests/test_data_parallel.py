"""Data parallelism: two engines (each its own scheduler, KV cache and worker process)
behind one LLM give the single engine's greedy tokens, with mixed prompt lengths, prefix
caching, preemption and speculative decoding; requests spread over both and return to the
engine holding their prefix."""

from __future__ import annotations

import pytest

import compile_runtime as cr
from compile_runtime.engine.data_parallel import DataParallelCore

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], list(range(10, 40)), [100], list(range(200, 217)), [9] * 21, [33, 44]]
GREEDY = cr.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SIZES = dict(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, max_model_len=64)


def prompt_hashes(prompt: list[int]) -> list[bytes]:
    """The prefix-cache hashes of a base-model prompt's full blocks but the last token's."""
    from compile_runtime.core.kv_blocks import extend_block_hashes
    from compile_runtime.core.request import Request

    request = Request("probe", prompt, GREEDY)
    n = (len(prompt) - 1) // SIZES["block_size"]
    return extend_block_hashes(request, n, SIZES["block_size"])[:n]


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(model_dirs):
    with cr.LLM(model_dirs("llama"), {"backend": "eager"}, **SIZES) as one:
        return _tokens(one)


def test_two_engines_give_one_engines_tokens(model_dirs, reference):
    # 14 blocks of 4 tokens per engine cannot hold three requests at full length: preemption.
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2,
                 num_gpu_blocks_override=14, **SIZES)  # fmt: skip
    try:
        core = llm.core
        assert isinstance(core, DataParallelCore) and len(llm.executors) == 2
        pids = [p for e in llm.executors for p in e.pids]
        assert len(set(pids)) == 2  # one worker process per engine
        assert _tokens(llm) == reference
        assert all(n > 0 for n in core.routed)  # both engines got requests
        assert sum(s.num_preemptions for s in core.schedulers) > 0
        prompt = list(range(300, 330))
        _tokens(llm, [prompt])
        holder = [i for i in range(2) if core.schedulers[i].block_pool.find_cached(
            prompt_hashes(prompt))]  # fmt: skip
        routed, hits = list(core.routed), llm.prefix_cache_stats.hits
        for _ in range(3):  # back to the engine holding its prefix, each time
            _tokens(llm, [prompt])
        assert llm.prefix_cache_stats.hits > hits
        assert [b - a for a, b in zip(routed, core.routed, strict=True)] == [
            3 if i in holder else 0 for i in range(2)
        ]
    finally:
        llm.shutdown()


def test_two_engines_with_speculative_decoding(model_dirs, reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2,
                 speculative_config=spec, **SIZES)  # fmt: skip
    try:
        assert _tokens(llm) == reference
        assert llm.core.spec_decode_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_data_parallel_refuses_the_in_process_executor(model_dirs):
    with pytest.raises(ValueError, match="data_parallel_size=2 .*='uni' cannot"):
        cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2,
               distributed_executor_backend="uni", **SIZES)  # fmt: skip


def test_served_by_two_engines(model_dirs, tmp_path):
    from serving import get, serve_like_offline

    server = serve_like_offline(model_dirs("llama"), str(tmp_path), "--data-parallel-size", "2")
    try:
        metrics = get(server.url + "/metrics")[1]
        assert 'compile_runtime_engine_kv_blocks_in_use{engine="1"}' in metrics
    finally:
        server.stop()


def test_real_model_two_engines_give_one_engines_tokens():
    """SmolLM2 in float32 (the GGUF file dequantized): DP=2 greedy tokens equal one engine's,
    with mixed prompt lengths and prefix caching on."""
    from compile_runtime.models.smollm2 import smollm2_gguf

    prompts = [list(range(1000, 1000 + n)) for n in (7, 40, 3, 90, 25, 61)]
    prompts.append(prompts[3][:50] + [5, 6, 7])  # shares a prefix with another prompt
    params = cr.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", quantization="none", max_num_seqs=8)
    with cr.LLM(smollm2_gguf(), **options) as one:
        want = _tokens(one, prompts, params)
    with cr.LLM(smollm2_gguf(), data_parallel_size=2, **options) as two:
        assert _tokens(two, prompts, params) == want
        assert all(n > 0 for n in two.core.routed)


def test_micro_batched_steps_give_the_same_tokens(model_dirs, reference):
    """One engine splitting each step of several requests into two micro-batches, each with
    its own attention metadata."""
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, enable_microbatching=True,
                 microbatching_token_threshold=4, **SIZES)  # fmt: skip
    try:
        assert _tokens(llm) == reference
        assert llm.runner.unreplayed["micro-batched"] > 0
    finally:
        llm.shutdown()


def test_lockstep_engines_agree_once_a_step(model_dirs, reference):
    """With lockstep on, every step is agreed once (padded count, uniform decode, micro-
    batching: here on for both engines) and the tokens stay the same; off, never."""
    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2,
                 data_parallel_lockstep=True, enable_microbatching=True,
                 microbatching_token_threshold=4, **SIZES)  # fmt: skip
    try:
        assert _tokens(llm) == reference
        assert llm.core.num_coordinations == llm.last_stats.steps > 0
    finally:
        llm.shutdown()
    with cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2, **SIZES) as off:
        assert _tokens(off) == reference
        assert off.core.num_coordinations == 0


def test_an_engine_whose_worker_dies_is_an_error_then_restarted(model_dirs, reference):
    """The death is an error naming the rank; ``restart_workers`` starts every engine's
    workers again with empty KV caches (no prefix of the dead cache is reused) and the
    tokens are the single engine's."""
    import os
    import signal

    from compile_runtime.executor import ExecutorError

    llm = cr.LLM(model_dirs("llama"), {"backend": "eager"}, data_parallel_size=2, **SIZES)
    try:
        _tokens(llm)  # both prefix caches hold blocks
        os.kill(llm.executors[1].pids[0], signal.SIGKILL)
        with pytest.raises(ExecutorError, match="rank 0"):
            _tokens(llm)  # both engines get requests; the second one's worker is gone
        old_pids = [p for e in llm.executors for p in e.pids]
        hits = llm.prefix_cache_stats.hits
        assert hits > 0
        llm.restart_workers()
        assert not set(old_pids) & {p for e in llm.executors for p in e.pids}
        assert all(s.block_pool.num_free == s.block_pool.num_usable for s in llm.core.schedulers)
        assert llm.prefix_cache_stats.hits == hits  # the running total carries over
        assert _tokens(llm) == reference
        assert llm.prefix_cache_stats.hits == hits  # nothing found in the new, empty caches
        assert not llm.core.has_unfinished() and llm.core.num_blocks_in_use == 0
    finally:
        llm.shutdown()
