"""Scheduler: budgets, chunked prefill, stop conditions, preemption, block pool.

A fake runner mirrors what the real one keeps per request (tokens, computed
count, blocks) purely from the SchedulerOutputs it receives, and checks the
protocol on every step. Its "model" emits a scripted token per request.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from scheduler_invariants import check_scheduler_invariants

from compile_runtime.core.kv_blocks import BlockPool
from compile_runtime.core.request import Request, RequestStatus
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def count_up(req_id: str, index: int) -> int:
    """Default script: the i-th output of every request is 1000 + i (never EOS)."""
    return 1000 + index


@dataclass
class RunnerState:
    tokens: list[int]
    num_outputs: int
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    block_size: int
    script: Callable[[str, int], int] = count_up
    # Speculative decoding: (req_id, number of outputs so far) -> drafts for its next step;
    # the fake model accepts a draft while it equals the script's next token.
    propose: Callable[[str, int], list[int]] | None = None
    reqs: dict[str, RunnerState] = field(default_factory=dict)
    new_reqs_seen: list = field(default_factory=list)
    # The "KV cache": the token written at each (block, offset). A step reads every earlier
    # position of a request from it, so a wrongly shared or overwritten block fails.
    kv: dict[tuple[int, int], int] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "new request the runner already holds"
            assert new.prompt_token_ids[
                len(new.prompt_token_ids) - len(new.output_token_ids) :
            ] == (new.output_token_ids)
            self.new_reqs_seen.append(new)
            self.reqs[new.req_id] = RunnerState(
                list(new.prompt_token_ids),
                len(new.output_token_ids),
                new.num_computed_tokens,
                list(new.block_ids),
            )
        cached = out.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.reqs[req_id]
            assert state.num_computed == computed
            state.block_ids.extend(blocks)
        assert set(out.num_scheduled_tokens) == {n.req_id for n in out.scheduled_new_reqs} | set(
            cached.req_ids
        )

        result = ModelRunnerOutput()
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            assert n >= 1
            for pos in range(state.num_computed):
                slot = (state.block_ids[pos // self.block_size], pos % self.block_size)
                assert self.kv.get(slot) == state.tokens[pos], f"{req_id}: KV of {pos} is wrong"
            sequence = state.tokens + drafts
            assert len(state.block_ids) * self.block_size >= state.num_computed + n
            for pos in range(state.num_computed, state.num_computed + n):
                slot = (state.block_ids[pos // self.block_size], pos % self.block_size)
                self.kv[slot] = sequence[pos]
            state.num_computed += n
            assert state.num_computed <= len(sequence)
            assert not drafts or state.num_computed == len(sequence), "drafts of a prefill"
            assert NULL not in state.block_ids
            tokens = []
            if state.num_computed == len(sequence):
                for draft in [*drafts, None]:
                    token = self.script(req_id, state.num_outputs)
                    tokens.append(token)
                    state.tokens.append(token)
                    state.num_outputs += 1
                    if draft != token:
                        break
                state.num_computed -= len(drafts) + 1 - len(tokens)  # rejected drafts
                if self.propose is not None:
                    result.draft_token_ids[req_id] = self.propose(req_id, state.num_outputs)
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(tokens)
        return result


NULL = 0


def check_invariants(s: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= s.max_num_seqs
    assert len(s.running) <= s.max_num_seqs
    check_scheduler_invariants(s)  # references, free blocks, cache hashes, nothing partial shared


def run(
    s: Scheduler,
    runner: FakeRunner,
    max_steps: int = 500,
) -> tuple[dict[str, Request], list[SchedulerOutput]]:
    """Step until everything finishes; return finished requests and every step's output."""
    finished: dict[str, Request] = {}
    outputs = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        out = s.schedule()
        check_invariants(s, out)
        outputs.append(out)
        for req in s.update_from_output(out, runner.execute(out)):
            finished[req.req_id] = req
    else:
        raise AssertionError("requests did not finish")
    return finished, outputs


