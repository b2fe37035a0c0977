"""Automatic prefix caching: the pool's references and LRU, the scheduler's use of them, and
greedy tokens identical with and without the cache on real (tiny) models."""

from __future__ import annotations

import random
from collections import Counter

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_invariants import check_scheduler_invariants
from test_scheduler import FakeRunner, check_invariants, run

from compile_runtime.core.kv_blocks import ROOT_HASH, BlockPool, extend_block_hashes, hash_block
from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.engine.core import StepFailedError
from compile_runtime.engine.llm import LLM

EAGER = {"backend": "eager"}


def h(*tokens: int) -> bytes:
    return hash_block(ROOT_HASH, list(tokens))


# ---------------------------------------------------------------- hashes


def test_block_hash_names_the_whole_prefix_not_just_the_block():
    a = hash_block(h(1, 2), [3, 4])
    assert a == hash_block(h(1, 2), [3, 4])
    assert a != hash_block(h(9, 2), [3, 4])  # same block tokens after another parent
    assert a != hash_block(h(1, 2), [4, 3])


def test_request_hashes_grow_over_prompt_and_outputs_and_match_a_fresh_computation():
    r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams())
    assert extend_block_hashes(r, 1, 4) == [h(1, 2, 3, 4)]
    r.output_token_ids += [7, 8, 9]
    hashes = extend_block_hashes(r, 2, 4)  # the second block ends in the outputs
    assert hashes == [h(1, 2, 3, 4), hash_block(h(1, 2, 3, 4), [5, 6, 7, 8])]
    assert extend_block_hashes(r, 1, 4) is hashes and len(hashes) == 2  # never shrinks


# ---------------------------------------------------------------- pool


def test_cached_blocks_are_shared_by_reference_and_stay_cached_when_freed():
    pool = BlockPool(6)  # blocks 1..5
    a = pool.allocate(2)
    pool.cache(a[0], h(1))
    pool.cache(a[1], h(2))
    assert pool.find_cached([h(1), h(2), h(3)]) == a
    assert pool.find_cached([h(2)]) == [a[1]]  # a lookup is a prefix run
    assert pool.find_cached([h(3), h(1)]) == []
    pool.touch(a)  # a second holder
    pool.check_consistency(Counter({a[0]: 2, a[1]: 2}))
    pool.free(a)
    pool.free(a)
    assert pool.num_free == 5 and pool.num_cached == 2  # free, still findable
    assert pool.num_free_after_touch(a) == 3
    pool.touch(a[:1])
    assert pool.num_free == 4
    pool.check_consistency(Counter({a[0]: 1}))


def test_eviction_uses_empty_blocks_first_then_least_recently_freed_cached_ones():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    for i, b in enumerate(blocks[:3]):
        pool.cache(b, h(i))
    pool.free([blocks[2], blocks[0], blocks[1]])  # LRU order: 2, 0, 1
    pool.free(blocks[3:])  # plain blocks: go first
    assert pool.allocate(2) == blocks[3:]
    assert pool.num_evictions == 0
    assert pool.allocate(2) == [blocks[2], blocks[0]]  # oldest freed cached first
    assert pool.num_evictions == 2
    assert pool.find_cached([h(2)]) == [] and pool.find_cached([h(0)]) == []
    assert pool.find_cached([h(1)]) == [blocks[1]]
    pool.check_consistency(Counter(blocks[2:5] + [blocks[0]]))


def test_a_block_in_use_is_never_evicted_and_errors_name_the_misuse():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache(a[0], h(1))
    assert pool.allocate(1) is None  # the cached block is held: not evictable
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.touch([a[1]])
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="only a block in use"):
        pool.cache(a[1], h(5))
    b = pool.allocate(1)
    assert b == [a[1]] and pool.find_cached([h(1)]) == [a[0]]  # plain block went first
    pool.cache(b[0], h(1))  # same content computed twice: the first block keeps the hash
    assert pool.hash_of(b[0]) is None


# ---------------------------------------------------------------- scheduler

BS = 4


