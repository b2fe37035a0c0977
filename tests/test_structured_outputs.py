"""Structured outputs: the real model's outputs match their JSON schema, regex or choice; free
requests sharing the batch are untouched; speculation gives the same greedy tokens; a bad
constraint is an error naming it."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("jsonschema")
pytest.importorskip("hypothesis")
import jsonschema
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compile_runtime as cr
from compile_runtime.core.sampling_params import StructuredOutputsParams as Constraint
from compile_runtime.models.smollm2 import smollm2_gguf
from compile_runtime.worker.grammar_bitmask import apply_grammar_bitmask

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
}
ASK = [{"role": "user", "content": "Give me the capital of France as JSON."}]


def constrained(constraint: Constraint, **kw) -> cr.SamplingParams:
    return cr.SamplingParams(
        temperature=0, max_tokens=kw.pop("max_tokens", 96), structured_outputs=constraint, **kw
    )


@pytest.fixture(scope="module")
def llm():
    engine = cr.LLM(smollm2_gguf(), dtype="float32")
    yield engine
    engine.shutdown()


def test_a_json_schema_output_parses_and_validates(llm):
    (out,) = llm.chat(ASK, constrained(Constraint(json=CITY)), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    value = json.loads(c.text)
    jsonschema.validate(value, CITY)
    assert value["city"] == "Paris"
    free = llm.chat(ASK, cr.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert not free.outputs[0].text.lstrip().startswith("{")  # the constraint made the JSON


def test_regex_choice_and_json_object(llm):
    phone = Constraint(regex=r"[0-9]{3}-[0-9]{4}")
    sampled = cr.SamplingParams(
        temperature=0.9, seed=3, max_tokens=20, structured_outputs=phone, top_p=0.9
    )
    (out,) = llm.generate("My phone number is", sampled, use_tqdm=False)
    assert (
        re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.outputs[0].text)
        and out.outputs[0].finish_reason == "stop"
    )
    yes_no = Constraint(choice=["yes", "no"])
    question = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    (answer,) = llm.chat(question, constrained(yes_no), use_tqdm=False)
    assert answer.outputs[0].text in {"yes", "no"}
    one_key = [
        {"role": "user", "content": "Answer as a JSON object with one key 'capital': what is "
         "the capital of France?"}
    ]  # fmt: skip
    (obj,) = llm.chat(one_key, constrained(Constraint(json_object=True)), use_tqdm=False)
    assert json.loads(obj.outputs[0].text) == {"capital": "Paris"}


def test_free_requests_in_a_constrained_batch_get_the_same_tokens(llm):
    free = cr.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["The capital of France is", "Answer in JSON:", "Phone:"],
        [free, constrained(Constraint(json=CITY)), constrained(Constraint(regex=r"[0-9]{7}"))],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), CITY)
    assert re.fullmatch(r"[0-9]{7}", mixed[2].outputs[0].text)


def test_speculation_gives_the_same_constrained_tokens():
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with cr.LLM(smollm2_gguf(), dtype="float32", speculative_config=ngram) as spec:
        prompt = [{"role": "user", "content": "List three French cities as a JSON array."}]
        schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        params = constrained(Constraint(json=schema), max_tokens=64)
        got = spec.chat([prompt, ASK], [params, constrained(Constraint(json=CITY))])
        proposed = spec.last_stats.spec_decode.num_draft_tokens
    with cr.LLM(smollm2_gguf(), dtype="float32") as plain:
        want = plain.chat([prompt, ASK], [params, constrained(Constraint(json=CITY))])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert proposed > 0  # drafts were proposed and verified under the grammar
    jsonschema.validate(json.loads(got[0].outputs[0].text), schema)


SIMPLE_FIELDS = st.sampled_from(
    [
        {"type": "integer", "minimum": 0, "maximum": 100},
        {"type": "boolean"},
        {"type": "string", "maxLength": 8},
        {"enum": ["red", "green", "blue"]},
    ]
)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fields=st.dictionaries(
        st.sampled_from(["name", "age", "color", "ok", "size"]),
        SIMPLE_FIELDS,
        min_size=1,
        max_size=3,
    )
)
def test_outputs_validate_against_simple_schemas(llm, fields):
    schema = {"type": "object", "properties": fields, "required": sorted(fields)}
    prompt = [{"role": "user", "content": f"Describe a cat as JSON with {', '.join(fields)}."}]
    (out,) = llm.chat(prompt, constrained(Constraint(json=schema), max_tokens=128), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_bad_constraint_is_an_error_naming_it(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid.*objectz"):
        llm.generate("x", constrained(Constraint(json='{"type": "objectz"}')))
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid"):
        llm.generate("x", constrained(Constraint(json="{not json")))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is not valid"):
        llm.generate("x", constrained(Constraint(regex="[unclosed")))
    with pytest.raises(ValueError, match="exactly one of"):
        Constraint(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice is empty"):
        Constraint(choice=[])
    assert llm.core.scheduler.requests == {}  # nothing was queued


def test_the_bitmask_masks_exactly_the_disallowed_tokens():
    logits = torch.randn(5, 70)
    allowed = torch.rand(2, 70) < 0.3
    words = np.zeros((2, 3), dtype=np.int32)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(2**31))
    expected = logits.clone()
    expected[2:4][~allowed] = float("-inf")
    apply_grammar_bitmask(logits, {"a": 2, "b": 0}, {"a": words})
    torch.testing.assert_close(logits, expected)


def test_grammars_survive_preemption_and_serve_each_sample(llm):
    prompts = [ASK] * 6
    params = constrained(Constraint(json=CITY))
    want = [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]
    with cr.LLM(smollm2_gguf(), dtype="float32", num_gpu_blocks_override=12) as small:
        got = small.chat(prompts, params, use_tqdm=False)
        assert small.core.scheduler.num_preemptions > 0  # requests were preempted and resumed
        sampled = cr.SamplingParams(
            n=3, temperature=1.0, seed=5, max_tokens=96, structured_outputs=Constraint(json=CITY)
        )
        (three,) = small.chat(ASK, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    for c in three.outputs:
        jsonschema.validate(json.loads(c.text), CITY)


def test_a_token_outside_the_grammar_aborts_its_request_never_a_quiet_answer():
    from transformers import AutoTokenizer

    from compile_runtime.core.request import Request, RequestStatus
    from compile_runtime.core.structured_output import StructuredOutputManager
    from compile_runtime.models.gguf import gguf_model_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_model_dir(smollm2_gguf()))
    manager = StructuredOutputManager(tokenizer, 49152, (2,))
    req = Request("r", [1], constrained(Constraint(regex="[0-9]")))
    manager.start(req)
    assert manager.ready(req, wait=True)
    digit, letter = tokenizer.encode("7")[0], tokenizer.encode("x")[0]
    assert manager.accept("r", [letter]) is RequestStatus.FINISHED_ABORTED
    manager.free("r")
    manager.start(req)
    manager.ready(req, wait=True)
    assert manager.accept("r", [digit]) is None  # complete, waiting for the stop token
    assert manager.accept("r", [2]) is RequestStatus.FINISHED_STOPPED


@pytest.mark.slow
def test_tensor_parallel_and_the_prefix_cache_keep_the_constrained_tokens(model_dirs):
    """Rank 0's grammar decides: two ranks give the tokens one does, and a second call that
    reads the prompts from the prefix cache gives them again."""
    prompts = [list(range(5, 25)), list(range(5, 25)) + [40, 41]]
    params = [
        constrained(Constraint(regex="[0-9]{2}-[a-z]{3}"), max_tokens=16),
        constrained(Constraint(choice=["alpha", "beta", "gamma"]), max_tokens=16),
        cr.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # a free one
    ]
    options = dict(max_num_seqs=4, max_model_len=96)

    def run(llm):
        return [
            [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
            for p in params
        ]

    with cr.LLM(model_dirs("llama"), {"backend": "eager"}, **options) as one:
        expected = run(one)
    with cr.LLM(model_dirs("llama"), {"backend": "eager"}, tensor_parallel_size=2,
                distributed_executor_backend="mp", **options) as two:  # fmt: skip
        assert run(two) == expected
        assert run(two) == expected and two.last_stats.prefix_cache.hits > 0
    texts = [one.tokenizer.decode(t, skip_special_tokens=True) for t in expected[0]]
    assert all(re.fullmatch("[0-9]{2}-[a-z]{3}", t) for t in texts), texts