def req(req_id: str, prompt_len: int, **params) -> Request:
    prompt = [10 + (i % 50) for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,))


def sched(**kw) -> Scheduler:
    """A scheduler without prefix caching (every prompt here shares a prefix); the prefix
    cache's own tests turn it on."""
    defaults = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    return Scheduler(**(defaults | kw))


# ---------------------------------------------------------------- block pool


def test_block_pool_never_hands_out_the_null_block():
    pool = BlockPool(5)
    assert pool.num_free == 4
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4]
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(got[:2])
    assert pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2  # nothing taken on failure
    with pytest.raises(ValueError, match="double free"):
        pool.free([got[0]])
    with pytest.raises(ValueError, match="block id 0"):
        pool.free([0])
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


# ---------------------------------------------------------------- budgets, chunking


def test_budgets_respected_and_all_requests_complete():
    s = sched(max_num_seqs=3, max_num_batched_tokens=16)
    lengths = {"a": 5, "b": 30, "c": 1, "d": 17, "e": 8}
    for name, n in lengths.items():
        s.add_request(req(name, n, max_tokens=6))
    finished, outputs = run(s, FakeRunner(4))
    assert {k: len(r.output_token_ids) for k, r in finished.items()} == dict.fromkeys(lengths, 6)
    assert all(r.output_token_ids == [1000 + i for i in range(6)] for r in finished.values())
    assert all(r.finish_reason == "length" for r in finished.values())
    # Every token of every request was computed exactly once (no preemption here).
    total = sum(out.total_num_scheduled_tokens for out in outputs)
    assert total == sum(n + 6 - 1 for n in lengths.values())
    assert max(len(o.num_scheduled_tokens) for o in outputs) == 3
    assert s.block_pool.num_free == s.block_pool.num_usable


def test_chunked_prefill_splits_long_prompt_across_steps():
    s = sched(max_num_batched_tokens=16)
    s.add_request(req("long", 50, max_tokens=3))
    finished, outputs = run(s, FakeRunner(4))
    assert [o.num_scheduled_tokens["long"] for o in outputs] == [16, 16, 16, 2, 1, 1]
    assert len(finished["long"].output_token_ids) == 3
    # Only the first step sends it as new; later chunks continue where the last one stopped.
    assert [len(o.scheduled_new_reqs) for o in outputs] == [1, 0, 0, 0, 0, 0]
    assert [o.scheduled_cached_reqs.num_computed_tokens for o in outputs[1:4]] == [[16], [32], [48]]


def test_long_prefill_threshold_caps_chunks():
    s = sched(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(req("p", 20, max_tokens=2))
    _, outputs = run(s, FakeRunner(4))
    assert [o.num_scheduled_tokens["p"] for o in outputs] == [8, 8, 4, 1]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s = sched(max_num_batched_tokens=12, enable_chunked_prefill=False)
    s.add_request(req("a", 4, max_tokens=4))
    s.add_request(req("b", 4, max_tokens=4))
    s.add_request(req("c", 7, max_tokens=4))
    _, outputs = run(s, FakeRunner(4))
    # Step 0: a (4) + b (4) = 8; c's 7 tokens do not fit in the 4 left, so it waits whole.
    assert outputs[0].num_scheduled_tokens == {"a": 4, "b": 4}
    assert outputs[1].num_scheduled_tokens == {"a": 1, "b": 1, "c": 7}
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens=12"):
        s.add_request(req("d", 10, max_tokens=4))


def test_new_requests_join_while_others_decode():
    s = sched()
    runner = FakeRunner(4)
    s.add_request(req("a", 6, max_tokens=10))
    for _ in range(3):
        s.update_from_output(out := s.schedule(), runner.execute(out))
    s.add_request(req("b", 9, max_tokens=2))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    s.update_from_output(out, runner.execute(out))
    finished, _ = run(s, runner)
    assert len(finished["a"].output_token_ids) == 10 and len(finished["b"].output_token_ids) == 2


def test_max_num_seqs_limits_running_requests():
    s = sched(max_num_seqs=2)
    for name in "abc":
        s.add_request(req(name, 3, max_tokens=3))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"a", "b"}
    assert [r.req_id for r in s.waiting] == ["c"]


