"""One offline call (``LLM.generate`` / ``LLM.chat``): its requests, stepped through the engine
core until done (``step()``), and what each prompt returns (``outputs()``).

A stop string a request's text reaches ends it as "stop" (``EngineCore.stop``), as a stop
token does; the output keeps the tokens up to it. A failed step aborts the whole call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from tqdm import tqdm

from compile_runtime.core.request import Request, ended_by_stop_token
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.engine.core import EngineCore, StepFailedError
from compile_runtime.engine.incremental_text import IncrementalText
from compile_runtime.engine.outputs import CompletionOutput, GenerateStats, RequestOutput
from compile_runtime.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class OfflineCall:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any,
        texts: list[str | None],
        token_lists: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ):
        """Make one request per sample of each prompt, check them all, then queue them (a bad
        one is a ValueError naming its prompt, with nothing of the call queued)."""
        self.core, self.tokenizer, self.texts = core, tokenizer, texts
        loras = loras or [None] * len(token_lists)
        self.samples = [  # a seed goes up by one from each sample to the next
            [core.make_request(list(tokens), sample_params(p, i), lora) for i in range(p.n)]
            for tokens, p, lora in zip(token_lists, params, loras, strict=True)
        ]
        self.requests = [r for group in self.samples for r in group]
        for r in self.requests:
            try:
                core.check(r)
            except ValueError as e:
                prompt = next(i for i, g in enumerate(self.samples) if r in g)
                raise ValueError(
                    f"prompt {prompt} of {len(self.samples)}: {e} (nothing of this call was queued)"
                ) from None
        core.add(self.requests)
        self.stats = GenerateStats()
        self._cache_before = dataclasses.replace(core.prefix_cache_stats)
        self._spec_before = dataclasses.replace(core.spec_decode_stats)
        self.first_token: dict[str, float] = {}
        self.logprobs: dict[str, list] = {r.req_id: [] for r in self.requests}
        self.prompt_logprobs = {
            r.req_id: [None] * len(r.prompt_token_ids)
            for r in self.requests
            if r.sampling_params.prompt_logprobs is not None
        }
        self.text = {  # requests whose text can end them: followed token by token
            r.req_id: IncrementalText(
                tokenizer,
                r.sampling_params.stop,
                r.sampling_params.include_stop_str_in_output,
                r.sampling_params.skip_special_tokens,
            )
            for r in self.requests
            if r.sampling_params.stop and tokenizer is not None
        }
        self._start = time.perf_counter()
        self._bar = tqdm(
            total=len(self.requests), desc="Generating", unit="req", disable=not use_tqdm
        )

    @property
    def done(self) -> bool:
        return not self.core.has_unfinished()

    def step(self) -> None:
        """One engine step, folded into the call's tokens, logprobs, texts and stats. A failure
        aborts every unfinished request (``StepFailedError`` names the call's prompts)."""
        try:
            self._fold(self.core.step())
        except BaseException as e:
            self._bar.close()
            error = self._abort(e)
            if error is None:
                raise
            raise error from e

    def _fold(self, step) -> None:
        now = time.perf_counter() - self._start
        stats = self.stats
        if step.decode_only:
            stats.decode_step_seconds.append(step.seconds)
        stops: dict[str, str] = {}
        stop_tokens = step.stop_token_positions()
        for i, (req_id, token, lp) in enumerate(step.tokens):
            stats.output_tokens += 1
            self.first_token.setdefault(req_id, now)
            follow = self.text.get(req_id)
            if follow is not None:
                if follow.stop_reason is not None:
                    continue  # past its stop string (a step of several tokens)
                if follow.add_token(token, i in stop_tokens):
                    stops[req_id] = follow.stop_reason
            if lp is not None and req_id in self.logprobs:
                self.logprobs[req_id].append(lp)
        for req_id, (first, lps) in step.prompt_logprobs.items():
            if req_id in self.prompt_logprobs:  # a restart after preemption: same values
                self.prompt_logprobs[req_id][first : first + len(lps)] = lps
        stopped = self.core.stop(stops) if stops else []
        self._bar.update(len(step.finished) + len(stopped))
        stats.steps += 1
        stats.scheduled_tokens += step.num_scheduled_tokens

    def _finish_stats(self) -> None:
        self._bar.close()
        stats = self.stats
        stats.seconds = time.perf_counter() - self._start
        stats.prefix_cache = self.core.prefix_cache_stats.since(self._cache_before)
        stats.spec_decode = self.core.spec_decode_stats.since(self._spec_before)
        stats.first_token_seconds = [
            self.first_token[r.req_id] for r in self.requests if r.req_id in self.first_token
        ]

    def _abort(self, error: BaseException) -> StepFailedError | None:
        """Abort every unfinished request (blocks freed; the worker drops them at the next
        step). The error to raise instead of ``error``, or None to re-raise it: the executor
        is gone, or the caller interrupted."""
        failed = error.failed_req_ids if isinstance(error, StepFailedError) else []
        aborted = failed + [r for r in self.core.abort_all() if r not in failed]
        if not isinstance(error, StepFailedError):
            logger.error("generate() aborted %d request(s): %s", len(aborted), error)
            return None
        index = {r.req_id: i for i, r in enumerate(self.requests)}
        what = (
            f"request(s) {', '.join(failed)} (prompt(s) "
            f"{', '.join(str(index[r]) for r in failed if r in index)} of this call)"
            if failed
            else "scheduling"
        )
        cause = error.cause
        return StepFailedError(
            f"step {self.stats.steps + 1} of generate() failed on {what}: "
            f"{type(cause).__name__}: {cause}; aborted {len(aborted)} unfinished request(s) "
            "of this call and freed their KV cache blocks; the engine is ready for the next "
            "generate()",
            failed_req_ids=failed,
            cause=cause,
            aborted_req_ids=aborted,
        )

    def outputs(self) -> list[RequestOutput]:
        """One output per prompt, in input order, each with its ``n`` samples (and the call's
        ``stats`` final)."""
        self._finish_stats()
        outputs = []
        for group, prompt in zip(self.samples, self.texts, strict=True):
            completions = [
                completion_output(
                    i, r, self.text.get(r.req_id), self.logprobs[r.req_id], self.tokenizer
                )
                for i, r in enumerate(group)
            ]
            first = [self.first_token[r.req_id] for r in group if r.req_id in self.first_token]
            outputs.append(
                RequestOutput(
                    request_id=group[0].req_id,  # unique: the first sample's request
                    prompt=prompt,
                    prompt_token_ids=group[0].prompt_token_ids,
                    outputs=completions,
                    finished=all(c.finish_reason is not None for c in completions),
                    prompt_logprobs=self.prompt_logprobs.get(group[0].req_id),
                    first_token_seconds=min(first, default=None),
                )
            )
        return outputs


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
