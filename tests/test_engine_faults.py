"""One bad request or one failed step must not poison the engine; bad sizes fail at start-up.

One engine serves the whole module: each test leaves it as a user would find it
after an error, and checks that the next call still gives transformers' greedy
tokens with every KV cache block back in the pool.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

import compile_runtime as cr
from compile_runtime.executor import EngineConfig
from compile_runtime.runner.llm import LLM, StepFailedError
from compile_runtime.runner.model_runner import ConfigError, RunnerConfig
from compile_runtime.runner.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 30)), [100]]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
VOCAB = 512  # tiny_models' vocab_size
EAGER = {"backend": "eager", "cudagraph_mode": "NONE"}


@pytest.fixture(scope="module")
def llm(model_dirs):
    # block_size 4: the prompts hold several blocks each, so a leaked block shows.
    return LLM(
        model_dirs("llama"),
        EAGER,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        block_size=4,
    )


@pytest.fixture(scope="module")
def expected(model_dirs):
    hf = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32).eval()
    return [
        hf.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def good_call_steps(llm, expected):
    """Steps of the good call on the fresh engine: later good calls must match it."""
    assert_good_call(llm, expected)
    return llm.last_stats.steps


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running, every block back in the pool."""
    s = llm.scheduler
    assert not s.has_unfinished() and not s.requests
    assert s.block_pool.num_free == s.block_pool.num_usable


def assert_good_call(llm: LLM, expected, steps: int | None = None) -> None:
    outputs = llm.generate(PROMPTS, GREEDY, progress=False)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.last_stats.output_tokens == len(PROMPTS) * MAX_TOKENS
    if steps is not None:
        assert llm.last_stats.steps == steps
    assert_idle(llm)
    # The runner holds at most this call's requests (finished ones leave at the next step).
    assert set(llm.runner.input_batch.requests) <= {o.request_id for o in outputs}
    assert llm.runner.execute_state is None


# ---------------------------------------------------------------- rejected before queueing


@pytest.mark.parametrize(
    "prompts,params,match",
    [
        ([[5, VOCAB, 7]], GREEDY, rf"prompt token id {VOCAB} \(position 1\) is outside the vocab"),
        ([[5, -1]], GREEDY, r"prompt token id -1 .*outside the vocabulary \[0, 512\)"),
        (
            [[5, 6]],
            SamplingParams(temperature=0, logit_bias={VOCAB + 3: 1.0}),
            rf"logit_bias token id {VOCAB + 3} is outside the vocabulary",
        ),
        ([[5, 6]], SamplingParams(logit_bias={-2: 1.0}), "logit_bias token id -2"),
        ([[]], GREEDY, "empty prompt"),
        (
            [list(range(60))],
            GREEDY,
            r"prompt of 60 tokens plus max_tokens=6 exceeds max_model_len=64",
        ),
        # The third of three is bad: the first two must not stay queued either.
        ([[5, 6], [7, 8], [9, 10**6]], GREEDY, r"prompt 2 of 3: .*token id 1000000"),
        (
            [[5, 6], [7, 8], [9]],
            [GREEDY, GREEDY, SamplingParams(logit_bias={VOCAB: -1.0})],
            r"prompt 2 of 3: .*logit_bias token id 512",
        ),
    ],
)
def test_bad_request_queues_nothing_and_engine_stays_correct(
    llm, expected, good_call_steps, prompts, params, match
):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, progress=False)
    assert_idle(llm)
    assert_good_call(llm, expected, good_call_steps)


# ---------------------------------------------------------------- a step that raises