def cached_sched(**kw) -> Scheduler:
    defaults = dict(num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(**(defaults | kw))


def request(req_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(prompt), params, eos_token_ids=(2,))


def step(s: Scheduler, runner: FakeRunner):
    out = s.schedule()
    check_invariants(s, out)
    s.update_from_output(out, runner.execute(out))
    check_scheduler_invariants(s)
    return out


def test_a_shared_prefix_is_computed_once_and_only_the_tail_is_scheduled():
    s, runner = cached_sched(), FakeRunner(BS)
    system = list(range(100, 112))  # three full blocks
    s.add_request(request("a", system + [1, 2]))
    step(s, runner)
    s.add_request(request("b", system + [7, 8, 9]))
    out = step(s, runner)
    assert out.num_scheduled_tokens["b"] == 3
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == s.requests["a"].block_ids[:3]
    assert s.prefix_cache_stats.queries == 14 + 15 and s.prefix_cache_stats.hits == 12
    run(s, runner)  # the fake runner checks every KV read against the request's tokens


def test_a_fully_cached_prompt_still_computes_its_last_block_for_the_logits():
    s, runner = cached_sched(), FakeRunner(BS)
    s.add_request(request("a", list(range(10, 18))))
    run(s, runner)
    s.add_request(request("b", list(range(10, 18))))
    out = step(s, runner)
    # 8 tokens = 2 full blocks; at least the last token must run, so the last block does.
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4


def test_the_partial_last_block_is_never_shared():
    s, runner = cached_sched(), FakeRunner(BS)
    s.add_request(request("a", list(range(10, 16)), max_tokens=10))  # 1.5 blocks
    step(s, runner)
    s.add_request(request("b", list(range(10, 16)), max_tokens=10))
    out = step(s, runner)
    a, b = s.requests["a"], s.requests["b"]
    assert a.block_ids[0] == b.block_ids[0]
    assert a.block_ids[1] != b.block_ids[1]  # both write tokens 4.. into their own block
    assert out.num_scheduled_tokens["b"] == 2
    run(s, runner)


def test_a_preempted_request_restarts_from_its_own_cached_blocks():
    # 6 usable blocks of 2: a and b both grow until the newest (b) is preempted.
    s = cached_sched(num_blocks=7, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(2)
    s.add_request(request("a", [5, 6, 7, 8], max_tokens=6))
    s.add_request(request("b", [9, 10, 11, 12, 13], max_tokens=4))
    finished, _ = run(s, runner)
    b_restarts = [n for n in runner.new_reqs_seen if n.req_id == "b"][1:]
    assert finished["b"].num_preemptions >= 1 and b_restarts
    assert b_restarts[0].num_computed_tokens > 0  # its blocks were still in the cache
    assert s.prefix_cache_stats.hits > 0


def test_caching_off_computes_every_prompt():
    s, runner = cached_sched(enable_prefix_caching=False), FakeRunner(BS)
    for i in range(3):
        s.add_request(request(f"r{i}", list(range(10, 30))))
    _, outputs = run(s, runner)
    assert sum(o.total_num_scheduled_tokens for o in outputs) == 3 * 20 + 3 * 2
    assert s.prefix_cache_stats.hits == 0 and s.block_pool.num_cached == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]))
