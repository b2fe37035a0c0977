"""`compile-runtime serve` with the real `openai` client, against a real server on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
import openai
from serving import CONFIG, MAX_MODEL_LEN, RunningServer, chat_model_dir, get

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.llm import LLM

pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "the quick brown fox", "one two three", "a compiler turns"]


@pytest.fixture(scope="module")
def chat_model(model_dirs, tmp_path_factory):
    """The tiny llama with a chat template in its tokenizer config."""
    return chat_model_dir(model_dirs("llama"), str(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def server(chat_model):
    s = RunningServer(chat_model, "--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(chat_model):
    """What LLM.generate gives for the same prompts (greedy, 12 tokens)."""
    llm = LLM(chat_model, CONFIG, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    return {p: o for p, o in zip(PROMPTS, outputs, strict=True)}


def complete(server, prompt, **kwargs):
    request = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}, **kwargs}
    return server.client.completions.create(model=server.model, prompt=prompt, **request)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list()] == [server.model]
    assert get(server.url + "/health")[0] == 200


def test_greedy_completions_match_offline_generate(server, offline):
    for prompt in PROMPTS:
        response = complete(server, prompt)
        (choice,) = response.choices
        assert choice.model_extra["token_ids"] == offline[prompt].outputs[0].token_ids
        assert choice.text == offline[prompt].outputs[0].text
        assert choice.finish_reason == "length"
        assert response.usage.completion_tokens == 12
        assert response.usage.prompt_tokens == len(offline[prompt].prompt_token_ids)
    by_ids = complete(server, offline[PROMPTS[0]].prompt_token_ids)  # token ids as the prompt
    assert by_ids.choices[0].model_extra["token_ids"] == offline[PROMPTS[0]].outputs[0].token_ids


def test_streamed_text_equals_the_whole_response(server, offline):
    for prompt in PROMPTS[:2]:
        pieces, finish = [], None
        for chunk in complete(server, prompt, stream=True):
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        assert "".join(pieces) == offline[prompt].outputs[0].text
        assert finish == "length"


def test_vllm_bench_clients_payload_is_served(server, offline):
    """What ``vllm bench serve`` sends: vLLM's extra sampling fields, at their neutral values,
    are taken (a repetition penalty of 1.0 and min_tokens 0 change nothing)."""
    extra = {"ignore_eos": True, "repetition_penalty": 1.0, "min_tokens": 0}
    response = complete(server, PROMPTS[0], logprobs=None, extra_body=extra)
    assert response.choices[0].model_extra["token_ids"] == offline[PROMPTS[0]].outputs[0].token_ids


def test_stop_string_ends_the_text_before_it(server, offline):
    text = offline[PROMPTS[0]].outputs[0].text
    stop = text[3:6]
    response = complete(server, PROMPTS[0], stop=[stop])
    assert response.choices[0].text == text[: text.find(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_chat_completion_through_the_template(server, chat_model):
    messages = [{"role": "user", "content": "hello"}]
    response = server.client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0
    )
    llm_text = response.choices[0].message.content
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = complete(server, list(ids), max_tokens=6, extra_body={})
    expected = expected.choices[0].model_extra["token_ids"]
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(ids)
    stripped = tok.decode(expected, skip_special_tokens=True)
    assert llm_text == stripped or response.choices[0].finish_reason == "stop"


def test_chat_without_a_template_is_a_400(model_dirs):
    s = RunningServer(model_dirs("llama"))
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            s.client.chat.completions.create(
                model=s.model, messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        s.stop()


def test_32_concurrent_clients_all_get_their_tokens(server, offline):
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: complete(server, p), jobs))
    for prompt, response in zip(jobs, results, strict=True):
        assert response.choices[0].model_extra["token_ids"] == offline[prompt].outputs[0].token_ids


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    aborted_before = server.metric('compile_runtime_requests_finished_total{finish_reason="abort"')
    stream = server.client.completions.create(
        model=server.model,
        prompt="hello",
        max_tokens=100,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("compile_runtime_kv_blocks_in_use") > 0:
        time.sleep(0.2)
    assert server.metric("compile_runtime_kv_blocks_in_use") == 0
    assert server.metric("compile_runtime_requests_running") == 0
    aborted = server.metric('compile_runtime_requests_finished_total{finish_reason="abort"')
    assert aborted == aborted_before + 1


def test_an_unknown_model_is_a_404_as_vllm_answers(server):
    with pytest.raises(openai.NotFoundError, match="`not-this-one` does not exist") as err:
        server.client.completions.create(model="not-this-one", prompt=PROMPTS[0], max_tokens=4)
    assert err.value.status_code == 404
    assert err.value.body["param"] == "model" and err.value.body["type"] == "not_found_error"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"prompt": "hello " * 200}, "max_model_len"),
        ({"max_tokens": 100000}, "max_model_len"),
        ({"prompt": [5, 6, 10**9]}, "vocab"),
        ({"prompt": []}, "empty"),
    ],
    ids=["temperature", "long prompt", "max_tokens", "token id", "empty"],
)
def test_bad_requests_are_400_and_the_server_goes_on(server, offline, kwargs, match):
    request = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 12, **kwargs}
    with pytest.raises(openai.BadRequestError, match=match) as err:
        server.client.completions.create(**request)
    assert err.value.status_code == 400
    assert complete(server, PROMPTS[0]).choices[0].model_extra["token_ids"] == (
        offline[PROMPTS[0]].outputs[0].token_ids
    )


def test_metrics_count_tokens_and_steps(server):
    complete(server, PROMPTS[0])
    assert server.metric("compile_runtime_generation_tokens_total") >= 12
    assert server.metric("compile_runtime_prompt_tokens_total") > 0
    assert server.metric("compile_runtime_steps_total") > 0
    assert server.metric("compile_runtime_time_to_first_token_seconds_count") > 0


def test_metrics_report_prefix_cache_hits(server):
    prompt = "a system prompt that two requests share " * 2
    hits = server.metric("compile_runtime_prefix_cache_hits_total")
    queries = server.metric("compile_runtime_prefix_cache_queries_total")
    complete(server, prompt + "first")
    complete(server, prompt + "second")
    assert server.metric("compile_runtime_prefix_cache_hits_total") - hits >= 16  # a block
    assert server.metric("compile_runtime_prefix_cache_queries_total") - queries > 32


def test_echo_returns_the_prompt_and_its_logprobs(server, chat_model):
    """As evaluation harnesses use it: echo + logprobs scores the prompt's own tokens."""
    prompt = PROMPTS[0]
    response = complete(server, prompt, echo=True, logprobs=2, max_tokens=2)
    (choice,) = response.choices
    llm = LLM(chat_model, CONFIG, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    (expected,) = llm.generate([prompt], params, use_tqdm=False)
    llm.shutdown()
    n_prompt = len(expected.prompt_token_ids)
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == n_prompt + 2 and logprobs[0] is None
    want = [lp[0] for lp in expected.prompt_logprobs[1:]]
    assert logprobs[1:n_prompt] == pytest.approx(want, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="echo is not supported with stream"):
        complete(server, prompt, echo=True, stream=True)


def test_speculative_server_streams_the_offline_tokens(chat_model, offline):
    """Several tokens a step per request (accepted drafts) reach the stream one by one."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    s = RunningServer(chat_model, "--speculative-config", spec)
    try:
        for prompt in PROMPTS:
            stream = complete(s, prompt, stream=True)
            ids = [t for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]]
            assert ids == offline[prompt].outputs[0].token_ids
        assert s.metric("compile_runtime_spec_decode_draft_tokens_total") > 0
    finally:
        s.stop()


def test_sigterm_lets_the_running_request_finish(model_dirs):
    s = RunningServer(model_dirs("llama"))
    stream = s.client.completions.create(
        model=s.model,
        prompt="hello",
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    s.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    tokens = "".join(c.choices[0].text for c in [first, *rest])
    assert len(tokens) > 0
    # uvicorn ends by re-raising the signal it caught, after the drain and our shutdown.
    assert s.proc.wait(60) in (0, -signal.SIGTERM)
    assert "Traceback" not in s.log()


def test_overload_is_refused_not_queued(chat_model):
    """Past max_waiting a request is refused at once (the server answers 503)."""
    import asyncio

    from compile_runtime.engine.async_engine import AsyncEngine, EngineOverloadedError

    llm = LLM(chat_model, CONFIG, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(llm.core, max_waiting=1)

    async def two() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = engine.submit(llm.core.make_request([5, 6, 7], params))
        with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
            for _ in range(50):  # the first may get its token between two submits
                engine.submit(llm.core.make_request([5, 6, 7], params))
        return [e.token async for e in engine.events(first) if hasattr(e, "token")]

    try:
        assert len(asyncio.run(two())) == 4
    finally:
        engine.shutdown()
        llm.shutdown()