def fail_once(monkeypatch, obj, name: str, at_call: int) -> list[int]:
    """Make ``obj.name`` raise on its ``at_call``-th call (from 1), then behave again."""
    original = getattr(obj, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


@pytest.mark.parametrize(
    "where",
    [
        "execute_model",  # before the runner applies the step
        "compute_logits",  # inside the forward step, after the batch took the step's requests
        "_sample",  # in sample_tokens, after execute_model succeeded
    ],
)
@pytest.mark.parametrize("at_call", [1, 3])  # the first prefill; mid-generation
def test_failed_step_aborts_the_call_frees_blocks_and_engine_goes_on(
    llm, expected, good_call_steps, monkeypatch, where, at_call
):
    runner = llm.runner
    target = runner.model if where == "compute_logits" else runner
    calls = fail_once(monkeypatch, target, where, at_call)
    with pytest.raises(StepFailedError, match="RuntimeError: injected fault") as exc:
        llm.generate(PROMPTS, GREEDY, progress=False)
    err = exc.value
    assert err.failed_req_ids and set(err.failed_req_ids) <= set(err.aborted_req_ids)
    assert f"request(s) {', '.join(err.failed_req_ids)} (prompt(s) " in str(err)
    assert "ready for the next generate()" in str(err)
    assert_idle(llm)
    assert runner.execute_state is None
    assert calls[0] >= at_call
    assert_good_call(llm, expected, good_call_steps)


def test_interrupt_mid_generation_leaves_nothing_queued(llm, expected, monkeypatch):
    """Not wrapped (the caller asked to stop), but the call's requests are cleaned up."""

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.runner, "execute_model", interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, progress=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert_good_call(llm, expected)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 0}, "block_size=0"),
        ({"max_num_batched_tokens": -4}, "max_num_batched_tokens=-4"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes=0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override=1"),
        ({"num_threads": 0}, "num_threads=0"),
        ({"blocksize": 16}, "blocksize: unknown field"),
    ],
)
def test_runner_config_rejects_bad_sizes_in_one_line(kwargs, field):
    with pytest.raises(ConfigError) as exc:
        RunnerConfig(**kwargs)
    message = str(exc.value)
    assert message.startswith(f"RunnerConfig.{field}") and "\n" not in message
    config = RunnerConfig()
    with pytest.raises(ConfigError, match="block_size=0"):
        config.block_size = 0  # assignment is checked too
    assert config.block_size == 16


def test_two_bad_fields_give_one_line_each():
    with pytest.raises(ConfigError) as exc:
        RunnerConfig(block_size=0, max_num_seqs=-1)
    lines = str(exc.value).splitlines()
    assert len(lines) == 2 and {line.split("=")[0] for line in lines} == {
        "RunnerConfig.block_size",
        "RunnerConfig.max_num_seqs",
    }


def test_engine_config_checks_device_and_travels_to_workers():
    base = dict(
        model_dir="m", compilation_config=cr.CompilationConfig(), runner_config=RunnerConfig()
    )
    with pytest.raises(ConfigError, match=r"EngineConfig.device='bogus': unknown device .*'cpu'"):
        EngineConfig(**base, device="bogus")
    with pytest.raises(ConfigError, match="EngineConfig.tensor_parallel_size=0"):
        EngineConfig(**base, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="EngineConfig.dtype=torch.int64"):
        EngineConfig(**base, dtype=torch.int64)
    config = EngineConfig(**base, device="cpu", dtype=torch.bfloat16)
    again = pickle.loads(pickle.dumps(config))  # the mp executor sends it to spawned workers
    assert again == config and again.dtype is torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_is_rejected_before_loading(model_dirs):
    with pytest.raises(ConfigError, match=r"device='cuda': CUDA is not available.*device='cpu'"):
        LLM(model_dirs("llama"), EAGER, device="cuda")


def test_max_model_len_past_the_models_positions_is_rejected_at_start_up(model_dirs):
    with pytest.raises(ConfigError) as exc:
        LLM(model_dirs("llama"), EAGER, max_model_len=513)
    message = str(exc.value)
    assert "max_model_len=513" in message and "max_position_embeddings=512" in message
    assert "set max_model_len to at most 512" in message and "\n" not in message


def test_bad_llm_sizes_fail_before_start_up(model_dirs):
    with pytest.raises(ConfigError, match="RunnerConfig.block_size=0"):
        LLM(model_dirs("llama"), EAGER, block_size=0)
    with pytest.raises(ConfigError, match="EngineConfig.tensor_parallel_size=0"):
        LLM(model_dirs("llama"), EAGER, tensor_parallel_size=0)