def test_random_shared_prefix_workloads_keep_blocks_consistent(seed, block_size):
    """Under a tiny cache (preemption, eviction), chunked prefill and prefix sharing, every
    step keeps references consistent, every KV read finds the request's own tokens, and each
    request gets exactly the outputs it would get without the cache."""
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 16)
    options = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=rng.randint(4, 24),
        long_prefill_token_threshold=rng.choice([None, 3]),
    )
    capacity = (num_blocks - 1) * block_size
    prefixes = [[rng.randint(3, 40) for _ in range(rng.randint(0, capacity // 3))] for _ in "ab"]
    requests = []
    for i in range(rng.randint(2, 8)):
        prompt = rng.choice(prefixes) + [rng.randint(3, 40) for _ in range(rng.randint(1, 4))]
        prompt = prompt[: capacity // 2]
        requests.append((f"r{i}", prompt, rng.randint(1, capacity - len(prompt))))

    results = {}
    for caching in (False, True):
        s = Scheduler(enable_prefix_caching=caching, **options)
        # Scripted outputs; the fake runner's KV check is what a wrongly shared block fails.
        runner = FakeRunner(block_size, script=lambda rid, i: 3 + (i * 7 + len(rid)) % 30)
        for rid, prompt, max_tokens in requests:
            s.add_request(request(rid, prompt, max_tokens))
        finished, _ = run(s, runner, max_steps=20000)
        results[caching] = {k: r.output_token_ids for k, r in finished.items()}
        assert s.block_pool.num_free == s.block_pool.num_usable
    assert results[True] == results[False]


# ---------------------------------------------------------------- engine

SYSTEM = list(range(40, 72))  # 32 tokens: 8 blocks of 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_pair(model_dirs):
    """The same tiny Llama with and without the prefix cache, under a small KV cache and a
    small step budget (chunked prefill, preemption)."""
    options = dict(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        num_gpu_blocks_override=20,
        max_model_len=64,
    )
    model_dir = model_dirs("llama")
    on = LLM(model_dir, EAGER, **options)
    off = LLM(model_dir, EAGER, enable_prefix_caching=False, **options)
    return on, off


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 32), st.lists(st.integers(3, 250), min_size=1, max_size=10)),
        min_size=1,
        max_size=6,
    )
)
def test_greedy_tokens_identical_with_and_without_the_cache(llama_pair, prompts):
    on, off = llama_pair
    batch = [SYSTEM[:n] + tail for n, tail in prompts]
    expected = [o.outputs[0].token_ids for o in off.generate(batch, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in on.generate(batch, GREEDY, use_tqdm=False)] == expected
    check_scheduler_invariants(on.core.scheduler)
    assert on.core.scheduler.block_pool.num_free == on.core.scheduler.block_pool.num_usable


def test_engine_reports_hits_and_preemption_restarts_stay_identical(llama_pair):
    on, off = llama_pair
    batch = [SYSTEM + [i] * 8 for i in range(3, 11)]  # 8 shared + 4 running x 4 own > 19
    preemptions = on.core.scheduler.num_preemptions
    expected = [o.outputs[0].token_ids for o in off.generate(batch, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in on.generate(batch, GREEDY, use_tqdm=False)] == expected
    stats = on.last_stats.prefix_cache
    assert stats.queries >= 8 * 40 and stats.hits >= 7 * 32
    assert on.prefix_cache_stats.hits >= stats.hits
    assert off.last_stats.prefix_cache.hits == 0
    assert on.core.scheduler.num_preemptions > preemptions


def test_a_failed_step_leaves_the_cache_consistent_and_correct(llama_pair, monkeypatch):
    on, off = llama_pair
    batch = [SYSTEM[:20] + [i, 9] for i in range(3, 9)]
    expected = [o.outputs[0].token_ids for o in off.generate(batch, GREEDY, use_tqdm=False)]
    original, calls = on.runner.execute_model, []

    def fail_on_third(so):
        calls.append(so)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return original(so)

    monkeypatch.setattr(on.runner, "execute_model", fail_on_third)
    with pytest.raises(StepFailedError, match="injected fault"):
        on.generate(batch, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    check_scheduler_invariants(on.core.scheduler)
    assert on.core.scheduler.block_pool.num_free == on.core.scheduler.block_pool.num_usable
    assert [o.outputs[0].token_ids for o in on.generate(batch, GREEDY, use_tqdm=False)] == expected


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_models_match_transformers_with_the_cache(model_dirs, arch):
    """Every layer keeps every block, so a cached block holds what a recompute would write,
    windowed layers included (window 6/8 < the 16-token shared prefix)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs(arch, sliding_window=6) if arch == "mistral" else model_dirs(arch)
    llm = LLM(model_dir, EAGER, max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = [SYSTEM[:16] + [i, 7, 9] for i in (3, 4, 5)]
    llm.generate(batch[:1], GREEDY, use_tqdm=False)  # fill the cache
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert llm.last_stats.prefix_cache.hits == 3 * 16
    for prompt, out in zip(batch, outputs, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
