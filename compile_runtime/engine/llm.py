"""``cr.LLM``: offline generation over a model directory.

Decides the engine's configuration once (``engine_config.py``, frozen), builds the executor,
which starts the worker on every rank (load, compile, size the KV cache, capture graphs), and
the engine core (``core.py``: the scheduler's one owner); each ``generate`` / ``chat`` is one
``OfflineCall`` stepped until done. The scheduler never learns how many
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

import logging
from collections.abc import Sequence
from typing import Any

import torch

from compile_runtime.config import CompilationConfig, EngineConfig, RunnerConfig
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.stats import PrefixCacheStats
from compile_runtime.cpu.c_library import build_ahead
from compile_runtime.device import resolve_device
from compile_runtime.engine.chat import chat_prompt_ids
from compile_runtime.engine.core import EngineCore
from compile_runtime.engine.data_parallel import DataParallelCore
from compile_runtime.engine.engine_config import decide_engine_config
from compile_runtime.engine.offline_call import OfflineCall
from compile_runtime.engine.outputs import GenerateStats, RequestOutput
from compile_runtime.executor import Executor, MultiprocExecutor, StandbyWorkers, make_executor
from compile_runtime.lora.request import LoRARequest
from compile_runtime.models.tokenizer import eos_token_ids, load_tokenizer
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.model_runner import ModelRunner
from compile_runtime.worker.startup import StartupTimes

logger = logging.getLogger(__name__)


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
        if platform_for(resolve_device(options.get("device"))).builds_kernels_ahead:
            build_ahead()  # the CPU kernels compile on the other core while the start goes on
        self.config: EngineConfig
        self.config = decide_engine_config(model, compilation_config, dtype, options)
        hf_config = self.config.hf_config  # the model's config, read once
        dp_size = self.config.data_parallel_size
        if dp_size > 1:  # each engine's model in its own worker processes
            if distributed_executor_backend == "uni":
                raise ValueError(
                    f"data_parallel_size={dp_size} runs each engine in worker processes; "
                    "distributed_executor_backend='uni' cannot (use 'mp' or 'ray')"
                )
            distributed_executor_backend = distributed_executor_backend or "mp"
        self._backend = distributed_executor_backend
        self._standby: StandbyWorkers | None = None  # keep_standby_workers()
        self.executors: list[Executor] = self._start_executors()
        self.executor: Executor = self.executors[0]
        self.tokenizer = load_tokenizer(self.config.model_dir, hf_config)
        cores = [
            EngineCore(
                self.config,
                executor,
                self.tokenizer,
                getattr(hf_config, "vocab_size", None),
                eos_token_ids(self.config.model_dir, hf_config, self.tokenizer),
            )
            for executor in self.executors
        ]
        self.core: EngineCore | DataParallelCore = (
            cores[0]
            if dp_size == 1
            else DataParallelCore(cores, lockstep=self.config.data_parallel_lockstep)
        )
        self.last_stats = GenerateStats()
        logger.info(self.startup.summary())

    @property
    def compilation_config(self) -> CompilationConfig:
        return self.config.compilation_config

    @property
    def runner_config(self) -> RunnerConfig:
        """The runner's sizes as the engine decided them (frozen)."""
        return self.config.runner_config

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

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
        return self.core.prefix_cache_stats

    @property
    def workload(self):
        return self.executor.workload()

    def save_workload(self, path: str) -> None:
        """Write the step-size histogram so far (for ``compile-runtime plan-sizes``)."""
        self.workload.save(path)

    def _start_executors(self) -> list[Executor]:
        """One executor per data-parallel engine, all started or none."""
        executors: list[Executor] = []
        try:
            for _ in range(self.config.data_parallel_size):
                executors.append(make_executor(self.config, self._backend, self._standby))
        except BaseException:
            for executor in executors:
                executor.shutdown()
            raise
        return executors

    def keep_standby_workers(self) -> None:
        """From now on keep one spawned, imported process per rank waiting, so that
        ``restart_workers`` skips seconds of imports (a server that restarts dead workers).
        Nothing to do where the model runs in this process or in Ray actors."""
        if self._standby is None and all(isinstance(e, MultiprocExecutor) for e in self.executors):
            self._standby = StandbyWorkers(sum(e.world_size for e in self.executors), self.config)
            self._standby.fill()

    def restart_workers(self) -> None:
        """Stop every executor and start them again (a worker died): the compiled programs
        load from the warm compile cache; every engine goes on with nothing scheduled."""
        for executor in self.executors:
            executor.shutdown()
        self.executors = self._start_executors()
        self.executor = self.executors[0]
        if isinstance(self.core, DataParallelCore):
            self.core.reset(self.executors)
        else:
            self.core.reset(self.executor)
        if self._standby is not None:
            self._standby.fill()  # for the next restart

    def shutdown(self) -> None:
        """Stop the executors' workers (nothing to do on one rank) and any standby
        processes; safe to call twice."""
        if self._standby is not None:
            self._standby.close()
        for executor in self.executors:
            executor.shutdown()
        if isinstance(self.core, DataParallelCore):
            self.core.shutdown()

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt: text, token ids, or vLLM's prompt dicts
        (``{"prompt": text}``, ``{"prompt_token_ids": ids}``), one or a list; outputs in
        input order, each with ``n`` samples in ``outputs``. ``lora_request``: the adapter
        of every prompt, or one per prompt (None: the base model; needs enable_lora)."""
        texts, token_lists = self._tokenize(prompts)
        return self._run(texts, token_lists, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
        return self._run(texts, token_lists, sampling_params, use_tqdm, lora_request)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
        loras = (
            list(lora_request)
            if isinstance(lora_request, Sequence)
            else [lora_request] * len(token_lists)
        )
        if len(loras) != len(token_lists):
            raise ValueError(f"{len(token_lists)} prompts but {len(loras)} LoRA requests")
        call = OfflineCall(self.core, self.tokenizer, texts, token_lists, params, use_tqdm, loras)
        while not call.done:
            call.step()
        outputs = call.outputs()
        self.last_stats = call.stats
        return outputs

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
