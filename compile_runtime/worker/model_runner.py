"""The model runner: one step of the scheduler's plan through the compiled model.

``execute_model`` applies the scheduler's differences to the persistent batch, lays the
step's tokens out flat (step_inputs.py), asks the dispatcher for the runtime mode and
padded size, loads the tokens into persistent buffers and builds the attention metadata
once, runs the forward inside a forward context, then computes the logits the step needs
in one call. A step whose FULL graph is captured replays it directly, with no forward
context; a decode graph runs on through the LM head (cudagraph_plan.py), so its replay
gives the logits.
``sample_tokens`` samples (or verifies drafts) and, with speculative decoding, proposes the
next drafts (sampling_step.py); between the two calls the state is one ``ExecuteModelState``.
Start-up is ``__init__`` (threads, weights, buffers) then ``initialize``: the first forward,
the graph plan (cudagraph_plan.py), the KV cache (startup.py), the capture (or none: CPU
graphs are captured on first use, ``compile_runtime/graphs/capture.py``).

Under tensor and pipeline parallelism every rank runs its own runner on the same scheduler
output (so the persistent batches stay identical); a pipeline stage takes the step's hidden
states from the one before and hands its own on (stage_handover.py); the last stage's
logits are gathered on its first rank, which samples and broadcasts the tokens each request
got so that every rank appends the same ones.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from compile_runtime.attention.groups import metadata_groups
from compile_runtime.attention.layer import attention_layers
from compile_runtime.compiler.decorator import backend_seconds, set_graph_factory
from compile_runtime.config import CompilationConfig, CUDAGraphMode, RunnerConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.counters import compilation_counter
from compile_runtime.cpu.graph import CPU_GRAPHS, records_cpu_graphs
from compile_runtime.cpu.threads import set_num_threads
from compile_runtime.device import resolve_device
from compile_runtime.distributed import (
    get_parallel_state,
    get_tp_rank,
    get_tp_world_size,
    sampling_rank,
)
from compile_runtime.distributed.pipeline import PipelineStage
from compile_runtime.forward_context import BatchDescriptor, set_forward_context
from compile_runtime.graphs.capture import CaptureReport, LazyCapture, capture
from compile_runtime.graphs.dispatcher import CudagraphDispatcher
from compile_runtime.graphs.wrapper import CUDAGraphWrapper, GraphFactory
from compile_runtime.lora.manager import LoRAManager
from compile_runtime.models.interface import CausalLanguageModel
from compile_runtime.models.registry import load_model
from compile_runtime.planner.workload import Workload
from compile_runtime.platforms.select import platform_for
from compile_runtime.worker.capture_inputs import capture_inputs
from compile_runtime.worker.cudagraph_plan import (
    CudaGraphPlan,
    logits_fit_in_graph,
    plan_cudagraphs,
)
from compile_runtime.worker.input_batch import InputBatch
from compile_runtime.worker.microbatch import microbatch_split, run_microbatches
from compile_runtime.worker.ngram_proposer import NgramProposer
from compile_runtime.worker.sampler import Sampler
from compile_runtime.worker.sampling_step import prompt_logprobs, sample_on_every_rank
from compile_runtime.worker.stage_handover import receive_stage_input, send_stage_output
from compile_runtime.worker.startup import (
    ModelRunnerError,
    StartupTimes,
    allocate_kv_cache_for,
    allocated_bytes,
    first_forward_tokens,
    profile_metadata,
)
from compile_runtime.worker.step_inputs import (
    StepBuffers,
    StepInputs,
    flatten_step,
    hidden_rows,
    logits_rows,
)


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    req_ids: list[str]
    # [rows, vocab]: one per request that samples, 1 + its drafts with drafts; None on ranks > 0
    logits: torch.Tensor | None
    sampling_req_ids: list[str]  # requests whose prompt is complete: they get tokens
    runtime_mode: str | None = None
    unreplayed_reason: str | None = None
    drafts: list[list[int]] | None = None  # per sampling request, when any has drafts
    prompt_logprobs: dict[str, tuple[int, list]] | None = None
    grammar_bitmask: dict[str, Any] | None = None  # structured outputs: rows' allowed tokens


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        compilation_config: CompilationConfig,
        runner_config: RunnerConfig,
        *,
        capture_sizes: tuple[int, ...] | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        use_transformers: bool = False,
        hf_config: Any = None,
    ):
        """Sizes (``runner_config``, ``capture_sizes``) as the engine decided them: the runner
        decides none (None capture sizes: ``compilation_config``'s); ``hf_config``: the
        model's config as the engine read it (None: loading reads it)."""
        self.config = runner_config
        self.compilation_config = compilation_config
        self.device = resolve_device(device)
        self.platform = platform_for(self.device)
        runner_config.check_decided(on_cpu=not self.platform.profiles_memory)
        self.dtype = dtype
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        state = get_parallel_state()
        self.samples = state is None or state.rank == sampling_rank()  # else: told the tokens
        ranks = state.world_size if state is not None else 1  # processes sharing the cores
        set_num_threads(self.config, self.device, ranks)  # before the first compile
        self.platform.reset_peak_memory(self.device)  # this runner's peak, not an earlier one's
        self._allocated_at_start = allocated_bytes(self.device)
        start = time.perf_counter()
        self.model: CausalLanguageModel = load_model(
            model_dir,
            compilation_config,
            dtype=dtype,
            device=self.device,
            use_transformers=use_transformers,
            cpu_pack_weights=self.config.cpu_pack_weights,
            cpu_tune_kernels=self.config.cpu_tune_kernels,
            hf_config=hf_config,
            quantization=self.config.quantization,
        )
        self.startup = StartupTimes(weights=time.perf_counter() - start)
        self.lora: LoRAManager | None = None  # adapter slots, in the graph before its trace
        # On a CPU, CPU graphs (native calls replayed from C): pieces wrapped at first forward.
        self.graph_factory: GraphFactory | None = None
        if self.platform.graph_kind == "cpu" and records_cpu_graphs(compilation_config):
            self.graph_factory = CPU_GRAPHS
            set_graph_factory(self.model, CPU_GRAPHS)
        self.layers = attention_layers(self.model)
        if not self.layers:
            raise ModelRunnerError(f"{type(self.model).__name__} has no Attention layers")
        c = self.config
        spec = c.speculative_config
        self.proposer = spec and NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        # Every request with k drafts: a uniform decode step of 1 + k tokens per request.
        self.uniform_decode_query_len = 1 + (spec.num_speculative_tokens if spec else 0)
        self.max_num_tokens = c.max_num_tokens
        if c.enable_lora:
            self.lora = LoRAManager(self.model, c, self.max_num_tokens, dtype, self.device)
        self.input_batch = InputBatch(c.max_num_seqs, c.max_model_len, c.block_size, self.device)
        # A pipeline stage: None where the model is whole (one stage, or the adapter).
        stage: PipelineStage | None = getattr(self.model, "stage", None)
        self.stage = stage if stage is not None and stage.size > 1 else None
        stage_input = None
        if self.stage is not None and not self.stage.is_first:
            stage_input = (self.model.config.hidden_size, dtype)
        self.buffers = StepBuffers(self.max_num_tokens, self.device, stage_input)
        self.metadata_groups = metadata_groups(
            self.layers, c.block_size, c.max_num_seqs, self.device
        )
        for builder, _ in self.metadata_groups:
            builder.uniform_decode_query_len = self.uniform_decode_query_len
        # Sizes the engine's; keys after the trace.
        self.dispatcher = CudagraphDispatcher(
            compilation_config,
            capture_sizes=capture_sizes,
            max_num_tokens=self.max_num_tokens,
            max_num_reqs=c.max_num_seqs,
        )
        self.cudagraph_plan: CudaGraphPlan | None = None
        self.sampler = Sampler()
        self.workload = Workload()
        self.execute_state: ExecuteModelState | None = None
        self.num_blocks = 0
        self.capture_report: CaptureReport | None = None
        self.lazy_capture: LazyCapture | None = None  # CPU graphs captured on first use
        self.unreplayed: Counter[str] = Counter()  # steps without a graph, by reason
        # (mode, descriptor) -> (its FULL wrapper, whether it gives logits): graphs captured,
        # which execute_model replays with no forward context and no call but the replay.
        self.full_graphs: dict[tuple, tuple[CUDAGraphWrapper, bool]] = {}
        self.vocab_size = getattr(self.model.config, "vocab_size", None)

    def initialize(self) -> None:
        """Compile (first trace at the largest size), plan the CUDA graphs, size and bind the KV
        cache, capture the graphs."""
        start = time.perf_counter()
        programs = compilation_counter.num_programs_loaded
        # The bare compiled model (graphs planned after it) on the profile batch (startup.py)
        profile = functools.partial(
            profile_metadata,
            self.layers,
            self.metadata_groups,
            self.buffers.slot_mapping,
            self.config,
            max_blocks_per_req=self.input_batch.block_table.max_blocks_per_req,
            dtype=self.dtype,
            device=self.device,
        )
        n = first_forward_tokens(self.model.model, self.buffers, self.max_num_tokens, profile)
        # (The metadata outside inference mode: the builders' buffers it makes are kept.)
        with profile(n) as metadata, torch.inference_mode():
            with set_forward_context(metadata, num_tokens=n):
                self.model.model(*self.buffers.forward_args(n))
        times = self.startup
        times.first_forward, times.first_forward_tokens = time.perf_counter() - start, n
        times.saved_program = compilation_counter.num_programs_loaded > programs
        times.compile = backend_seconds(self.model)
        plan = self.cudagraph_plan = plan_cudagraphs(
            self.model,
            self.layers,
            self.compilation_config,
            self.dispatcher,
            uniform_decode_query_len=self.uniform_decode_query_len,
            device=self.device,
            graph_factory=self.graph_factory,
            lora=self.lora is not None,
            logits_in_graph=logits_fit_in_graph(
                self.model, single_rank=self.tp_size == 1 and self.stage is None
            ),
        )
        self.num_blocks = allocate_kv_cache_for(
            self.config, self.layers, self.dtype, self.device, self._allocated_at_start, times
        )
        for builder, _ in self.metadata_groups:  # every step's block ids checked against it
            builder.num_cache_blocks = self.num_blocks
        lazy = self.compilation_config.lazy_capture
        if self.dispatcher.capture_descriptors() and (lazy or lazy is None and self.graph_factory):
            self.lazy_capture = LazyCapture(self.dispatcher)
            self.capture_report = self.lazy_capture.report
        elif self.dispatcher.capture_descriptors():
            start = time.perf_counter()
            pool = self.graph_factory.pool() if self.graph_factory else None
            with torch.inference_mode():
                self.capture_report = capture(
                    plan.forward_model,
                    functools.partial(
                        capture_inputs,
                        buffers=self.buffers,
                        block_table=self.input_batch.block_table,
                        groups=self.metadata_groups,
                        config=self.config,
                    ),
                    self.dispatcher,
                    graph_pool=pool,
                    forward_for=lambda mode, descriptor: plan.forward_for(mode, descriptor)[0],
                )
            times.graphs = time.perf_counter() - start
        if self.capture_report is not None:
            times.graph_sizes = self.capture_report.sizes_line()

    def release(self) -> None:
        """Give back the KV cache and every graph, FULL and PIECEWISE (``LLM.shutdown``): the
        graphs' memory goes with them (their pool, CUDA's or the CPU graphs', keeps nothing
        alive). The runner cannot step after."""
        import gc

        from compile_runtime.compiler.decorator import compiled_model

        for layer in self.layers:
            layer.kv_cache = None
        self.num_blocks = 0
        self.execute_state = None
        self.full_graphs.clear()
        wrappers = list(self.cudagraph_plan.wrappers() if self.cudagraph_plan else ())
        for module in self.model.modules():  # the piecewise graphs: one wrapper per piece
            compiled = compiled_model(module)
            if compiled is not None:
                values = compiled.split_gm.__dict__.values()
                wrappers += [v for v in values if isinstance(v, CUDAGraphWrapper)]
        for wrapper in wrappers:
            wrapper.entries.clear()
        gc.collect()  # the graphs' kept tensors may sit in reference cycles
        self.platform.release_cached_memory()

    @torch.inference_mode()  # as start-up: buffers made there are inference tensors
    def execute_model(self, so: SchedulerOutput) -> None:
        if self.execute_state is not None:
            raise ModelRunnerError(
                "execute_model() called twice without sample_tokens(); call sample_tokens() "
                "after every execute_model()"
            )
        self.input_batch.apply(so, take_tokens=self.stage is not None and not self.samples)
        if not so.num_scheduled_tokens:
            self.execute_state = ExecuteModelState([], torch.empty(0), [])
            return
        total = sum(so.num_scheduled_tokens.values())  # total_num_scheduled_tokens, inlined
        if total > self.max_num_tokens:
            raise ModelRunnerError(
                f"{total} tokens scheduled in one step; max_num_batched_tokens is "
                f"{self.max_num_tokens}"
            )
        batch = self.input_batch
        step = flatten_step(batch, so.num_scheduled_tokens, so.num_computed_tokens, self.vocab_size)
        # Data-parallel lockstep: a decode graph only if every engine's step is a decode.
        # is_uniform_decode and workload.record, inlined: two calls less on every step.
        num_scheduled = step.num_scheduled
        uniform_decode = len(num_scheduled) > 0 and bool(
            (num_scheduled == self.uniform_decode_query_len).all()
        )
        uniform_decode = uniform_decode and so.dp_uniform_decode is not False
        (self.workload.decode if uniform_decode else self.workload.mixed)[total] += 1
        loras = [batch.requests[r].lora_request for r in step.req_ids] if self.lora else []
        split = None  # micro-batches: the engines' decision in lockstep, else this engine's
        if so.dp_microbatch or (so.dp_microbatch is None and self.config.enable_microbatching):
            split = microbatch_split(step, self.config.microbatching_token_threshold)
        if self.stage is not None:
            receive_stage_input(self.stage, self.buffers, total)
        target = max(total, so.dp_num_tokens or 0)  # lockstep: every engine pads alike
        out = dispatched = None
        if split is None and self.lora is None:  # a FULL graph captured already: replay it
            dispatched = mode, descriptor = self.dispatcher.dispatch(target, uniform_decode)
            replayed = self.full_graphs.get(dispatched)
            if replayed is not None:
                forward, gives_logits = replayed
                args, _ = self.buffers.load(
                    step, descriptor.num_tokens, self.metadata_groups, for_cudagraph=True
                )
                out, unreplayed = forward.replay(descriptor, args), None
        if split is not None:
            self.buffers.load(step, total)
            out = run_microbatches(
                step,
                split,
                loras,
                model=self.cudagraph_plan.bare_model,
                buffers=self.buffers,
                groups=self.metadata_groups,
                lora=self.lora,
            )
            gives_logits, mode, unreplayed = False, CUDAGraphMode.NONE, "micro-batched"
            self.unreplayed[unreplayed] += 1
        elif out is None:
            out, gives_logits, mode, unreplayed = self._run_step(
                step, target, uniform_decode, loras, dispatched
            )
        if self.stage is not None:
            send_stage_output(self.stage, out, total)
        spec = so.scheduled_spec_decode_tokens
        prompt = {}
        if (
            gives_logits
            and step.samples_every_request
            and not spec
            and not batch.prompt_logprob_req_ids
        ):
            # The decode graph's logits: row i is request i's next token.
            logits, sampling_req_ids, drafts = out[:total], step.req_ids, None
        else:
            rows = logits_rows(step, batch, spec)
            selected = hidden_rows(out, rows.indices)
            # One logits call (a collective under TP) for sampling and prompt rows alike.
            logits = selected if gives_logits else self.model.compute_logits(selected)
            if rows.prompt_spans and logits is not None:
                spans = rows.prompt_spans
                prompt = prompt_logprobs(batch, spans, logits[rows.num_sampling_rows :])
                logits = logits[: rows.num_sampling_rows]
            sampling_req_ids, drafts = rows.sampling_req_ids, rows.drafts
        self.execute_state = ExecuteModelState(
            req_ids=step.req_ids,
            logits=logits,
            sampling_req_ids=sampling_req_ids,
            runtime_mode=mode.name,
            unreplayed_reason=unreplayed,
            drafts=drafts,
            prompt_logprobs=prompt,
            grammar_bitmask=so.grammar_bitmask,
        )

    def _run_step(
        self,
        step: StepInputs,
        target: int,
        uniform_decode: bool,
        loras: list,
        dispatched: tuple[CUDAGraphMode, BatchDescriptor] | None = None,
    ) -> tuple:
        """The step's forward in one piece, padded to at least ``target`` tokens: its output,
        whether that is logits (else hidden states), the runtime mode, why no graph ran.
        ``dispatched``: the dispatcher's answer for the step, when asked already (no LoRA). A
        FULL graph it finds captured is kept for ``execute_model`` to replay directly."""
        has_lora = False
        if self.lora is not None:
            padded_size = self.dispatcher.padded_size(target, uniform_decode) or target
            has_lora = self.lora.prepare_step(loras, step.num_scheduled, max(padded_size, target))
        if dispatched is None:
            dispatched = self.dispatcher.dispatch(target, uniform_decode, has_lora=has_lora)
        mode, descriptor = dispatched
        unreplayed = None
        if mode == CUDAGraphMode.NONE and self.dispatcher.mode != CUDAGraphMode.NONE:
            unreplayed = self.dispatcher.unreplayed_reason(target)
            self.unreplayed[unreplayed] += 1
        padded = descriptor.num_tokens
        plan = self.cudagraph_plan
        gives_logits = False

        def run(mode: CUDAGraphMode) -> torch.Tensor:
            nonlocal gives_logits
            forward, gives_logits = plan.forward_for(mode, descriptor)
            args, metadata = self.buffers.load(
                step, padded, self.metadata_groups, for_cudagraph=mode == CUDAGraphMode.FULL
            )
            with set_forward_context(
                metadata, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
            ):
                return forward(*args)

        lazy = self.lazy_capture  # once captured, a size's steps replay without a call here
        if lazy is None or mode == CUDAGraphMode.NONE or (mode, descriptor) in lazy.captured:
            out = run(mode)
        else:
            out, mode, unreplayed = lazy.run(mode, descriptor, run, self.unreplayed, unreplayed)
        if mode == CUDAGraphMode.FULL and not has_lora:
            forward, _ = plan.forward_for(mode, descriptor)
            if descriptor in forward.entries:
                self.full_graphs[(mode, descriptor)] = (forward, gives_logits)
        return out, gives_logits, mode, unreplayed

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        state = self.execute_state
        if state is None:
            raise ModelRunnerError("sample_tokens() needs a preceding execute_model()")
        self.execute_state = None
        output = ModelRunnerOutput(
            req_ids=list(state.req_ids),
            runtime_mode=state.runtime_mode,
            unreplayed_reason=state.unreplayed_reason,
            prompt_logprobs=state.prompt_logprobs or {},
        )
        req_ids = state.sampling_req_ids
        if self.stage is not None and not self.samples:
            return output  # pipelined: the step's next stages sample; the tokens come later
        tokens: list[list[int]] = []
        logprobs: list = []
        if req_ids:
            batch = self.input_batch
            tokens, logprobs = sample_on_every_rank(
                self.sampler,
                list(map(batch.requests.__getitem__, req_ids)),  # no comprehension frame
                state.logits,
                state.drafts,
                state.grammar_bitmask,
                self.tp_size > 1 and self.stage is None,
                self.device,
            )
            for req_id, ids in zip(req_ids, tokens, strict=True):
                for token in ids:
                    batch.append_token(req_id, token)
            if self.proposer is not None and state.logits is not None:
                rows = batch.rows(req_ids)
                drafts = self.proposer.propose(batch.token_ids[rows], batch.num_tokens[rows])
                output.draft_token_ids = {r: d for r, d in zip(req_ids, drafts, strict=True) if d}
        got = dict(zip(req_ids, zip(tokens, logprobs, strict=True), strict=True))
        for req_id in state.req_ids:
            ids, lps = got.get(req_id, ([], None))
            output.sampled_token_ids.append(ids)
            output.logprobs.append(lps)
        return output
