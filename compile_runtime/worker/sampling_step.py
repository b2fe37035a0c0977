"""Tokens from a step's logits: sampling or draft verification, prompt logprobs, and
under tensor parallelism rank 0's tokens broadcast to every rank.

Only the sampling rank has the logits: it samples, and every rank then appends the same
tokens so the persistent batches stay identical. Under pipeline parallelism the other
ranks are not waited for: they get the tokens in the request's next step.
"""

from __future__ import annotations

import numpy as np
import torch

from compile_runtime.distributed import broadcast_from_first_rank
from compile_runtime.worker.grammar_bitmask import apply_grammar_bitmask
from compile_runtime.worker.input_batch import InputBatch, RequestState
from compile_runtime.worker.rejection_sampler import rejection_sample
from compile_runtime.worker.sampler import Sampler, gather_logprobs, greedy_tokens
from compile_runtime.worker.sampling_metadata import RequestSamplingState, SamplingMetadata
from compile_runtime.worker.step_inputs import PromptSpan


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    states: list[RequestState],
    drafts: list[list[int]] | None,
) -> tuple[list[list[int]], list]:
    """Per request its tokens and their logprobs (None where not asked for).

    Without drafts one token each; with drafts the rejection sampler verifies them.
    (``sample_on_every_rank`` takes plain greedy batches without drafts itself.)
    """
    plain = True  # loops, not generators: each generator or comprehension is a frame
    for s in states:
        if not s.plain_argmax:
            plain = False
            break
    metadata = None
    if not plain:
        # One sampling row per logits row: a draft position sees the drafts before it as
        # output (penalties, min_tokens), exactly as the step that would sample it.
        rows = [
            RequestSamplingState(
                params=s.sampling_params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids + (d[:j] if j else []),
                eos_token_ids=s.eos_token_ids,
                generator=s.generator,
            )
            for s, d in zip(states, drafts or [[]] * len(states), strict=True)
            for j in range(len(d) + 1)
        ]
        metadata = SamplingMetadata.from_requests(
            rows, vocab_size=logits.shape[-1], device=logits.device
        )
    if drafts is not None:
        result = rejection_sample(logits, drafts, metadata)
        return result.token_ids, result.logprobs
    sampled = sampler(logits, metadata)
    logprobs = [lp if lp is None else [lp] for lp in sampled.logprobs]
    return [[t] for t in sampled.token_ids.tolist()], logprobs


def sample_on_every_rank(
    sampler: Sampler,
    states: list[RequestState],
    logits: torch.Tensor | None,
    drafts: list[list[int]] | None,
    grammar_bitmask: dict | None,
    broadcast: bool,
    device: torch.device,
) -> tuple[list[list[int]], list]:
    """Per sampling request its tokens and logprobs: the rank with ``logits`` samples (or
    verifies drafts) after the grammar's mask; with ``broadcast`` (tensor parallelism in one
    stage) every rank gets its tokens."""
    tokens: list[list[int]] = []
    logprobs: list = []
    if logits is not None:
        if grammar_bitmask:
            widths = [1 + len(d) for d in drafts] if drafts else [1] * len(states)
            starts = np.cumsum([0, *widths[:-1]]).tolist()
            row_of = dict(zip([s.req_id for s in states], starts, strict=True))
            apply_grammar_bitmask(logits, row_of, grammar_bitmask)
        plain = drafts is None
        for s in states:  # a loop, not a generator: each generator is a frame
            if not s.plain_argmax:
                plain = False
                break
        if plain:  # nothing changes the logits: no sampling tensors built
            tokens = greedy_tokens(logits).reshape(-1, 1).tolist()
        else:
            tokens, logprobs = sample(sampler, logits, states, drafts)
    if broadcast:
        width = 1 + max((len(d) for d in drafts or []), default=0)
        sent = tokens if logits is not None else None
        tokens = broadcast_tokens(sent, len(states), width, device)
    return tokens, logprobs or [None] * len(states)


def broadcast_tokens(
    tokens: list[list[int]] | None, num_reqs: int, width: int, device: torch.device
) -> list[list[int]]:
    """The sampling rank's tokens per request on every rank (padded with -1 on the wire)."""
    wire = torch.full((num_reqs, width), -1, dtype=torch.long, device=device)
    if tokens is not None:
        for i, ids in enumerate(tokens):
            wire[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    broadcast_from_first_rank(wire)
    return [[t for t in row if t >= 0] for row in wire.tolist()]


def prompt_logprobs(
    batch: InputBatch, spans: list[PromptSpan], logits: torch.Tensor
) -> dict[str, tuple[int, list]]:
    """Per request: (position of the first prompt token scored, its logprobs onward);
    ``logits`` has one row per span position, in span order."""
    raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
    targets, top_k = [], []
    for span in spans:
        state = batch.requests[span.req_id]
        start = span.first + 1
        targets.append(torch.from_numpy(batch.token_ids[state.row, start : start + span.count]))
        top_k += [state.sampling_params.prompt_logprobs] * span.count
    flat = gather_logprobs(raw, torch.cat(targets).to(raw.device), top_k)
    out, at = {}, 0
    for span in spans:
        out[span.req_id] = (span.first + 1, flat[at : at + span.count])
        at += span.count
    return out
