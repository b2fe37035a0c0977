"""The model runner: one step of the scheduler's plan through the compiled model.

``execute_model`` applies the scheduler's differences to the persistent
batch, flattens the step's tokens into persistent buffers, asks the
dispatcher for the runtime mode and padded size, builds attention metadata
once and runs the forward inside a forward context, then computes logits in
one call: the last position of each request whose prompt is complete, every
draft position of a request verifying drafts (speculative decoding), and the
prompt positions of requests that asked for prompt logprobs. ``sample_tokens``
then samples (or verifies drafts with the rejection sampler) and, with
speculative decoding, proposes the next drafts. The state between the two
calls lives in one ``ExecuteModelState``.

Under tensor parallelism every rank runs its own runner on the same
scheduler output (so the persistent batches stay identical); the logits are
gathered on rank 0, which samples and broadcasts the tokens each request got
so that every rank appends the same ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compile_runtime.attention.kv_cache import (
    allocate_kv_cache,
    bind_kv_cache,
    compute_slot_mapping,
    kv_cache_bytes_per_block,
)
from compile_runtime.attention.layer import attention_layers
from compile_runtime.attention.metadata import AttentionMetadataBuilder
from compile_runtime.backends.attention.registry import min_cg_support
from compile_runtime.compiler.decorator import attention_split, backend_seconds
from compile_runtime.config import CompilationConfig, CUDAGraphMode, RunnerConfig
from compile_runtime.counters import compilation_counter
from compile_runtime.cudagraph.capture import CaptureInputs, CaptureReport, capture
from compile_runtime.cudagraph.dispatcher import BatchDescriptor, CudagraphDispatcher
from compile_runtime.cudagraph.wrapper import CUDAGraphWrapper, wrap_full_model
from compile_runtime.device import resolve_device
from compile_runtime.distributed import broadcast_from_first_rank, get_tp_rank, get_tp_world_size
from compile_runtime.forward_context import set_forward_context
from compile_runtime.models.interface import CausalLanguageModel
from compile_runtime.models.registry import load_model
from compile_runtime.planner.workload import Workload
from compile_runtime.runner.cpu_threads import resolve_num_threads
from compile_runtime.runner.input_batch import InputBatch
from compile_runtime.runner.kv_sizing import (
    CudaMemory,
    blocks_per_request,
    cuda_kv_budget,
    most_blocks_needed,
    size_runner_config,
)
from compile_runtime.runner.ngram_proposer import NgramProposer
from compile_runtime.runner.rejection_sampler import rejection_sample
from compile_runtime.runner.sampler import Sampler, gather_logprobs, greedy_tokens
from compile_runtime.runner.sampling_metadata import (
    RequestSamplingState,
    SamplingMetadata,
)
from compile_runtime.runner.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    req_ids: list[str]
    # [rows, vocab]: one per request that samples, 1 + its drafts with drafts; None on ranks > 0
    logits: torch.Tensor | None
    sampling_req_ids: list[str]  # requests whose prompt is complete: they get tokens
    runtime_mode: str | None = None
    drafts: list[list[int]] | None = None  # per sampling request, when any has drafts
    prompt_logprobs: dict[str, tuple[int, list]] | None = None


class ModelRunnerError(RuntimeError):
    pass


@dataclass
class StartupTimes:
    """Where a runner's start-up went (seconds), for the one start-up line users see."""

    weights: float = 0.0  # build the model and load its weights
    first_forward: float = 0.0  # trace + compile, or load the saved program, + one forward
    compile: float = 0.0  # of which our backend: passes, split, compile or load the pieces
    saved_program: bool = False  # the first forward ran a saved program: no trace at all
    kv_cache: float = 0.0
    graphs: float = 0.0  # CUDA graph capture
    num_blocks: int = 0
    kv_cache_tokens: int = 0  # tokens the cache holds (the null block left out)
    kv_cache_bytes: int = 0

    @property
    def total(self) -> float:
        return self.weights + self.first_forward + self.kv_cache + self.graphs

    def summary(self) -> str:
        if self.saved_program:
            model = f"saved program {self.first_forward:.2f} s (no trace, no compile)"
        else:
            trace = max(self.first_forward - self.compile, 0.0)
            model = f"trace {trace:.2f} s, compile {self.compile:.2f} s"
        return (
            f"start-up {self.total:.2f} s: weights {self.weights:.2f} s, {model}, "
            f"KV cache {self.kv_cache:.2f} s ({self.kv_cache_bytes / 2**30:.2f} GiB, "
            f"{self.kv_cache_tokens} tokens in {self.num_blocks} blocks), "
            f"CUDA graphs {self.graphs:.2f} s"
        )


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        compilation_config: CompilationConfig,
        runner_config: RunnerConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        use_transformers: bool = False,
    ):
        self.config = runner_config or RunnerConfig()
        self.compilation_config = compilation_config
        self.device = resolve_device(device)
        self.dtype = dtype
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_threads = torch.get_num_threads()
        if self.device.type == "cpu":  # before compiling: Inductor bakes the count in
            self.num_threads = resolve_num_threads(self.config.num_threads, self.tp_size)
            torch.set_num_threads(self.num_threads)
        if self.device.type == "cuda":  # this runner's own peak, not an earlier engine's
            torch.cuda.reset_peak_memory_stats(self.device)
        self._allocated_at_start = self._allocated()
        start = time.perf_counter()
        self.model: CausalLanguageModel = load_model(
            model_dir,
            compilation_config,
            dtype=dtype,
            device=self.device,
            use_transformers=use_transformers,
            cpu_pack_weights=self.config.cpu_pack_weights,
        )
        self.startup = StartupTimes(weights=time.perf_counter() - start)
        # The engine sized these already; a runner built directly fills them here.
        size_runner_config(self.config, self.model.config, dtype, self.device, self.tp_size)
        self.layers = attention_layers(self.model)
        if not self.layers:
            raise ModelRunnerError(f"{type(self.model).__name__} has no Attention layers")
        backends = {layer.attn_backend for layer in self.layers}
        c = self.config
        spec = c.speculative_config
        self.proposer = (
            NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
            if spec is not None
            else None
        )
        # A decode step runs 1 + k tokens per request when every request has k drafts: that
        # is the uniform decode batch the decode mode's graphs are captured for.
        self.uniform_decode_query_len = 1 + (spec.num_speculative_tokens if spec else 0)
        self.resolved = compilation_config.resolve(
            min_cg_support(backends),
            uniform_decode_query_len=self.uniform_decode_query_len,
            cuda_available=self.device.type == "cuda",
        )
        # No step can hold more tokens than max_num_seqs full-length requests.
        self.max_num_tokens = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        self.input_batch = InputBatch(c.max_num_seqs, c.max_model_len, c.block_size, self.device)
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.long, device=self.device)
        self.slot_mapping = torch.full(
            (self.max_num_tokens,), -1, dtype=torch.long, device=self.device
        )
        # One builder per group of layers that can share a step's metadata: per backend, and
        # per what the backend plans into it (FlashInfer: window and soft cap, so Gemma 2's
        # alternating layers get two plans).
        groups: dict[Hashable, tuple[AttentionMetadataBuilder, list[str]]] = {}
        for layer in self.layers:
            backend = layer.attn_backend
            key = (backend, backend.metadata_key(layer.spec))
            if key not in groups:
                builder = backend.make_builder(
                    layer.spec, c.block_size, c.max_num_seqs, self.device
                )
                groups[key] = (builder, [])
            groups[key][1].append(layer.layer_name)
        self.metadata_groups = list(groups.values())
        self.dispatcher = CudagraphDispatcher(
            compilation_config, max_num_tokens=self.max_num_tokens, max_num_reqs=c.max_num_seqs
        )
        self.dispatcher.initialize_keys(self.resolved.cudagraph_mode, self.uniform_decode_query_len)
        self.forward_model = self.model.model
        if self.resolved.cudagraph_mode.has_full_cudagraphs():
            self.forward_model = wrap_full_model(self.forward_model, compilation_config)
        self.sampler = Sampler()
        self.workload = Workload()
        self.execute_state: ExecuteModelState | None = None
        self.num_blocks = 0
        self.capture_report: CaptureReport | None = None

    # ---- start-up ---------------------------------------------------------

    def initialize(self) -> None:
        """Compile (first trace at the largest size), size and bind the KV cache, capture graphs."""
        start = time.perf_counter()
        programs = compilation_counter.num_programs_loaded
        with torch.inference_mode():
            self._dummy_forward(self.max_num_tokens)
        times = self.startup
        times.first_forward = time.perf_counter() - start
        times.saved_program = compilation_counter.num_programs_loaded > programs
        times.compile = backend_seconds(self.model)
        if self.resolved.cudagraph_mode.has_piecewise_cudagraphs() and not attention_split(
            self.model
        ):  # the split took no attention out (or nothing was compiled): no piecewise graphs
            self.resolved = self.compilation_config.resolve(
                min_cg_support({layer.attn_backend for layer in self.layers}),
                attention_split=False,
                uniform_decode_query_len=self.uniform_decode_query_len,
                cuda_available=self.device.type == "cuda",
            )
            self.dispatcher.initialize_keys(
                self.resolved.cudagraph_mode, self.uniform_decode_query_len
            )
        start = time.perf_counter()
        self.num_blocks = times.num_blocks = self._num_kv_blocks()
        caches = allocate_kv_cache(
            self.layers,
            self.num_blocks,
            self.config.block_size,
            dtype=self.dtype,
            device=self.device,
        )
        bind_kv_cache(self.layers, caches)
        times.kv_cache = time.perf_counter() - start
        times.kv_cache_tokens = (self.num_blocks - 1) * self.config.block_size
        unique = {id(t): t for t in caches.values()}.values()  # layers may share a cache
        times.kv_cache_bytes = sum(t.numel() * t.element_size() for t in unique)
        if self.dispatcher.capture_descriptors():
            start = time.perf_counter()
            with torch.inference_mode():
                self.capture_report = capture(
                    self.forward_model, self._capture_inputs, self.dispatcher
                )
            times.graphs = time.perf_counter() - start

    def _dummy_forward(self, num_tokens: int) -> torch.Tensor:
        """A forward without metadata: attention runs dense over the tokens, no cache."""
        with set_forward_context(None, num_tokens=num_tokens):
            return self.forward_model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _num_kv_blocks(self) -> int:
        """Blocks for the budget (after the profiling forward), capped at what can ever be used."""
        c = self.config
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        per_block = kv_cache_bytes_per_block(self.layers, c.block_size, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the profile's activations count as free
            free, total = torch.cuda.mem_get_info(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            memory = CudaMemory(
                total=total,
                free=free,
                own_peak=peak - self._allocated_at_start,
                activations=peak - self._allocated(),
            )
            budget = cuda_kv_budget(memory, c.gpu_memory_utilization)
        else:
            budget = c.kv_cache_bytes
        num_blocks = min(
            budget // per_block, most_blocks_needed(c.max_num_seqs, c.max_model_len, c.block_size)
        )
        needed = blocks_per_request(c.max_model_len, c.block_size) + 1
        if num_blocks < needed:
            raise ModelRunnerError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num_blocks} blocks of "
                f"{c.block_size} tokens; one request of max_model_len={c.max_model_len} needs "
                f"{needed}. Raise kv_cache_bytes (--kv-cache-bytes) / gpu_memory_utilization or lower "
                f"max_model_len (--max-model-len)"
            )
        return int(num_blocks)

    def _capture_inputs(self, descriptor: BatchDescriptor, mode: CUDAGraphMode) -> CaptureInputs:
        """Inputs of a capture; attention metadata only where the graph holds attention (FULL).

        Under PIECEWISE attention runs between the graphs, so the capture runs
        it without metadata (dense, no cache), like the profiling forward. A
        FULL capture gets a batch of ``num_reqs`` requests (enough of them that
        none is longer than ``max_model_len``) whose block tables point at block 1
        and whose writes go to the null slot.
        """
        n = descriptor.num_tokens
        args = (self.input_ids[:n], self.positions[:n])
        if mode != CUDAGraphMode.FULL:
            return CaptureInputs(args=args)
        c = self.config
        num_reqs = max(descriptor.num_reqs or 1, -(-n // c.max_model_len))
        num_reqs = min(num_reqs, c.max_num_seqs, n)
        query_lens = np.full(num_reqs, n // num_reqs, dtype=np.int32)
        query_lens[-1] += n - int(query_lens.sum())
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.from_numpy(np.cumsum(query_lens))
        seq_lens = torch.from_numpy(query_lens.copy())
        block_table = torch.ones(
            (num_reqs, self.input_batch.block_table.max_blocks_per_req),
            dtype=torch.int32,
            device=self.device,
        )
        self.slot_mapping[:n].fill_(-1)
        metadata = self._build_metadata(
            qsl,
            seq_lens,
            block_table,
            self.slot_mapping[:n],
            n,
            num_padded_tokens=n,
            for_cudagraph=True,
        )
        return CaptureInputs(args=args, attn_metadata=metadata)

    def _build_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The step's attention metadata: one object, or one per layer when groups differ."""
        if len(self.metadata_groups) == 1:
            return self.metadata_groups[0][0].build(*args, **kwargs)
        by_layer = {}
        for builder, names in self.metadata_groups:
            metadata = builder.build(*args, **kwargs)
            by_layer.update(dict.fromkeys(names, metadata))
        return by_layer

    def release(self) -> None:
        """Give back the KV cache and the FULL graphs (``LLM.shutdown``); the runner cannot step after."""
        for layer in self.layers:
            layer.kv_cache = None
        self.num_blocks = 0
        self.execute_state = None
        if isinstance(self.forward_model, CUDAGraphWrapper):
            self.forward_model.entries.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- one step ---------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = batch.requests[req_id].row
            batch.block_table.append_row(row, blocks)
            batch.num_computed_tokens[row] = computed

    @torch.inference_mode()  # as start-up: buffers made there are inference tensors
    def execute_model(self, so: SchedulerOutput) -> None:
        if self.execute_state is not None:
            raise ModelRunnerError(
                "execute_model() called twice without sample_tokens(); call sample_tokens() "
                "after every execute_model()"
            )
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            self.execute_state = ExecuteModelState([], torch.empty(0), [])
            return
        batch = self.input_batch
        rows = batch.rows(req_ids)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # After the request's last token, not counted in its tokens until accepted.
            row = batch.requests[req_id].row
            end = int(batch.num_tokens[row])
            batch.token_ids[row, end : end + len(drafts)] = drafts
        num_sched = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        total = int(num_sched.sum())
        if total > self.max_num_tokens:
            raise ModelRunnerError(
                f"{total} tokens scheduled in one step; max_num_batched_tokens is "
                f"{self.max_num_tokens}"
            )
        cu = np.cumsum(num_sched)
        req_index = np.repeat(np.arange(len(req_ids)), num_sched)
        offsets = np.arange(total) - np.repeat(cu - num_sched, num_sched)
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        positions = computed[req_index] + offsets
        token_rows = rows[req_index]
        token_ids = batch.token_ids[token_rows, positions]
        slots = compute_slot_mapping(
            torch.from_numpy(batch.block_table.table),
            torch.from_numpy(token_rows),
            torch.from_numpy(positions),
            batch.block_table.block_size,
        )
        seq_lens = computed + num_sched
        # Every request runs 1 + k tokens (a decode with k drafts): the decode graphs' batch.
        uniform_decode = bool((num_sched == self.uniform_decode_query_len).all())
        self.workload.record(total, uniform_decode)

        mode, descriptor = self.dispatcher.dispatch(total, uniform_decode)
        padded = descriptor.num_tokens
        self.input_ids[:total].copy_(torch.from_numpy(token_ids))
        self.positions[:total].copy_(torch.from_numpy(positions))
        self.slot_mapping[:total].copy_(slots)
        if padded > total:
            self.input_ids[total:padded].zero_()
            self.positions[total:padded].zero_()

        qsl = torch.zeros(len(req_ids) + 1, dtype=torch.int32)
        qsl[1:] = torch.from_numpy(cu)
        metadata = self._build_metadata(
            qsl,
            torch.from_numpy(seq_lens.astype(np.int32)),
            batch.block_table.gather(rows),
            self.slot_mapping[:padded],
            total,
            num_padded_tokens=padded,
            for_cudagraph=mode == CUDAGraphMode.FULL,
        )
        with set_forward_context(
            metadata, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
        ):
            hidden = self.forward_model(self.input_ids[:padded], self.positions[:padded])

        # Only requests whose whole known sequence is now computed get tokens: from the
        # logits of their last position, and of every draft position before it.
        done = seq_lens >= batch.num_tokens[rows]
        sampling_idx = np.nonzero(done)[0]
        sampling_req_ids = [req_ids[i] for i in sampling_idx]
        drafts = None
        num_logits = np.ones(len(sampling_idx), dtype=np.int64)
        if so.scheduled_spec_decode_tokens:
            spec = so.scheduled_spec_decode_tokens
            drafts = [spec.get(r, []) for r in sampling_req_ids]
            num_logits += [len(d) for d in drafts]
        # The last num_logits positions of each sampling request, in order.
        ends = np.repeat(cu[sampling_idx], num_logits)
        back = np.repeat(np.cumsum(num_logits), num_logits) - np.arange(int(num_logits.sum()))
        logits_idx = ends - back
        prompt_spans = self._prompt_logprob_spans(req_ids, computed, num_sched, cu)
        if prompt_spans:  # one logits call (a collective under TP) for both kinds of rows
            logits_idx = np.concatenate(
                [logits_idx, *(np.arange(f, f + m) for _, _, f, m in prompt_spans)]
            )
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_idx).to(self.device)])
        prompt_logprobs = {}
        if prompt_spans and logits is not None:
            sampled_rows = int(num_logits.sum())
            prompt_logprobs = self._prompt_logprobs(prompt_spans, logits[sampled_rows:])
            logits = logits[:sampled_rows]
        batch.num_computed_tokens[rows] = seq_lens
        self.execute_state = ExecuteModelState(
            req_ids=req_ids,
            logits=logits,
            sampling_req_ids=sampling_req_ids,
            runtime_mode=mode.name,
            drafts=drafts,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprob_spans(
        self, req_ids: list[str], computed: np.ndarray, num_sched: np.ndarray, cu: np.ndarray
    ) -> list[tuple[str, int, int, int]]:
        """(request, first position, flat row, count) of this step's prompt positions whose
        next token is a prompt token, for the requests that want prompt logprobs."""
        batch = self.input_batch
        if not batch.prompt_logprob_req_ids:
            return []
        spans = []
        for i, req_id in enumerate(req_ids):
            if req_id not in batch.prompt_logprob_req_ids:
                continue
            first = int(computed[i])
            end = min(first + int(num_sched[i]), len(batch.requests[req_id].prompt_token_ids) - 1)
            if end > first:
                spans.append((req_id, first, int(cu[i] - num_sched[i]), end - first))
        return spans

    def _prompt_logprobs(
        self, spans: list[tuple[str, int, int, int]], logits: torch.Tensor
    ) -> dict[str, tuple[int, list]]:
        """Per request: (position of the first prompt token scored, its logprobs onward)."""
        batch = self.input_batch
        raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
        targets, top_k = [], []
        for req_id, first, _, count in spans:
            row = batch.requests[req_id].row
            targets.append(torch.from_numpy(batch.token_ids[row, first + 1 : first + 1 + count]))
            top_k += [batch.requests[req_id].sampling_params.prompt_logprobs] * count
        flat = gather_logprobs(raw, torch.cat(targets).to(raw.device), top_k)
        out, at = {}, 0
        for req_id, first, _, count in spans:
            out[req_id] = (first + 1, flat[at : at + count])
            at += count
        return out

    def _sample(
        self, logits: torch.Tensor, states: list, drafts: list[list[int]] | None
    ) -> tuple[list[list[int]], list]:
        """Per request its tokens and their logprobs (None where not asked for).

        Without drafts one token each; with drafts the rejection sampler verifies them.
        """
        plain = all(s.sampling_params.plain_argmax for s in states)
        if drafts is None and plain:
            # Nothing changes the logits: skip building the batch's sampling tensors.
            return [[t] for t in greedy_tokens(logits).tolist()], [None] * len(states)
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
        sampled = self.sampler(logits, metadata)
        logprobs = [lp if lp is None else [lp] for lp in sampled.logprobs]
        return [[t] for t in sampled.token_ids.tolist()], logprobs

    def _broadcast_tokens(self, tokens: list[list[int]] | None, num_reqs: int, width: int):
        """Rank 0's tokens per request on every rank (padded with -1 on the wire)."""
        wire = torch.full((num_reqs, width), -1, dtype=torch.long, device=self.device)
        if tokens is not None:
            for i, ids in enumerate(tokens):
                wire[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        broadcast_from_first_rank(wire)
        return [[t for t in row if t >= 0] for row in wire.tolist()]

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        state = self.execute_state
        if state is None:
            raise ModelRunnerError("sample_tokens() needs a preceding execute_model()")
        self.execute_state = None
        output = ModelRunnerOutput(
            req_ids=list(state.req_ids),
            runtime_mode=state.runtime_mode,
            prompt_logprobs=state.prompt_logprobs or {},
        )
        req_ids = state.sampling_req_ids
        tokens: list[list[int]] = []
        logprobs: list = []
        if req_ids:
            width = 1 + max((len(d) for d in state.drafts or []), default=0)
            if state.logits is not None:  # rank 0 samples
                states = [self.input_batch.requests[r] for r in req_ids]
                tokens, logprobs = self._sample(state.logits, states, state.drafts)
            if self.tp_size > 1:
                tokens = self._broadcast_tokens(
                    tokens if state.logits is not None else None, len(req_ids), width
                )
            if not logprobs:
                logprobs = [None] * len(req_ids)
            batch = self.input_batch
            for i, (req_id, ids) in enumerate(zip(req_ids, tokens, strict=True)):
                row = batch.requests[req_id].row
                for token in ids:
                    batch.append_token(req_id, token)
                if state.drafts is not None:  # rejected drafts' KV is not computed
                    batch.num_computed_tokens[row] -= len(state.drafts[i]) + 1 - len(ids)
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
