"""Per-step sampling inputs for a whole batch, laid out as tensors.

The runner keeps one `RequestSamplingState` per request; each step it builds
a `SamplingMetadata` from the states of the requests in the batch (row order
= logits row order). Everything per request that the sampler needs becomes a
batched tensor here once, so the sampler itself has no Python loop over rows
except the per-row random draw of seeded requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_runtime.core.sampling_params import SamplingParams


@dataclass
class RequestSamplingState:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    # Tokens generated so far (including those from before a preemption).
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    # Required when params.seed is set; must persist across steps so that
    # each step draws fresh numbers from the same stream.
    generator: torch.Generator | None = None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded request, on the device the logits live on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingMetadata:
    """Batched sampling settings; a field is None when no row uses the feature."""

    vocab_size: int
    # [B] float32; 0 for greedy rows.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [B] int64, vocab_size for rows without top-k.
    top_k: torch.Tensor | None
    # [B] float32, 1.0 for rows without top-p.
    top_p: torch.Tensor | None
    # Row index -> that request's generator (seeded requests only).
    generators: dict[int, torch.Generator]
    # [B, P] / [B, O] int64, padded with vocab_size (a column dropped after scatter).
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    # [B] float32 each; all three set together when any row uses a penalty.
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    # (rows, token ids, bias values), flattened over the batch.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, token ids) to forbid because the request is below min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Per row: how many top logprobs to return, or None for no logprobs.
    num_logprobs: list[int | None]
    # [B] float32, 0.0 for rows without min-p.
    min_p: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.num_logprobs)

    @property
    def max_num_logprobs(self) -> int | None:
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None

    @classmethod
    def from_requests(
        cls,
        states: Sequence[RequestSamplingState],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        if not states:
            raise ValueError("SamplingMetadata needs at least one request")
        params = [s.params for s in states]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        generators: dict[int, torch.Generator] = {}
        for row, s in enumerate(states):
            if s.params.seed is not None and not s.params.greedy:
                if s.generator is None:
                    raise ValueError(
                        f"row {row} has seed={s.params.seed} but no generator; create one per "
                        "request with make_generator(seed, device) and keep it across steps"
                    )
                generators[row] = s.generator

        top_k = None
        if any(p.top_k > 0 and not p.greedy for p in params):
            top_k = i64([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params])
        top_p = None
        if any(p.top_p < 1.0 and not p.greedy for p in params):
            top_p = f32([p.top_p for p in params])
        min_p = None
        if any(p.min_p > 0.0 and not p.greedy for p in params):
            min_p = f32([p.min_p for p in params])

        prompt_ids = output_ids = rep = freq = pres = None
        if any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            for p in params
        ):
            prompt_ids = _pad([s.prompt_token_ids for s in states], vocab_size, device)
            output_ids = _pad([s.output_token_ids for s in states], vocab_size, device)
            rep = f32([p.repetition_penalty for p in params])
            freq = f32([p.frequency_penalty for p in params])
            pres = f32([p.presence_penalty for p in params])

        bias_rows: list[int] = []
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        for row, p in enumerate(params):
            for tok, val in p.logit_bias.items():
                if not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})"
                    )
                bias_rows.append(row)
                bias_toks.append(tok)
                bias_vals.append(val)
        logit_bias = (i64(bias_rows), i64(bias_toks), f32(bias_vals)) if bias_rows else None

        mask_rows: list[int] = []
        mask_toks: list[int] = []
        for row, s in enumerate(states):
            if len(s.output_token_ids) >= s.params.min_tokens:
                continue
            forbidden = set(s.params.stop_token_ids)
            # With ignore_eos, EOS is an ordinary token, not a stop.
            if not s.params.ignore_eos:
                forbidden.update(s.eos_token_ids)
            for tok in sorted(forbidden):
                if 0 <= tok < vocab_size:  # an id outside the vocab can never be sampled
                    mask_rows.append(row)
                    mask_toks.append(tok)
        min_tokens_mask = (i64(mask_rows), i64(mask_toks)) if mask_rows else None

        greedy = [p.greedy for p in params]
        return cls(
            vocab_size=vocab_size,
            temperature=f32([p.temperature for p in params]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            generators=generators,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask,
            num_logprobs=[p.logprobs for p in params],
            min_p=min_p,
        )


def _pad(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad token lists to one width (at least 1) with an out-of-vocab id."""
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)
