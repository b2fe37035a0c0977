"""The offline API as vLLM's users write it: SamplingParams' fields, RequestOutput.outputs,
n samples, stop strings, LLM.chat, use_tqdm."""

from __future__ import annotations

import pytest
import torch

import compile_runtime as cr
from compile_runtime.worker.sampler import sampling_probs
from compile_runtime.worker.sampling_metadata import SamplingMetadata

PROMPTS = [[5, 6, 7], list(range(10, 30))]


@pytest.fixture(scope="module")
def llm(model_dirs):
    engine = cr.LLM(model_dirs("llama"), {"backend": "eager"}, max_num_seqs=8, max_model_len=96)
    yield engine
    engine.shutdown()


def test_sampling_params_take_vllm_spellings():
    p = cr.SamplingParams(n=3, stop="x", top_k=-1, min_p=0.1)
    assert (p.n, p.stop, p.top_k, p.min_p) == (3, ["x"], 0, 0.1)
    assert cr.SamplingParams(stop=None).stop == []
    with pytest.raises(ValueError, match="detokenize=False"):
        cr.SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="empty string"):
        cr.SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="min_p"):
        cr.SamplingParams(min_p=1.5)


def test_outputs_are_shaped_as_vllms(llm):
    greedy = cr.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    (out,) = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    (completion,) = out.outputs
    assert out.finished and completion.finished() and completion.index == 0
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert len(completion.token_ids) == 6 and completion.text is not None
    assert completion.cumulative_logprob == pytest.approx(sum(lp[0] for lp in completion.logprobs))
    assert out.prompt is None and out.prompt_token_ids == PROMPTS[0]
    # A sample's fields live on its CompletionOutput only (no flat copies of the first's).
    assert not any(hasattr(out, f) for f in ("text", "token_ids", "finish_reason", "logprobs"))
    (no_text,) = llm.generate(
        [PROMPTS[0]], greedy.model_copy(update={"detokenize": False}), use_tqdm=False
    )
    assert no_text.outputs[0].text is None
    assert no_text.outputs[0].token_ids == completion.token_ids
    unasked = llm.generate([PROMPTS[0]], cr.SamplingParams(temperature=0, max_tokens=2))[0]
    assert unasked.outputs[0].cumulative_logprob is None and unasked.outputs[0].logprobs is None


def test_prompts_as_vllms_prompt_dicts(llm):
    """vLLM's TokensPrompt / TextPrompt dicts, alone, in a list, mixed with plain ids."""
    greedy = cr.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    dicts = llm.generate([{"prompt_token_ids": PROMPTS[0]}, PROMPTS[1]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == plain
    assert dicts[0].prompt_token_ids == PROMPTS[0] and dicts[0].prompt is None
    (one,) = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy, use_tqdm=False)
    assert one.outputs[0].token_ids == plain[1]
    if llm.tokenizer is not None:
        (text,) = llm.generate({"prompt": "hello world"}, greedy, use_tqdm=False)
        (same,) = llm.generate("hello world", greedy, use_tqdm=False)
        assert (
            text.prompt == "hello world" and text.outputs[0].token_ids == same.outputs[0].token_ids
        )
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="not text, token ids or a prompt dict"):
        llm.generate([[1, 2], [None]], greedy, use_tqdm=False)


def test_n_samples_per_prompt_with_seeds_one_apart(llm):
    params = cr.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    single = cr.SamplingParams(temperature=1.0, seed=8, max_tokens=8, ignore_eos=True)
    (second,) = llm.generate([PROMPTS[0]], single, use_tqdm=False)
    # sample 1 ran with seed 7 + 1
    assert outs[0].outputs[1].token_ids == second.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    greedy = llm.generate(PROMPTS[:1], cr.SamplingParams(n=2, temperature=0, max_tokens=5))
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids


def test_a_stop_string_ends_the_request_as_stop(llm):
    params = cr.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    (cut,) = llm.generate([PROMPTS[1]], params.model_copy(update={"stop": [stop]}))
    c = cut.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[: text.index(stop)]
    assert c.token_ids == full.outputs[0].token_ids[: len(c.token_ids)] and len(c.token_ids) < 24
    assert llm.core.scheduler.requests == {}  # finished, blocks freed: nothing left running
    kept = params.model_copy(update={"stop": [stop], "include_stop_str_in_output": True})
    (with_stop,) = llm.generate([PROMPTS[1]], kept, use_tqdm=False)
    assert with_stop.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_a_stop_token_id_is_the_stop_reason(llm):
    params = cr.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    token = full.outputs[0].token_ids[3]
    (cut,) = llm.generate([PROMPTS[0]], params.model_copy(update={"stop_token_ids": [token]}))
    assert cut.outputs[0].stop_reason == token and cut.outputs[0].finish_reason == "stop"
    assert (
        cut.outputs[0].token_ids
        == full.outputs[0].token_ids[: full.outputs[0].token_ids.index(token) + 1]
    )


@pytest.mark.parametrize("stop_strings", [[], ["never in the text"]])  # followed or not
def test_the_stop_tokens_text_is_left_out_unless_asked_for(llm, stop_strings):
    """As vLLM: the id of the token that stopped the request is kept, its text is not (an EOS
    id or a stop token id that is no special token, such as Llama 3's <|eot_id|> when a
    tokenizer does not mark it), unless include_stop_str_in_output."""
    percent = llm.tokenizer.convert_tokens_to_ids("%")
    forced = {"temperature": 0, "max_tokens": 8, "logit_bias": {percent: 100.0}}
    for stop in ({"stop_token_ids": [percent]}, {}):  # a stop token id; an EOS id
        params = cr.SamplingParams(**forced, **stop, stop=stop_strings)
        old_eos = llm.core.eos_token_ids
        if not stop:
            llm.core.eos_token_ids = (*old_eos, percent)
        try:
            (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
            (kept,) = llm.generate(
                [PROMPTS[0]], params.model_copy(update={"include_stop_str_in_output": True})
            )
        finally:
            llm.core.eos_token_ids = old_eos
        assert out.outputs[0].token_ids == [percent] and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == "" and kept.outputs[0].text == "%"


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    metadata = SamplingMetadata.__new__(SamplingMetadata)
    metadata.temperature = torch.ones(1)
    metadata.top_k = metadata.top_p = None
    metadata.min_p = torch.tensor([0.5])  # keep p >= 0.25
    probs = sampling_probs(logits, metadata)
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
