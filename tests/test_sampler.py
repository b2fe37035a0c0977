"""Sampler: penalties, bias, min_tokens, top-k/top-p, greedy, seeds, logprobs.

Expected numbers are worked out by hand in the comments, not recomputed
with the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.worker.sampler import (
    Sampler,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    draw_tokens,
)
from compile_runtime.worker.sampling_metadata import (
    RequestSamplingState,
    SamplingMetadata,
    make_generator,
)

INF = float("inf")


def metadata(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: int | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    generators = generators or [None] * n
    states = [
        RequestSamplingState(p, pr, out, () if eos is None else (eos,), g)
        for p, pr, out, g in zip(params, prompts, outputs, generators, strict=True)
    ]
    return SamplingMetadata.from_requests(states, vocab_size=vocab)


def assert_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=0, atol=1e-6)


ROW = [[2.0, -1.0, 0.5, 3.0]]


# ----------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # token 0 seen in the prompt (2.0 -> 2.0/2), token 1 in the output (-1.0 -> -1.0*2);
    # tokens 2, 3 never seen: unchanged.
    md = metadata([SamplingParams(repetition_penalty=2.0)], 4, prompts=[[0]], outputs=[[1, 1]])
    assert_close(apply_penalties(torch.tensor(ROW), md), [[1.0, -2.0, 0.5, 3.0]])


def test_frequency_penalty_scales_with_output_count_only():
    # output [1, 1, 3]: token 1 -= 0.5*2, token 3 -= 0.5*1; prompt token 0 untouched.
    md = metadata([SamplingParams(frequency_penalty=0.5)], 4, prompts=[[0]], outputs=[[1, 1, 3]])
    assert_close(apply_penalties(torch.tensor(ROW), md), [[2.0, -2.0, 0.5, 2.5]])


def test_presence_penalty_subtracts_once_per_present_output_token():
    # output [1, 1, 3]: tokens 1 and 3 each -= 0.25 once; prompt token 0 untouched.
    md = metadata([SamplingParams(presence_penalty=0.25)], 4, prompts=[[0]], outputs=[[1, 1, 3]])
    assert_close(apply_penalties(torch.tensor(ROW), md), [[2.0, -1.25, 0.5, 2.75]])


def test_penalties_are_per_row_in_a_batch():
    # row 0: repetition 2 on prompt [3] and output [0] -> [1.0, -1.0, 0.5, 1.5], then
    #        frequency 1 on output [0] -> token 0: 1.0 - 1 = 0.0
    # row 1: no penalties, same history -> unchanged
    # row 2: presence 1 on output [2, 2] -> token 2: 0.5 - 1 = -0.5
    md = metadata(
        [
            SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
            SamplingParams(),
            SamplingParams(presence_penalty=1.0),
        ],
        4,
        prompts=[[3], [3], [0, 1, 2, 3]],
        outputs=[[0], [0], [2, 2]],
    )
    got = apply_penalties(torch.tensor(ROW * 3), md)
    assert_close(got, [[0.0, -1.0, 0.5, 1.5], [2.0, -1.0, 0.5, 3.0], [2.0, -1.0, -0.5, 3.0]])


def test_no_penalty_fields_when_no_request_uses_them():
    md = metadata([SamplingParams()], 4, prompts=[[0]], outputs=[[1]])
    assert md.repetition_penalties is None and md.output_token_ids is None
    logits = torch.tensor(ROW)
    assert apply_penalties(logits, md) is logits


# ----------------------------------------------------------------- bias, min_tokens


def test_logit_bias_adds_to_listed_tokens():
    md = metadata([SamplingParams(logit_bias={1: 5.0, 2: -1.0})], 4)
    logits = torch.tensor(ROW)
    apply_logit_bias(logits, md)
    assert_close(logits, [[2.0, 4.0, -0.5, 3.0]])


def test_logit_bias_changes_greedy_choice():
    logits = torch.tensor(ROW * 2)
    md = metadata(
        [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={1: 5})], 4
    )
    assert Sampler()(logits, md).token_ids.tolist() == [3, 1]


def test_logit_bias_outside_vocab_is_rejected():
    with pytest.raises(ValueError, match=r"token id 9 .*\[0, 4\)"):
        metadata([SamplingParams(logit_bias={9: 1.0})], 4)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 2.0]])  # EOS=2 best, stop id 3 next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    md = metadata([params], 5, outputs=[[1]], eos=2)
    masked = logits.clone()
    apply_min_tokens(masked, md)
    assert_close(masked, [[0.0, 1.0, -INF, -INF, 2.0]])
    assert Sampler()(logits, md).token_ids.tolist() == [4]
    # Once min_tokens outputs exist, EOS is allowed again.
    md = metadata([params], 5, outputs=[[1, 1]], eos=2)
    assert md.min_tokens_mask is None
    assert Sampler()(logits, md).token_ids.tolist() == [2]


def test_min_tokens_without_eos_id_masks_stop_ids_only():
    md = metadata([SamplingParams(min_tokens=1, stop_token_ids=[3])], 5, eos=None)
    rows, toks = md.min_tokens_mask
    assert rows.tolist() == [0] and toks.tolist() == [3]


# ----------------------------------------------------------------- top-k / top-p


def kept(filtered: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(r > -INF).flatten().tolist() for r in filtered]


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    got = apply_top_k_top_p(logits, torch.tensor([2, 4]), None)
    assert_close(got, [[-INF, 4.0, 3.0, -INF], [1.0, 4.0, 3.0, 2.0]])


# probabilities 0.15, 0.5, 0.05, 0.3 (shuffled so sorting matters)
PROBS = [0.15, 0.5, 0.05, 0.3]
LOG_PROBS = [[math.log(p) for p in PROBS]]


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [1]),  # 0.5 alone already reaches 0.4
        (0.75, [1, 3]),  # 0.5 < 0.75 <= 0.5 + 0.3
        (0.9, [0, 1, 3]),  # 0.8 < 0.9 <= 0.95
        (1.0, [0, 1, 2, 3]),
        (0.01, [1]),  # always at least the most likely token
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected):
    got = apply_top_k_top_p(torch.tensor(LOG_PROBS), None, torch.tensor([top_p]))
    assert kept(got) == [expected]


def test_top_k_then_top_p_per_row():
    logits = torch.tensor(LOG_PROBS * 2)
    # row 0: top-k 3 keeps {1, 3, 0}; top-p 1.0 keeps them. row 1: top-p 0.75 keeps {1, 3}.
    got = apply_top_k_top_p(logits, torch.tensor([3, 4]), torch.tensor([1.0, 0.75]))
    assert kept(got) == [[0, 1, 3], [1, 3]]


def test_sampling_respects_top_p_and_frequencies():
    # top_p 0.75 keeps tokens 1 and 3, renormalised to 0.5/0.8 = 0.625 and 0.375.
    n = 4000
    md = metadata([SamplingParams(top_p=0.75)] * n, 4)
    torch.manual_seed(0)
    tokens = Sampler()(torch.tensor(LOG_PROBS * n), md).token_ids
    assert set(tokens.tolist()) <= {1, 3}
    assert abs((tokens == 1).float().mean().item() - 0.625) < 0.03


def test_temperature_flattens_distribution():
    # probs 0.7/0.2/0.1 at temperature 2 become sqrt(p)/sum: 0.5229, 0.2795, 0.1976.
    n = 6000
    md = metadata([SamplingParams(temperature=2.0)] * n, 3)
    torch.manual_seed(0)
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]] * n)
    tokens = Sampler()(logits, md).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5229, 0.2795, 0.1976]), atol=0.03, rtol=0)


def test_draws_follow_unnormalised_rows_and_skip_tokens_without_mass():
    # Masses 3 and 1 on tokens 1 and 3 (0.75 / 0.25), zeros around and after them.
    n = 8000
    probs = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.0]]).repeat(n, 1)
    torch.manual_seed(0)
    tokens = draw_tokens(probs, {})
    assert set(tokens.tolist()) == {1, 3}
    assert abs((tokens == 1).float().mean().item() - 0.75) < 0.02


def test_a_seeded_row_takes_one_number_from_its_generator_whatever_the_vocabulary():
    # One uniform per row, not one per token: the cost of a draw does not grow with the
    # vocabulary's random numbers, and a seeded request's stream advances by one a token.
    gen, twin = make_generator(5), make_generator(5)
    draw_tokens(torch.rand(2, 49152), {1: gen})
    torch.rand(1, generator=twin)
    assert torch.rand(1, generator=gen).item() == torch.rand(1, generator=twin).item()


def test_a_draw_at_the_top_of_the_range_takes_the_last_token_with_mass(monkeypatch):
    # u x total can round up to the total: the draw must still land on token 3, not on a
    # zero after it. u = 1 exactly stands for that rounding.
    def top_of_range(shape, *, dtype, device, generator=None):
        return torch.ones(shape, dtype=dtype, device=device)

    monkeypatch.setattr(torch, "rand", top_of_range)
    probs = torch.tensor([[0.2, 0.5, 0.0, 0.3, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert draw_tokens(probs, {}).tolist() == [3, 5]  # a row of zeros stays in range


# ----------------------------------------------------------------- greedy, seeds


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.tensor([[0.1, 0.9, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.2]])
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0)]
    md = metadata(params, 3)
    assert not md.all_greedy and not md.all_random
    out = Sampler()(logits, md).token_ids
    assert out[0].item() == 1 and out[2].item() == 2
    assert out.dtype == torch.int64 and out.shape == (3,)


def _seeded_run(seed: int, others_before: int, others_after: int, steps: int = 6) -> list[int]:
    """Draw `steps` tokens for one seeded request surrounded by unseeded ones."""
    vocab = 50
    gen = make_generator(seed)
    torch.manual_seed(1234 + others_before)  # the global RNG differs per run
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(99))
    params = SamplingParams(seed=seed, top_k=20, top_p=0.95)
    tokens = []
    for _ in range(steps):
        n = others_before + 1 + others_after
        batch = torch.randn(n, vocab)
        batch[others_before] = logits[0]
        plist = [SamplingParams()] * n
        plist[others_before] = params
        gens: list[torch.Generator | None] = [None] * n
        gens[others_before] = gen
        md = metadata(plist, vocab, generators=gens)
        tokens.append(Sampler()(batch, md).token_ids[others_before].item())
    return tokens


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    alone = _seeded_run(7, 0, 0)
    assert _seeded_run(7, 0, 0) == alone
    assert _seeded_run(7, 3, 2) == alone
    assert _seeded_run(7, 5, 0) == alone
    assert len(set(alone)) > 1  # successive steps draw fresh numbers
    assert _seeded_run(8, 0, 0) != alone


def test_seed_without_generator_is_an_error():
    with pytest.raises(ValueError, match="make_generator"):
        metadata([SamplingParams(seed=3)], 4)


# ----------------------------------------------------------------- logprobs, dtype


def test_logprobs_come_from_raw_logits():
    # log_softmax([1, 2, 3, 4]) = x - 4.44019 (logsumexp = 4 + ln(1.50321))
    expected = [-3.44019, -2.44019, -1.44019, -0.44019]
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)
    params = [
        # Bias, penalty and temperature steer the choice to token 0, but the
        # reported logprobs still describe the model's raw distribution.
        SamplingParams(temperature=0, logit_bias={0: 10.0}, repetition_penalty=3.0, logprobs=2),
        SamplingParams(temperature=0.5, logprobs=0),
        SamplingParams(),
    ]
    md = metadata(params, 4, prompts=[[3], [], []], outputs=[[3], [], []])
    out = Sampler()(logits, md)
    assert out.token_ids[0].item() == 0
    chosen, top = out.logprobs[0]
    assert chosen == pytest.approx(expected[0], abs=1e-4)
    assert [t for t, _ in top] == [3, 2]
    assert [lp for _, lp in top] == pytest.approx([expected[3], expected[2]], abs=1e-4)
    chosen1, top1 = out.logprobs[1]
    assert chosen1 == pytest.approx(expected[out.token_ids[1].item()], abs=1e-4)
    assert top1 == []
    assert out.logprobs[2] is None


def test_low_precision_logits_accepted_and_left_untouched():
    logits = torch.tensor(ROW, dtype=torch.bfloat16)
    before = logits.clone()
    md = metadata([SamplingParams(temperature=0, logit_bias={1: 5.0}, presence_penalty=1.0)], 4)
    assert Sampler()(logits, md).token_ids.tolist() == [1]
    assert torch.equal(logits, before)


def test_logits_shape_must_match_batch():
    with pytest.raises(ValueError, match="num_reqs=2"):
        Sampler()(torch.zeros(3, 4), metadata([SamplingParams()] * 2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_equal_argmax_with_ties_nan_and_inf(dtype):
    """greedy_tokens (numpy on a CPU): its indices must be argmax's, first index on ties."""
    from compile_runtime.worker.sampler import greedy_tokens

    torch.manual_seed(0)
    logits = torch.randint(0, 4, (6, 5000)).to(dtype)  # many ties in every row
    logits[1, 77] = float("nan")
    logits[2] = float("-inf")
    logits[3, :10] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
