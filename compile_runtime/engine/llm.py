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

import difflib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from compile_runtime.config import (
    CompilationConfig,
    ConfigError,
    EngineConfig,
    RunnerConfig,
    parse_config,
)
from compile_runtime.device import default_device
from compile_runtime.engine.chat import chat_prompt_ids
from compile_runtime.engine.core import EngineCore, StepError
from compile_runtime.engine.offline_call import completion_output, run_until_done, sample_params
from compile_runtime.engine.outputs import GenerateStats, RequestOutput
from compile_runtime.executor import Executor, make_executor
from compile_runtime.models.dtype import resolve_dtype
from compile_runtime.models.gguf import gguf_file_in, model_directory
from compile_runtime.models.registry import read_hf_config
from compile_runtime.models.tokenizer import eos_token_ids, load_tokenizer
from compile_runtime.worker.kv_sizing import size_runner_config
from compile_runtime.worker.model_runner import ModelRunner
from compile_runtime.core.prefix_cache import PrefixCacheStats
from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.worker.startup import StartupTimes
from compile_runtime.core.structured_output import StructuredOutputManager

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
        sizes left unset are chosen for the model and the machine (worker/kv_sizing.py)."""
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
        self.tokenizer = load_tokenizer(model_dir, hf_config)
        self.eos_token_ids = eos_token_ids(model_dir, hf_config, self.tokenizer)
        vocab_size = getattr(hf_config, "vocab_size", None)
        grammars = (
            StructuredOutputManager(self.tokenizer, vocab_size, self.eos_token_ids)
            if self.tokenizer is not None and vocab_size
            else None
        )
        self.scheduler = Scheduler(
            num_blocks=self.executor.num_blocks,
            block_size=runner_config.block_size,
            max_num_seqs=runner_config.max_num_seqs,
            max_num_batched_tokens=runner_config.max_num_batched_tokens,
            max_model_len=runner_config.max_model_len,
            vocab_size=vocab_size,
            enable_prefix_caching=runner_config.enable_prefix_caching,
            structured_outputs=grammars,
        )
        self.core = EngineCore(self.scheduler, self.executor)
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
        prompts: str | dict | Sequence[str | dict | Sequence[int]] | Sequence[int],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt: text, token ids, or vLLM's prompt dicts
        (``{"prompt": text}``, ``{"prompt_token_ids": ids}``), one or a list; outputs in
        input order, each with ``n`` samples in ``outputs``. ``progress`` is the old name
        of ``use_tqdm``."""
        texts, token_lists = self._tokenize(prompts)
        return self._run(
            texts,
            token_lists,
            sampling_params,
            use_tqdm if progress is None else progress,
        )

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a list of them,
        each through the model's chat template (with ``tools``, for templates that take
        them), as vLLM's ``LLM.chat``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [
            chat_prompt_ids(
                list(c),
                self.tokenizer,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for c in conversations
        ]
        texts = [self.tokenizer.decode(ids) for ids in token_lists]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(token_lists)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(token_lists):
            raise ValueError(f"{len(token_lists)} prompts but {len(params)} SamplingParams")
        # One engine request per sample; a seed goes up by one from each sample to the next.
        samples = [
            [self.make_request(list(tokens), sample_params(p, i)) for i in range(p.n)]
            for tokens, p in zip(token_lists, params, strict=True)
        ]
        requests = [r for group in samples for r in group]
        for r in requests:  # all checked before any is queued
            try:
                self.core.check(r)
            except ValueError as e:
                prompt = next(i for i, g in enumerate(samples) if r in g)
                raise ValueError(
                    f"prompt {prompt} of {len(samples)}: {e} (nothing of this call was queued)"
                ) from None
        self.core.add(requests)
        stats, first_token, logprobs, prompt_logprobs, text = run_until_done(
            self, requests, use_tqdm
        )
        self.last_stats = stats
        outputs = []
        for group, prompt in zip(samples, texts, strict=True):
            completions = [
                completion_output(i, r, text.get(r.req_id), logprobs[r.req_id], self.tokenizer)
                for i, r in enumerate(group)
            ]
            first = [first_token[r.req_id] for r in group if r.req_id in first_token]
            outputs.append(
                RequestOutput(
                    request_id=group[0].req_id,  # unique: the first sample's request
                    prompt=prompt,
                    prompt_token_ids=group[0].prompt_token_ids,
                    outputs=completions,
                    finished=all(c.finished() for c in completions),
                    prompt_logprobs=prompt_logprobs.get(group[0].req_id),
                    first_token_seconds=min(first, default=None),
                )
            )
        return outputs

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """A request with a fresh id, this model's EOS ids, not yet checked or queued."""
        return Request(
            req_id=str(next(self._ids)),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
        )

    def abort_call(
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

    def _tokenize(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """(text or None, token ids) of each prompt."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for p in prompts:
            text, tokens = p, None
            if isinstance(p, dict):
                extra = set(p) - {"prompt", "prompt_token_ids"}
                if extra or not p:
                    raise ValueError(
                        f"prompt dict keys {sorted(extra) or '(none)'} are not supported; "
                        'give {"prompt": text} or {"prompt_token_ids": [ids]}'
                    )
                text, tokens = p.get("prompt"), p.get("prompt_token_ids")
            if tokens is None and isinstance(text, str):
                if self.tokenizer is None:
                    raise ValueError(
                        "text prompts need a tokenizer in the model directory; pass token ids"
                    )
                tokens = self.tokenizer(text)["input_ids"]
            elif tokens is None:  # a sequence of ids
                tokens, text = text, None
            try:
                ids.append([int(t) for t in tokens])
            except (TypeError, ValueError):
                raise ValueError(f"prompt {p!r} is not text, token ids or a prompt dict") from None
            texts.append(text if isinstance(text, str) else None)
        return texts, ids