# ---------------------------------------------------------------- stop conditions


def script_at(token: int, index: int) -> Callable[[str, int], int]:
    return lambda req_id, i: token if i == index else 1000 + i


def test_eos_stops_and_finished_ids_reach_the_runner_next_step():
    s = sched()
    s.add_request(req("a", 4, max_tokens=10))
    s.add_request(req("b", 4, max_tokens=10, ignore_eos=True))
    finished, outputs = run(s, FakeRunner(4, script_at(EOS, 3)))
    assert finished["a"].output_token_ids == [1000, 1001, 1002, EOS]
    assert finished["a"].finish_reason == "stop"
    assert finished["a"].status is RequestStatus.FINISHED_STOPPED
    # ignore_eos: EOS is just a token, generation runs to exactly max_tokens.
    assert len(finished["b"].output_token_ids) == 10
    assert finished["b"].output_token_ids[3] == EOS
    assert finished["b"].finish_reason == "length"
    # a finished on step 3 (prefill + 3 decodes); the runner hears it on step 4.
    assert "a" not in outputs[3].finished_req_ids and "a" in outputs[4].finished_req_ids
    assert "a" not in outputs[4].num_scheduled_tokens
    assert s.block_pool.num_free == s.block_pool.num_usable


def test_stop_token_ids_stop_generation():
    s = sched()
    s.add_request(req("a", 4, max_tokens=10, stop_token_ids=[7]))
    finished, _ = run(s, FakeRunner(4, script_at(7, 2)))
    assert finished["a"].output_token_ids == [1000, 1001, 7]
    assert finished["a"].finish_reason == "stop"


def test_min_tokens_delays_eos_and_stop_ids():
    s = sched()
    s.add_request(req("eos", 4, max_tokens=10, min_tokens=3))
    s.add_request(req("stop", 4, max_tokens=10, min_tokens=3, stop_token_ids=[7]))
    script = {"eos": EOS, "stop": 7}
    finished, _ = run(s, FakeRunner(4, lambda req_id, i: script[req_id]))
    assert finished["eos"].output_token_ids == [EOS] * 3
    assert finished["stop"].output_token_ids == [7] * 3
    assert finished["eos"].finish_reason == finished["stop"].finish_reason == "stop"


def test_max_tokens_one_finishes_right_after_prefill():
    s = sched()
    s.add_request(req("a", 5, max_tokens=1))
    finished, outputs = run(s, FakeRunner(4))
    assert len(outputs) == 1 and finished["a"].output_token_ids == [1000]
    assert finished["a"].finish_reason == "length"


# ---------------------------------------------------------------- preemption


