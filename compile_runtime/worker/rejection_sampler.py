"""Verify draft tokens against the model's own distribution (speculative decoding).

A request with drafts ``x_1..x_d`` ran ``d + 1`` positions in one step, so it
has ``d + 1`` rows of logits: row j is the model's next-token distribution
after its tokens and ``x_1..x_j``. Row j is processed exactly as the ordinary
sampler would process it at that point (logit bias, min_tokens, penalties
counting ``x_1..x_j`` as output, temperature, top-k/top-p), then:

* greedy rows accept ``x_{j+1}`` while it equals the argmax; the first
  mismatch emits the argmax instead;
* sampled rows accept ``x_{j+1}`` with probability ``min(1, p(x)/q(x))``;
  an n-gram draft is a point mass (``q(x) = 1``), so that is ``p(x)``. On a
  rejection the token is drawn from the normalised residual ``max(0, p - q)``,
  which is ``p`` with ``x`` removed. Every emitted token is then distributed
  exactly as the ordinary sampler's (the standard speculative sampling result);
* when every draft is accepted, the last row gives one more token (the bonus).

So a request emits between 1 and ``d + 1`` tokens per step. Seeded requests
draw every random number from their own generator, so they are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile_runtime.worker.sampler import (
    Logprobs,
    draw_tokens,
    gather_logprobs,
    greedy_tokens,
    process_logits,
    sampling_probs,
)
from compile_runtime.worker.sampling_metadata import SamplingMetadata


@dataclass
class SpeculativeOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one sampled token
    logprobs: list[list[Logprobs] | None]  # per request and emitted token, when asked for


def rejection_sample(
    logits: torch.Tensor, drafts: list[list[int]], metadata: SamplingMetadata | None
) -> SpeculativeOutput:
    """``logits``: ``len(d) + 1`` rows per request, in order; ``metadata``: one row per logits
    row (None: every request is plain greedy with no knobs, the argmax of the raw logits)."""
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.shape[0] != num_rows:
        raise ValueError(
            f"{len(drafts)} requests with drafts need {num_rows} rows of logits, "
            f"got {logits.shape[0]}"
        )
    if metadata is None:
        argmax = greedy_tokens(logits).tolist()
        return SpeculativeOutput(
            [
                _accept_greedy(d, argmax, r)
                for d, r in zip(drafts, _row_starts(drafts), strict=True)
            ],
            [None] * len(drafts),
        )
    processed, raw_logprobs = process_logits(logits, metadata)
    argmax = processed.argmax(dim=-1).tolist()
    greedy = (metadata.temperature == 0).tolist()
    accepted = sampled = None
    if not metadata.all_greedy:
        accepted, sampled = _draw(processed, drafts, metadata)
    tokens = []
    for d, start in zip(drafts, _row_starts(drafts), strict=True):
        if greedy[start]:
            tokens.append(_accept_greedy(d, argmax, start))
            continue
        out = []
        for j, x in enumerate(d):
            if not accepted[start + j]:
                out.append(sampled[start + j])  # drawn from the residual
                break
            out.append(x)
        else:
            out.append(sampled[start + len(d)])  # the bonus token
        tokens.append(out)
    logprobs: list[list[Logprobs] | None] = [None] * len(drafts)
    if raw_logprobs is not None:
        rows = [
            start + j
            for out, start in zip(tokens, _row_starts(drafts), strict=True)
            for j in range(len(out))
        ]
        flat = gather_logprobs(
            raw_logprobs[rows],
            torch.tensor([t for out in tokens for t in out], device=logits.device),
            [metadata.num_logprobs[r] for r in rows],
        )
        at = 0
        for i, (out, start) in enumerate(zip(tokens, _row_starts(drafts), strict=True)):
            if metadata.num_logprobs[start] is not None:
                logprobs[i] = flat[at : at + len(out)]
            at += len(out)
    return SpeculativeOutput(tokens, logprobs)


def _row_starts(drafts: list[list[int]]) -> list[int]:
    starts, at = [], 0
    for d in drafts:
        starts.append(at)
        at += len(d) + 1
    return starts


def _accept_greedy(draft: list[int], argmax: list[int], start: int) -> list[int]:
    """Drafts while they equal the argmax, then the argmax (of the first mismatch, or the bonus)."""
    out = []
    for j, x in enumerate(draft):
        if x != argmax[start + j]:
            break
        out.append(x)
    out.append(argmax[start + len(out)])
    return out


def _draw(
    processed: torch.Tensor, drafts: list[list[int]], metadata: SamplingMetadata
) -> tuple[list[bool], list[int]]:
    """Per row: whether its draft is accepted (u < p(x)), and a token drawn from the residual
    (p without x) for draft rows or from p itself for bonus rows."""
    probs = sampling_probs(processed, metadata)
    device = probs.device
    draft_rows, draft_ids = [], []
    for d, start in zip(drafts, _row_starts(drafts), strict=True):
        draft_rows += range(start, start + len(d))
        draft_ids += d
    rows = torch.tensor(draft_rows, dtype=torch.long, device=device)
    ids = torch.tensor(draft_ids, dtype=torch.long, device=device)
    p_draft = torch.ones(probs.shape[0], device=device)  # bonus rows: nothing to accept
    p_draft[rows] = probs[rows, ids]
    u = torch.rand(probs.shape[0], device=device)
    for row, gen in metadata.generators.items():
        u[row] = torch.rand(1, generator=gen, device=device)[0]
    residual = probs.clone()
    residual[rows, ids] = 0.0
    # A draft holding all of p (up to rounding) has no residual to draw from: it stands.
    p_draft[rows] = torch.where(residual[rows].sum(dim=-1) > 0, p_draft[rows], 1.0)
    return (u < p_draft).tolist(), draw_tokens(residual, metadata.generators).tolist()
