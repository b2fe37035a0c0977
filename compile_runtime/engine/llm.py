"""``cr.LLM``: offline generation over a model directory.

Builds the executor, which starts the runner on every rank (load, compile,
size the KV cache, capture graphs), then loops scheduler -> executor ->
sampler until every request is done. The scheduler never learns how many
ranks there are: ``tensor_parallel_size=N`` with ``distributed_executor_backend``
``"mp"`` (worker processes on this machine) or ``"ray"`` (Ray actors) changes
only who runs the model.

A bad request is rejected before any prompt of its call is queued. A step
that raises anyway aborts the call's requests (their blocks freed, the runner
told to drop them at its next step) and the engine serves the next call; under
tensor parallelism a failed step stops the workers instead (a rank may be
stuck in a collective), and later calls say the executor is shut down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from compile_runtime.config import (
    CompilationConfig,
    ConfigError,
    EngineConfig,
    RunnerConfig,
    parse_config,
)
from compile_runtime.device import default_device
from compile_runtime.engine.core import EngineCore, StepError
from compile_runtime.executor import Executor, make_executor
from compile_runtime.models.dtype import resolve_dtype
from compile_runtime.models.gguf import gguf_file_in, model_directory
from compile_runtime.models.registry import read_hf_config
from compile_runtime.runner.kv_sizing import size_runner_config
from compile_runtime.runner.model_runner import ModelRunner
from compile_runtime.runner.prefix_cache import PrefixCacheStats
from compile_runtime.runner.request import Request
from compile_runtime.runner.sampling_params import SamplingParams
from compile_runtime.runner.scheduler import Scheduler
from compile_runtime.runner.spec_decode_stats import SpecDecodeStats
from compile_runtime.runner.startup import StartupTimes

logger = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """A step raised: its requests and the rest of the call were aborted; the engine goes on."""

    def __init__(self, message: str, failed_req_ids: list[str], aborted_req_ids: list[str]):
        super().__init__(message)
        self.failed_req_ids = failed_req_ids
        self.aborted_req_ids = aborted_req_ids


# EngineConfig fields that LLM fills itself, not options a user passes.
_SET_BY_LLM = {"model_dir", "compilation_config", "runner_config", "dtype"}


def _check_option_names(options: dict[str, Any]) -> None:
    """An unknown keyword is a typo: name it, with the closest options, before anything starts."""
    known = (set(RunnerConfig.model_fields) | set(EngineConfig.model_fields)) - _SET_BY_LLM
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"LLM({name}=...): unknown option; {hint}the options are {sorted(known)}"
            )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list | None = None
    first_token_seconds: float | None = None  # from generate() start to the first token
    # Per prompt token: None for the first, then (logprob, top-k) given the tokens before it.
    prompt_logprobs: list | None = None


@dataclass
class GenerateStats:
    steps: int = 0
    output_tokens: int = 0
    # Tokens run through the model: prompt tokens not found in the prefix cache (again after a
    # preemption), plus one per decode.
    scheduled_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: list[float] = field(default_factory=list)
    # Wall time of each step in which every scheduled request decoded (one token + drafts).
    decode_step_seconds: list[float] = field(default_factory=list)
    # Prompt tokens of this call looked up in the prefix cache, and found there.
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Draft tokens of this call proposed and accepted (speculative decoding).
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


class LLM:
    def __init__(
        self,
        model: str,
        compilation_config: CompilationConfig | dict | str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        distributed_executor_backend: str | None = None,
        **options: Any,
    ):
        """``model``: a model directory (config.json + safetensors) or a ``.gguf`` file.
        ``dtype``: "auto" (models/dtype.py), "float32", "bfloat16", "float16" or a torch dtype.
        ``options``: fields of ``RunnerConfig`` (max_num_seqs, kv_cache_bytes, ...) and of
        ``EngineConfig`` (device, tensor_parallel_size, use_transformers, ...), by name;
        sizes left unset are chosen for the model and the machine (runner/kv_sizing.py)."""
        model_dir = model_directory(model)
        self.compilation_config = parse_config(compilation_config)
        _check_option_names(options)
        runner_options = {
            k: options.pop(k) for k in list(options) if k in RunnerConfig.model_fields
        }
        self.runner_config = runner_config = RunnerConfig(**runner_options)
        device = options.pop("device", None) or default_device()  # one device for every worker
        hf_config = read_hf_config(model_dir)  # the only read: passed along from here
        self.dtype = resolve_dtype(
            dtype, hf_config, device, quantized=gguf_file_in(model_dir) is not None
        )
        engine_config = EngineConfig(
            model_dir=model_dir,
            compilation_config=self.compilation_config,
            runner_config=runner_config,
            dtype=self.dtype,
            device=device,
            **options,
        )
        # Sized once, before any worker starts, so every rank agrees.
        size_runner_config(
            runner_config, hf_config, self.dtype, device, engine_config.tensor_parallel_size
        )
        self.executor: Executor = make_executor(
            engine_config, hf_config, distributed_executor_backend
        )
        self.tokenizer = _load_tokenizer(model_dir, hf_config)
        self.scheduler = Scheduler(
            num_blocks=self.executor.num_blocks,
            block_size=runner_config.block_size,
            max_num_seqs=runner_config.max_num_seqs,
            max_num_batched_tokens=runner_config.max_num_batched_tokens,
            max_model_len=runner_config.max_model_len,
            vocab_size=getattr(hf_config, "vocab_size", None),
            enable_prefix_caching=runner_config.enable_prefix_caching,
        )
        self.core = EngineCore(self.scheduler, self.executor)
        self.eos_token_ids = eos_token_ids(model_dir, hf_config, self.tokenizer)
        self._ids = itertools.count()
        self.last_stats = GenerateStats()
        logger.info(self.startup.summary())

    @property
    def runner(self) -> ModelRunner:
        """The model runner, when it lives in this process (one rank, the default executor)."""
        runner = self.executor.driver_runner
        if runner is None:
            raise AttributeError(
                f"{type(self.executor).__name__} runs its model runners in worker processes; "
                "use llm.executor (collective_rpc, workers_info) instead of llm.runner"
            )
        return runner

    @property
    def startup(self) -> StartupTimes:
        """Where start-up went (the slowest rank); ``startup.summary()`` is the start-up line."""
        return self.executor.startup

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache since start-up, and found there."""
        return self.scheduler.prefix_cache_stats

    @property
    def workload(self):
        return self.executor.workload()

    def save_workload(self, path: str) -> None:
        """Write the step-size histogram so far (for ``compile-runtime plan-sizes``)."""
        self.workload.save(path)

    def shutdown(self) -> None:
        """Stop the executor's workers (nothing to do on one rank); safe to call twice."""
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in input order."""
        token_lists = self._tokenize(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(token_lists)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(token_lists):
            raise ValueError(f"{len(token_lists)} prompts but {len(params)} SamplingParams")
        requests = [
            self.make_request(list(tokens), p)
            for tokens, p in zip(token_lists, params, strict=True)
        ]
        for i, req in enumerate(requests):  # all checked before any is queued
            try:
                self.core.check(req)
            except ValueError as e:
                raise ValueError(
                    f"prompt {i} of {len(requests)}: {e} (nothing of this call was queued)"
                ) from None
        self.core.add(requests)

        stats = GenerateStats()
        cache_before = dataclasses.replace(self.prefix_cache_stats)
        spec_before = dataclasses.replace(self.scheduler.spec_decode_stats)
        first_token: dict[str, float] = {}
        logprobs: dict[str, list] = {r.req_id: [] for r in requests}
        prompt_logprobs = {
            r.req_id: [None] * len(r.prompt_token_ids)
            for r in requests
            if r.sampling_params.prompt_logprobs is not None
        }
        start = time.perf_counter()
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not progress)
        try:
            while self.core.has_unfinished():
                step = self.core.step()
                now = time.perf_counter() - start
                if step.decode_only:
                    stats.decode_step_seconds.append(step.seconds)
                for req_id, _, lp in step.tokens:
                    stats.output_tokens += 1
                    first_token.setdefault(req_id, now)
                    if lp is not None and req_id in logprobs:
                        logprobs[req_id].append(lp)
                for req_id, (first, lps) in step.prompt_logprobs.items():
                    if req_id in prompt_logprobs:  # a restart after preemption: same values
                        prompt_logprobs[req_id][first : first + len(lps)] = lps
                bar.update(len(step.finished))
                stats.steps += 1
                stats.scheduled_tokens += step.num_scheduled_tokens
        except BaseException as e:
            error = self._abort_call(requests, stats.steps + 1, e)
            if error is None:
                raise
            raise error from e
        finally:
            bar.close()
        stats.seconds = time.perf_counter() - start
        stats.prefix_cache = self.prefix_cache_stats.since(cache_before)
        stats.spec_decode = self.scheduler.spec_decode_stats.since(spec_before)
        stats.first_token_seconds = [
            first_token[r.req_id] for r in requests if r.req_id in first_token
        ]
        self.last_stats = stats
        return [
            RequestOutput(
                request_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                text=self.tokenizer.decode(
                    r.output_token_ids, skip_special_tokens=r.sampling_params.skip_special_tokens
                )
                if self.tokenizer
                else None,
                finish_reason=r.finish_reason,
                logprobs=logprobs[r.req_id] if r.sampling_params.logprobs is not None else None,
                first_token_seconds=first_token.get(r.req_id),
                prompt_logprobs=prompt_logprobs.get(r.req_id),
            )
            for r in requests
        ]

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """A request with a fresh id, this model's EOS ids, not yet checked or queued."""
        return Request(
            req_id=str(next(self._ids)),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
        )

    def _abort_call(
        self, requests: list[Request], step: int, error: BaseException
    ) -> StepFailedError | None:
        """Abort every unfinished request of a failed call (blocks freed; the runner drops them
        at the next step). The error to raise instead of ``error``, or None to re-raise it:
        the executor is gone, or the caller interrupted."""
        failed = error.failed_req_ids if isinstance(error, StepError) else []
        aborted = [r.req_id for r in self.core.abort(list(self.scheduler.requests))]
        aborted = failed + [r for r in aborted if r not in failed]
        if not isinstance(error, StepError):
            logger.error("generate() aborted %d request(s): %s", len(aborted), error)
            return None
        index = {r.req_id: i for i, r in enumerate(requests)}
        what = (
            f"request(s) {', '.join(failed)} (prompt(s) "
            f"{', '.join(str(index[r]) for r in failed if r in index)} of this call)"
            if failed
            else "scheduling"
        )
        cause = error.cause
        return StepFailedError(
            f"step {step} of generate() failed on {what}: {type(cause).__name__}: {cause}; "
            f"aborted {len(aborted)} unfinished request(s) of this call and freed their KV "
            "cache blocks; the engine is ready for the next generate()",
            failed_req_ids=failed,
            aborted_req_ids=aborted,
        )

    def _tokenize(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(
                        "text prompts need a tokenizer in the model directory; pass token ids"
                    )
                out.append(self.tokenizer(p)["input_ids"])
            else:
                out.append([int(t) for t in p])
        return out


def _load_tokenizer(model_dir: str, hf_config):
    if not any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, config=hf_config)  # else it reads it again


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """Every id that ends a turn: ``config.json``'s and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list: Llama 3 Instruct lists ``<|eot_id|>`` there), else
    the tokenizer's EOS."""
    from transformers import GenerationConfig

    found: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for eos in sources:
        for i in eos if isinstance(eos, list | tuple) else [eos]:
            if i is not None and int(i) not in found:
                found.append(int(i))
    if not found and tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    return tuple(found)