def test_preemption_requeues_newest_at_front_and_all_finish():
    # 4 usable blocks of 2 tokens; a, b, c each start with 1 block, d waits (max_num_seqs 3).
    s = sched(num_blocks=5, block_size=2, max_num_seqs=3, max_num_batched_tokens=8)
    s.add_request(req("a", 2, max_tokens=4))
    s.add_request(req("b", 2, max_tokens=4))
    s.add_request(req("c", 2, max_tokens=2))
    s.add_request(req("d", 2, max_tokens=2))
    runner = FakeRunner(2)

    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
    s.update_from_output(out, runner.execute(out))

    # Step 2: a takes the last free block; b needs one more, so c (newest) is preempted.
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.finished_req_ids == {"c"}
    assert [r.req_id for r in s.waiting] == ["c", "d"]
    c = s.requests["c"]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.output_token_ids == [1000]
    assert s.num_preemptions == 1
    assert len(out.scheduled_new_reqs) == 0  # nobody joins under memory pressure
    s.update_from_output(out, runner.execute(out))

    finished, _ = run(s, runner)
    assert {k: len(r.output_token_ids) for k, r in finished.items()} == {
        "a": 4,
        "b": 4,
        "c": 2,
        "d": 2,
    }
    assert finished["c"].output_token_ids == [1000, 1001]
    assert finished["c"].num_preemptions == 1
    # c came back as a new request: prompt + its output so far, nothing computed.
    resumed = [n for n in runner.new_reqs_seen if n.req_id == "c"][1]
    assert resumed.prompt_token_ids == c.prompt_token_ids + [1000]
    assert resumed.output_token_ids == [1000]
    assert resumed.num_computed_tokens == 0
    assert s.block_pool.num_free == s.block_pool.num_usable


def test_request_preempts_itself_when_it_is_the_newest():
    # a (older) and b both decode; b is newest, so when b needs a block it gives way.
    # 3 usable blocks of 2 tokens; a and b each grow to 2 blocks.
    s = sched(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    s.add_request(req("a", 2, max_tokens=3))
    s.add_request(req("b", 1, max_tokens=4))
    finished, outputs = run(s, FakeRunner(2))
    # Step 2: a fits in its 2 blocks; b needs a second block, none is free, b is newest.
    assert outputs[2].num_scheduled_tokens == {"a": 1}
    assert outputs[2].finished_req_ids == {"b"}
    assert finished["a"].num_preemptions == 0 and finished["b"].num_preemptions == 1
    assert finished["a"].output_token_ids == [1000, 1001, 1002]
    assert finished["b"].output_token_ids == [1000, 1001, 1002, 1003]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_under_a_tiny_cache(seed, prefix_caching):
    rng = random.Random(seed)
    s = Scheduler(
        enable_prefix_caching=prefix_caching,
        num_blocks=rng.randint(6, 12),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(2, 5),
        max_num_batched_tokens=rng.randint(4, 24),
        long_prefill_token_threshold=rng.choice([None, 3]),
    )
    capacity = s.block_pool.num_usable * s.block_size
    expected = {}
    for i in range(rng.randint(3, 10)):
        prompt_len = rng.randint(1, capacity // 2)
        max_tokens = rng.randint(1, capacity - prompt_len)
        s.add_request(req(f"r{i}", prompt_len, max_tokens=max_tokens))
        expected[f"r{i}"] = max_tokens
    finished, _ = run(s, FakeRunner(s.block_size), max_steps=5000)
    assert {k: len(r.output_token_ids) for k, r in finished.items()} == expected
    for k, r in finished.items():
        assert r.output_token_ids == [1000 + i for i in range(expected[k])]
    assert s.block_pool.num_free == s.block_pool.num_usable


# ---------------------------------------------------------------- rejection, protocol


def test_request_too_large_for_the_cache_is_rejected_with_numbers():
    s = sched(num_blocks=5, block_size=4)
    with pytest.raises(ValueError) as exc:
        s.add_request(req("big", 10, max_tokens=10))
    msg = str(exc.value)
    for part in ["'big'", "prompt 10", "max_tokens 10", "20 tokens", "5 blocks of 4", "4 usable"]:
        assert part in msg
    assert not s.has_unfinished()
    s.add_request(req("ok", 10, max_tokens=6))  # 16 tokens = 4 blocks: fits exactly


def test_duplicate_and_empty_requests_are_rejected():
    s = sched()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(req("e", 0))


def test_missing_sampled_token_is_a_protocol_error_that_changes_nothing():
    s = sched()
    s.add_request(req("a", 3))
    out = s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]]))
    assert s.requests["a"].num_computed_tokens == 0
    s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))
    assert s.requests["a"].output_token_ids == [5]
