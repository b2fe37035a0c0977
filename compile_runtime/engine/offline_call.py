"""One offline call (``LLM.generate`` / ``LLM.chat``): its requests stepped until done, and
what each sample returns.

A stop string a request's text reaches ends it as "stop" (``EngineCore.stop``), as a
stop token does; the output keeps the tokens up to it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from compile_runtime.engine.incremental_text import IncrementalText
from compile_runtime.engine.outputs import CompletionOutput, GenerateStats
from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.stop_rules import ended_by_stop_token

if TYPE_CHECKING:
    from compile_runtime.engine.llm import LLM


def run_until_done(llm: LLM, requests: list[Request], use_tqdm: bool):
    """Step the engine until every request of the call is done; a stop string its text
    reaches ends a request as "stop" (``EngineCore.stop``)."""
    stats = GenerateStats()
    cache_before = dataclasses.replace(llm.prefix_cache_stats)
    spec_before = dataclasses.replace(llm.scheduler.spec_decode_stats)
    first_token: dict[str, float] = {}
    logprobs: dict[str, list] = {r.req_id: [] for r in requests}
    prompt_logprobs = {
        r.req_id: [None] * len(r.prompt_token_ids)
        for r in requests
        if r.sampling_params.prompt_logprobs is not None
    }
    text = {  # requests whose text can end them: followed token by token
        r.req_id: IncrementalText(
            llm.tokenizer,
            r.sampling_params.stop,
            r.sampling_params.include_stop_str_in_output,
            r.sampling_params.skip_special_tokens,
        )
        for r in requests
        if r.sampling_params.stop and llm.tokenizer is not None
    }
    start = time.perf_counter()
    bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm)
    try:
        while llm.core.has_unfinished():
            step = llm.core.step()
            now = time.perf_counter() - start
            if step.decode_only:
                stats.decode_step_seconds.append(step.seconds)
            stops: dict[str, str] = {}
            stop_tokens = step.stop_token_positions()
            for i, (req_id, token, lp) in enumerate(step.tokens):
                stats.output_tokens += 1
                first_token.setdefault(req_id, now)
                follow = text.get(req_id)
                if follow is not None:
                    if follow.stop_reason is not None:
                        continue  # past its stop string (a step of several tokens)
                    if follow.add_token(token, i in stop_tokens):
                        stops[req_id] = follow.stop_reason
                if lp is not None and req_id in logprobs:
                    logprobs[req_id].append(lp)
            for req_id, (first, lps) in step.prompt_logprobs.items():
                if req_id in prompt_logprobs:  # a restart after preemption: same values
                    prompt_logprobs[req_id][first : first + len(lps)] = lps
            stopped = llm.core.stop(stops) if stops else []
            bar.update(len(step.finished) + len(stopped))
            stats.steps += 1
            stats.scheduled_tokens += step.num_scheduled_tokens
    except BaseException as e:
        error = llm.abort_call(requests, stats.steps + 1, e)
        if error is None:
            raise
        raise error from e
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - start
    stats.prefix_cache = llm.prefix_cache_stats.since(cache_before)
    stats.spec_decode = llm.scheduler.spec_decode_stats.since(spec_before)
    stats.first_token_seconds = [first_token[r.req_id] for r in requests if r.req_id in first_token]
    return stats, first_token, logprobs, prompt_logprobs, text


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample ``index`` of ``params.n`` (vLLM's rule for seeds: seed + index)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return params.model_copy(update={"n": 1, "seed": seed})


def completion_output(
    index: int, req: Request, text: IncrementalText | None, logprobs: list, tokenizer
) -> CompletionOutput:
    """One sample's output; a request its stop string ended keeps the tokens up to it."""
    params = req.sampling_params
    token_ids = list(req.output_token_ids)
    if text is not None:
        text.flush()
        token_ids = token_ids[: len(text.token_ids)]
        logprobs = logprobs[: len(token_ids)]
        decoded = text.text
    elif tokenizer is not None and params.detokenize:
        shown = token_ids
        if ended_by_stop_token(req) and not params.include_stop_str_in_output:
            shown = token_ids[:-1]  # the stop token's text is not the output's, as in vLLM
        decoded = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
    else:
        decoded = None
    asked = params.logprobs is not None
    return CompletionOutput(
        index=index,
        text=decoded if params.detokenize else None,
        token_ids=token_ids,
        cumulative_logprob=sum(lp[0] for lp in logprobs) if asked else None,
        logprobs=logprobs if asked else None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
    )
