"""Speculative decoding with n-gram drafts: the proposer, the rejection sampler, the
scheduler's 1 + k token steps, and greedy tokens identical to decoding without drafts."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis")
from copier import copy_prompt, make_copier_dir, orbit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_invariants import check_scheduler_invariants
from test_scheduler import FakeRunner, count_up, run
from test_verify import RerunFactory

from compile_runtime.config import (
    AttentionCGSupport,
    CompilationConfig,
    ConfigError,
    CUDAGraphMode,
    RunnerConfig,
)
from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.engine.llm import LLM
from compile_runtime.forward_context import BatchDescriptor
from compile_runtime.worker.ngram_proposer import NgramProposer
from compile_runtime.worker.rejection_sampler import rejection_sample
from compile_runtime.worker.sampling_metadata import (
    RequestSamplingState,
    SamplingMetadata,
    make_generator,
)

EAGER = {"backend": "eager"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}

# ---------------------------------------------------------------- proposer


def reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The proposer's contract, one row at a time in plain Python."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        suffix = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if starts:
            complete = [s for s in starts if s + n + k <= length]  # k known tokens after it
            start = complete[-1] if complete else starts[0]  # the most recent, else the earliest
            return tokens[start + n : start + n + k]
    return []


def propose(rows: list[list[int]], k=3, min_n=1, max_n=3) -> list[list[int]]:
    width = max(len(r) for r in rows) + 5
    array = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        array[i, : len(r)] = r
        array[i, len(r) :] = 7  # stale tokens past the end must never match
    lengths = np.array([len(r) for r in rows], dtype=np.int32)
    return NgramProposer(k, min_n, max_n).propose(array, lengths)


def test_proposer_takes_the_longest_most_recent_match_with_k_tokens_after_it():
    assert propose([[1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]]) == [[8, 5, 1]]  # latest 1 2 3
    # An edited text: the latest version, not the first.
    assert propose([[1, 2, 3, 9, 4, 1, 2, 3, 8, 4, 1, 2]], k=2) == [[3, 8]]
    # n=1: the latest 6 has 2 tokens after it, fewer than k=3: the latest with 3.
    assert propose([[4, 5, 6, 1, 9, 5, 6, 2, 6]], min_n=1) == [[1, 9, 5]]
    assert propose([[4, 5, 6, 1, 9, 5, 6, 2, 6]], min_n=2) == [[]]  # no 2-gram "2 6" before
    assert propose([[1, 2, 3]]) == [[]]
    assert propose([[5, 5]], k=4) == [[5]]  # only known tokens are drafted
    # A run of one token: no match has k tokens after it yet, so the earliest (the most
    # tokens after it), not the latest (one token); then the latest with k.
    assert propose([[7, 5, 5, 5, 5, 5]]) == [[5, 5]]
    assert propose([[7] + [5] * 8]) == [[5, 5, 5]]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=6),
    k=st.integers(1, 5),
    n=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_vectorised_proposer_equals_the_per_row_reference(rows, k, n):
    min_n, max_n = n[0], n[0] + n[1]
    want = [reference_draft(r, k, min_n, max_n) for r in rows]
    assert propose(rows, k, min_n, max_n) == want


# ---------------------------------------------------------------- rejection sampler


def metadata_for(params: list[SamplingParams], outputs=None, generators=None) -> SamplingMetadata:
    states = [
        RequestSamplingState(
            params=p,
            prompt_token_ids=[1],
            output_token_ids=(outputs or {}).get(i, []),
            generator=(generators or {}).get(i),
        )
        for i, p in enumerate(params)
    ]
    return SamplingMetadata.from_requests(states, vocab_size=8)


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    logits = torch.full((7, 8), -1.0)
    for row, best in enumerate([3, 4, 5, 6, 2, 2, 1]):
        logits[row, best] = 1.0
    # Request 0: drafts 3 4 9 -> 3, 4 accepted, 9 != 5 -> 5 instead. Request 1: 2 matches,
    # then the bonus (row 6's argmax). Request 2 would be a plain decode (no drafts).
    out = rejection_sample(logits, [[3, 4, 9], [2, 2]], None)
    assert out.token_ids == [[3, 4, 5], [2, 2, 1]]
    out = rejection_sample(logits[:4], [[6, 4, 5]], None)
    assert out.token_ids == [[3]]  # the first draft rejected: the argmax of row 0


def test_rejection_sampling_gives_the_target_distribution():
    """The first token of a request with a draft x is distributed as the ordinary sampler's
    token (temperature 0.7, top-k 5): accepted x with p(x), else drawn from p without x."""
    torch.manual_seed(0)
    vocab, n = 8, 40_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = SamplingParams(temperature=0.7, top_k=5)
    logits = base.repeat(2 * n, 1)  # rows: draft position, bonus position, per request
    metadata = SamplingMetadata.from_requests(
        [RequestSamplingState(params=params, prompt_token_ids=[1], output_token_ids=[])] * (2 * n),
        vocab_size=vocab,
    )
    out = rejection_sample(logits, [[1]] * n, metadata)
    first = torch.tensor([t[0] for t in out.token_ids])
    target = torch.softmax(torch.where(base >= base.topk(5).values[-1], base, -math.inf) / 0.7, -1)
    freq = torch.bincount(first, minlength=vocab).double() / n
    # 5 standard errors of a binomial proportion per token; out-of-top-k tokens never appear.
    tolerance = 5 * torch.sqrt(target * (1 - target) / n) + 1e-9
    assert (freq - target.double()).abs().le(tolerance.double()).all(), (freq, target)
    accepted = sum(len(t) == 2 for t in out.token_ids) / n  # accepted x = token 1
    assert abs(accepted - target[1].item()) < 5 * math.sqrt(target[1] * (1 - target[1]) / n)


def test_seeded_requests_are_reproducible_and_penalties_see_earlier_drafts():
    params = SamplingParams(temperature=1.0, seed=7, presence_penalty=50.0, logprobs=2)
    logits = torch.zeros(3, 8)
    logits[:, 3] = 4.0  # token 3 dominates unless the presence penalty removes it

    def sample():
        gen = make_generator(7)
        # Row j sees the drafts before it as output: row 1 and 2 have 3 penalised.
        meta = metadata_for([params] * 3, {1: [3], 2: [3, 3]}, {0: gen, 1: gen, 2: gen})
        return rejection_sample(logits, [[3, 3]], meta)

    a, b = sample(), sample()
    assert a.token_ids == b.token_ids
    assert a.token_ids[0][1:] == [] or 3 not in a.token_ids[0][1:]
    assert len(a.logprobs[0]) == len(a.token_ids[0]) and len(a.logprobs[0][0][1]) == 2


# ---------------------------------------------------------------- scheduler


def draft_script(k: int, quality: float, seed: int):
    """Proposes the next k scripted tokens, each right with probability ``quality``."""
    rng = random.Random(seed)

    def propose(req_id: str, num_outputs: int) -> list[int]:
        return [
            count_up(req_id, num_outputs + i) if rng.random() < quality else 7
            for i in range(rng.randint(0, k))
        ]

    return propose


def test_drafts_are_scheduled_after_the_last_token_and_capped_by_budget_and_max_tokens():
    s = Scheduler(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=6)
    runner = FakeRunner(4, propose=lambda rid, n: [count_up(rid, n + i) for i in range(4)])
    s.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    assert s.requests["a"].spec_token_ids == [1001, 1002, 1003]  # 4 proposed, max_tokens caps
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [1001, 1002, 1003]}
    finished = s.update_from_output(out, runner.execute(out))
    assert [r.output_token_ids for r in finished] == [[1000, 1001, 1002, 1003, 1004]]
    assert s.spec_decode_stats.num_accepted_tokens == 3
    # A budget smaller than 1 + drafts cuts the drafts.
    s.add_request(Request("b", [5], SamplingParams(max_tokens=20, ignore_eos=True)))
    s.add_request(Request("c", [5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 5, "c": 1}  # 6 tokens: c's drafts wait
    assert out.scheduled_spec_decode_tokens == {"b": [1001, 1002, 1003, 1004]}


def test_tokens_after_a_stop_inside_accepted_drafts_are_dropped():
    s = Scheduler(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(4, propose=lambda rid, n: [count_up(rid, n + i) for i in range(3)])
    params = SamplingParams(max_tokens=10, stop_token_ids=[1002])
    s.add_request(Request("a", [5, 6], params, eos_token_ids=(2,)))
    finished, _ = run(s, runner)
    assert finished["a"].output_token_ids == [1000, 1001, 1002]
    assert s.block_pool.num_free == s.block_pool.num_usable


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), caching=st.booleans())
def test_random_workloads_give_the_same_outputs_with_drafts(seed, caching):
    """Tiny caches (preemption), chunked prefill, drafts of every quality: every step keeps
    blocks consistent, every KV read finds the right token, outputs equal no drafts."""
    rng = random.Random(seed)
    options = dict(
        num_blocks=rng.randint(8, 16),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=rng.randint(4, 16),
        long_prefill_token_threshold=rng.choice([None, 3]),
        enable_prefix_caching=caching,
    )
    capacity = (options["num_blocks"] - 1) * options["block_size"]
    requests = []
    for i in range(rng.randint(1, 6)):
        prompt = [rng.randint(3, 9) for _ in range(rng.randint(1, capacity // 3))]
        requests.append((f"r{i}", prompt, rng.randint(1, capacity - len(prompt))))
    results = []
    for propose in (None, draft_script(rng.randint(1, 4), rng.random(), seed)):
        s = Scheduler(**options)
        for rid, prompt, max_tokens in requests:
            s.add_request(
                Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            )
        finished, _ = run(s, FakeRunner(options["block_size"], propose=propose), max_steps=20000)
        results.append({k: r.output_token_ids for k, r in finished.items()})
        assert s.block_pool.num_free == s.block_pool.num_usable
    assert results[0] == results[1]


# ---------------------------------------------------------------- engine

REPEATS = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def engines(model_dirs):
    """The tiny Llama without and with drafts, under a small cache and step budget."""
    options = dict(
        max_num_seqs=4,
        max_num_batched_tokens=24,
        block_size=4,
        num_gpu_blocks_override=40,
        max_model_len=96,
    )
    model_dir = model_dirs("llama")
    return (
        LLM(model_dir, EAGER, **options),
        LLM(model_dir, EAGER, speculative_config=NGRAM, **options),
    )


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=st.lists(
        st.tuples(st.integers(1, 4), st.lists(st.integers(3, 250), min_size=1, max_size=8)),
        min_size=1,
        max_size=5,
    )
)
def test_greedy_tokens_identical_with_and_without_drafts(engines, prompts):
    plain, spec = engines
    batch = [REPEATS * reps + tail for reps, tail in prompts]  # repeated spans: drafts
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    assert [
        o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)
    ] == expected
    check_scheduler_invariants(spec.core.scheduler)


def test_drafts_are_verified_and_counted(engines):
    plain, spec = engines
    batch = [REPEATS * 4 + [i] for i in (3, 4, 5, 6)] * 2  # 8 requests: preemption
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    assert [
        o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)
    ] == expected
    stats = spec.last_stats.spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert 1 < stats.mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    assert spec.last_stats.steps < plain.last_stats.steps  # accepted drafts save steps
    assert spec.core.scheduler.num_preemptions > 0
    # The runner's dispatcher treats 1 + k tokens per request as the uniform decode batch.
    assert spec.runner.dispatcher.uniform_decode_query_len == 4
    assert sum(spec.workload.decode.values()) > 0 and set(spec.workload.decode) <= {
        4 * n for n in range(1, 5)
    }


def test_sampling_knobs_and_logprobs_run_through_the_rejection_sampler(engines):
    _, spec = engines
    params = SamplingParams(
        temperature=0.8,
        top_p=0.9,
        seed=11,
        repetition_penalty=1.2,
        min_tokens=4,
        logprobs=2,
        max_tokens=24,
    )
    a = spec.generate([REPEATS * 3] * 2, params, use_tqdm=False)
    b = spec.generate([REPEATS * 3] * 2, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in a]
    assert tokens == [o.outputs[0].token_ids for o in b]  # seeded: reproducible
    for o in a:
        assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
        assert all(len(top) == 2 for _, top in o.outputs[0].logprobs)
        assert len(o.outputs[0].token_ids) >= 4


def test_speculative_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="method='eagle'.*Input should be 'ngram'"):
        RunnerConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="prompt_lookup_min=5 is larger than"):
        RunnerConfig(
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
            }
        )
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunnerConfig(speculative_config="{bad")
    config = RunnerConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert config.speculative_config.num_speculative_tokens == 2


def test_cli_generate_reports_acceptance(model_dirs, capsys):
    from compile_runtime.cli.main import main

    code = main(
        [
            "generate",
            "--model",
            model_dirs("llama"),
            "-O",
            '{"mode": "NONE"}',
            "--prompt",
            "one two three one two three one two three",
            "--max-tokens",
            "24",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}',
            "--ignore-eos",
        ]
    )
    assert code == 0
    assert "draft tokens accepted" in capsys.readouterr().out


def test_a_draft_holding_all_of_the_probability_is_always_accepted():
    logits = torch.full((2, 8), -1e9)
    logits[:, 5] = 0.0  # p(5) = 1: no residual to draw a replacement from
    meta = metadata_for([SamplingParams(temperature=1.0)] * 2)
    for _ in range(20):
        assert rejection_sample(logits, [[5]], meta).token_ids == [[5, 5]]


# ---------------------------------------------------------------- FULL graphs of 1 + k tokens


@pytest.fixture(scope="module")
def copier(model_dirs, tmp_path_factory):
    """The tiny Llama made a copier (tests/copier.py): its greedy next token is f[t]."""
    return make_copier_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("copier")))


def simulate_full_graphs_on_cpu(monkeypatch) -> None:
    """The runner plans FULL graphs as on CUDA, with a graph double whose replay reruns the
    model (test_verify.RerunFactory): the steps that would replay a graph on a GPU do here."""
    from compile_runtime.worker import cudagraph_plan

    wrap, resolve = cudagraph_plan.wrap_full_model, CompilationConfig.resolve
    monkeypatch.setattr(
        cudagraph_plan,
        "wrap_full_model",
        lambda m, c, **_: wrap(m, c, graph_factory=RerunFactory()),
    )
    monkeypatch.setattr(cudagraph_plan, "min_cg_support", lambda _: AttentionCGSupport.ALWAYS)
    monkeypatch.setattr(
        CompilationConfig,
        "resolve",
        lambda self, *a, **kw: resolve(self, *a, **{**kw, "cuda_available": True}),
    )


def test_one_copying_request_replays_full_graphs_of_1_plus_k_tokens(copier, monkeypatch):
    """The CPU run of tests/test_engine_cuda.py's spec-decode check: one request whose
    prompt the copier copies drafts k tokens every step, so its decode steps are the
    uniform batch of 1 + k tokens and replay the FULL graph captured for it."""
    simulate_full_graphs_on_cpu(monkeypatch)
    model_dir, f = copier
    k = 2
    prompt = copy_prompt(f)
    config = {
        "backend": "eager",
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4],
    }
    spec = {"method": "ngram", "num_speculative_tokens": k}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model_dir, config, speculative_config=spec, max_num_seqs=4, max_model_len=128) as llm:
        plan = llm.runner.cudagraph_plan
        assert plan.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
        forward = plan.decode_model  # the decode graphs run on through the LM head
        assert BatchDescriptor(1 + k, num_reqs=1, uniform=True) in forward.entries
        replays = forward.num_replays
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.last_stats.spec_decode
        uniform_steps = llm.workload.decode[1 + k]
        assert out == orbit(f, f[prompt[-1]], 24)  # the copy, every draft accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert uniform_steps >= 5
        assert forward.num_replays - replays == uniform_steps
