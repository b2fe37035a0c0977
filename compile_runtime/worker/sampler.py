"""Turn the last-position logits of each request into one token each.

Order of operations, per row, all in float32:
  logprobs (from the raw logits, so they describe the model, not the knobs)
  -> logit bias -> min_tokens mask -> repetition/frequency/presence penalties
  -> greedy argmax, or temperature -> top-k -> top-p -> random draw.

The random draw inverts each row's cumulative distribution at one uniform
number: the first token whose running total passes u x the row's total. One
number per row, not one per token (a race over the vocabulary with
``exponential_`` cost 8 ms a step on a CPU for 8 rows of 49,152 tokens, most of
a decode step). Drawing a seeded row's number from the request's own generator
makes it reproducible whatever else is in the batch; unseeded rows share one
batched draw from the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile_runtime.worker.sampling_metadata import SamplingMetadata

# (logprob of the chosen token, [(token, logprob), ...] top-k by logprob)
Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass
class SamplerOutput:
    # [num_reqs] int64 on the logits' device.
    token_ids: torch.Tensor
    # Per row; None for requests that did not ask for logprobs.
    logprobs: list[Logprobs | None]


class Sampler:
    """Stateless: all per-request state arrives in the SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits, raw_logprobs = process_logits(logits, metadata)
        token_ids = _choose(logits, metadata)

        logprobs: list[Logprobs | None] = [None] * metadata.num_reqs
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, metadata.num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float32 copy with logit bias, the min_tokens mask and penalties applied, and the raw
    logprobs (before any of them) when a row asks for logprobs."""
    if logits.dim() != 2 or logits.shape[0] != metadata.num_reqs:
        raise ValueError(
            f"logits must be [num_reqs={metadata.num_reqs}, vocab], got {tuple(logits.shape)}"
        )
    # A copy: the processing below is in place and must not touch the caller's tensor.
    logits = logits.to(torch.float32, copy=True)
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1) if metadata.max_num_logprobs is not None else None
    )
    apply_logit_bias(logits, metadata)
    apply_min_tokens(logits, metadata)
    return apply_penalties(logits, metadata), raw_logprobs


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each request's bias to its chosen tokens (in place)."""
    if metadata.logit_bias is not None:
        rows, toks, vals = metadata.logit_bias
        logits.index_put_((rows, toks), vals, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Forbid EOS and stop tokens for requests still below min_tokens (in place)."""
    if metadata.min_tokens_mask is not None:
        rows, toks = metadata.min_tokens_mask
        logits.index_put_((rows, toks), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    if metadata.repetition_penalties is None:
        return logits
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    num_reqs, vocab = logits.shape
    # One extra column catches the padding id (== vocab) and is dropped.
    out_ids = metadata.output_token_ids
    counts = torch.zeros(num_reqs, vocab + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    in_output = counts > 0
    in_prompt = torch.zeros(num_reqs, vocab + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, metadata.prompt_token_ids, True)
    seen = in_prompt[:, :vocab] | in_output

    rep = metadata.repetition_penalties[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - metadata.frequency_penalties[:, None] * counts
    logits = logits - metadata.presence_penalties[:, None] * in_output.float()
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every token outside the row's top-k and outside its top-p nucleus.

    top-p keeps the smallest prefix of tokens (by probability, descending)
    whose total probability reaches top_p; the most likely token always stays.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then top-k and top-p, then
    min-p (tokens below min_p x the row's largest probability dropped, as vLLM does).

    Rows with temperature 0 get temperature 1 here (they take the argmax instead).
    """
    temperature = torch.where(metadata.temperature == 0, 1.0, metadata.temperature)
    scaled = apply_top_k_top_p(logits / temperature[:, None], metadata.top_k, metadata.top_p)
    probs = scaled.softmax(dim=-1)
    if metadata.min_p is not None:
        floor = metadata.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # the rejection sampler reads p(x)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first index of the largest value; NaN counts as largest).

    On a CPU numpy's argmax, which is vectorised where torch's reductions with an index
    are not (bf16 logits widened first); elsewhere ``max``: the same indices as ``argmax``
    and faster. The README's Zen 3 results give the difference."""
    if logits.device.type != "cpu":
        return logits.max(dim=-1).indices
    rows = logits.detach()
    if rows.dtype != torch.float32:
        rows = rows.float()
    return torch.from_numpy(rows.numpy().argmax(axis=-1))


def _choose(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Greedy rows take the argmax; the others sample."""
    if metadata.all_greedy:
        return greedy_tokens(logits)
    sampled = draw_tokens(sampling_probs(logits, metadata), metadata.generators)
    if metadata.all_random:
        return sampled
    return torch.where(metadata.temperature == 0, greedy_tokens(logits), sampled)


def draw_tokens(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from ``probs`` (rows need not be normalised; a token of probability 0
    is never drawn); a seeded row draws from its own generator."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=cdf.dtype, device=cdf.device)
    # Kept below the total: u x total may round up to it, past the last token with mass.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return tokens.clamp_max_(probs.shape[-1] - 1)  # a row of zeros (nothing to draw) stays in range


def gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[Logprobs | None]:
    """Per row: the chosen token's logprob and the row's top ``num_logprobs[row]`` (or None)."""
    asked = [k for k in num_logprobs if k is not None]
    max_k = min(max(asked, default=0), raw_logprobs.shape[-1])
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_vals, top_ids = raw_logprobs.topk(max_k, dim=-1)
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    result: list[Logprobs | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            result.append(None)
        else:
            top = list(zip(top_ids_l[row][:k], top_vals_l[row][:k], strict=True))
            result.append((chosen[row], top))
    return result
