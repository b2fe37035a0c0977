"""benchmarks/perplexity.py's arithmetic: windows and stride, our prompt-logprob NLL against a
direct transformers computation on a tiny model, the numpy NLL of the llama.cpp side, and the
fixed text's length in the real model's tokens."""

from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EAGER = {"backend": "eager"}


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ppl = _load("perplexity_benchmark", os.path.join(ROOT, "benchmarks", "perplexity.py"))
# benchmarks/perplexity.py put benchmarks/peers on sys.path: the worker imports its sibling.
ppl_worker = _load(
    "perplexity_worker", os.path.join(ROOT, "benchmarks", "peers", "perplexity_worker.py")
)


def scored_positions(windows) -> list[int]:
    """The text positions each window scores, via scored_nll (NLL = the position itself)."""
    per_window = [[float(i) for i in range(w.start + 1, w.end)] for w in windows]
    return [int(x) for x in ppl.scored_nll(windows, per_window)]


@pytest.mark.parametrize("n", [2, 100, 511, 512, 513, 1024, 1025, 3968])
def test_windows_without_overlap_score_each_token_once_but_window_starts(n):
    windows = ppl.make_windows(n, 512, 512)
    assert [w.start for w in windows] == list(range(0, n - 1, 512))  # each has >= 2 tokens
    assert all(w.end - w.start <= 512 and w.first_scored == w.start + 1 for w in windows)
    starts = {w.start for w in windows}
    scored = scored_positions(windows)
    # A last window of one token has no context: it is not made, and its token not scored.
    assert windows[-1].end == (n if n % 512 != 1 else n - 1)
    assert scored == [i for i in range(windows[-1].end) if i not in starts]  # in order, once


@pytest.mark.parametrize("n,window,stride", [(100, 32, 8), (100, 32, 31), (513, 512, 256)])
def test_overlapping_windows_score_every_token_but_the_first_once(n, window, stride):
    windows = ppl.make_windows(n, window, stride)
    assert scored_positions(windows) == list(range(1, n))
    assert windows[-1].end == n
    for w in windows:
        assert w.end - w.start <= window and w.start < w.first_scored < w.end
    assert [w.start for w in windows] == [i * stride for i in range(len(windows))]


def test_window_arguments_are_checked():
    for window, stride in [(1, 1), (8, 0), (8, 9)]:
        with pytest.raises(ValueError):
            ppl.make_windows(100, window, stride)
    with pytest.raises(ValueError, match="scores"):
        ppl.scored_nll(ppl.make_windows(10, 4, 4), [[0.0]] * 3)


def test_perplexity_and_leading_equal():
    assert ppl.perplexity([math.log(4.0)] * 3) == pytest.approx(4.0)
    assert ppl.perplexity([0.0, 2.0]) == pytest.approx(math.e)
    assert ppl.leading_equal([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert ppl.leading_equal([1, 2], [1, 2, 3]) == 2
    assert ppl.leading_equal([], [1]) == 0


@pytest.fixture(scope="module")
def tiny(model_dirs):
    """A tiny llama, a 70-token text, its windows, and transformers' NLL per window."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs("llama")
    rng = random.Random(0)
    ids = [rng.randrange(3, 500) for _ in range(70)]
    windows = ppl.make_windows(len(ids), 32, 32)  # 32 + 32 + 6 tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference, logits = [], []
    with torch.inference_mode():
        for w in windows:
            window_ids = torch.tensor([ids[w.start : w.end]])
            out = hf(window_ids).logits[0].double()
            logp = torch.log_softmax(out, dim=-1)[:-1]
            reference.append((-logp.gather(1, window_ids[0, 1:, None])[:, 0]).tolist())
            logits.append(out[:-1].float().numpy())
    return SimpleNamespace(
        model_dir=model_dir, ids=ids, windows=windows, ref=reference, logits=logits
    )


def test_our_prompt_logprob_nll_equals_transformers(tiny):
    import compile_runtime as cr

    # Small chunks and blocks: windows split over steps and share the batch.
    llm = cr.LLM(tiny.model_dir, EAGER, max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    side = SimpleNamespace(cr=cr, llm=llm)
    ours = ppl_worker.nll_ours(side, [tiny.ids[w.start : w.end] for w in tiny.windows])
    assert [len(n) for n in ours] == [31, 31, 5]
    for got, want in zip(ours, tiny.ref, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    ours_ppl = ppl.perplexity(ppl.scored_nll(tiny.windows, ours))
    ref_ppl = ppl.perplexity(ppl.scored_nll(tiny.windows, tiny.ref))
    assert ours_ppl == pytest.approx(ref_ppl, rel=1e-4)


def test_llamacpp_side_nll_from_logits_equals_torch(tiny):
    for w, logits, want in zip(tiny.windows, tiny.logits, tiny.ref, strict=True):
        got = ppl_worker.nll_from_logits(logits, tiny.ids[w.start + 1 : w.end])
        assert got == pytest.approx(want, abs=1e-5)
    # float64 throughout: no overflow on large logits
    big = [[1000.0, 0.0], [0.0, 1000.0]]
    assert ppl_worker.nll_from_logits(big, [0, 0]) == pytest.approx([0.0, 1000.0])


@pytest.mark.slow  # ~20 s: the real GGUF file's tokenizer is read (once per session cache)
def test_the_text_is_a_few_thousand_real_model_tokens():
    from compile_runtime.models.smollm2 import smollm2_gguf

    path = ppl.TEXT
    assert os.path.isfile(path)
    with open(path) as f:
        text = f.read()
    ids = ppl.tokenizer_of(smollm2_gguf())(text, add_special_tokens=False)["input_ids"]
    assert 2000 <= len(ids) <= 5000
    assert len(set(ids)) > 800  # varied vocabulary, not a repeated paragraph
    assert len(ppl.make_windows(len(ids), 512, 512)) >= 4
