"""Data parallelism: several engine cores (each its own scheduler, KV cache and executor)
behind one front end, offline ``LLM`` and ``serve`` alike.

``DataParallelCore`` stands where one ``EngineCore`` stands (the same calls), so an offline
call and the server's engine loop run unchanged. A request goes to one engine for its
whole life: the one already holding the longest prefix of it in its prefix cache, unless
that engine has ``AFFINITY_SLACK`` more requests than the least loaded one; else the least
loaded (waiting + running). A step steps every engine with work at once, each in its own
thread (their workers are processes: the threads only wait on them), and merges what they
gave. When one engine's step fails, the others' tokens are still delivered; the failure is
raised at the next ``step`` (``has_unfinished`` stays true until then, so no caller can
finish without hearing of it).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from compile_runtime.core.kv_blocks import find_cached_prefix
from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.core.scheduler_output import SchedulerOutput
from compile_runtime.core.stats import PrefixCacheStats, SpecDecodeStats
from compile_runtime.engine.core import EngineCore, StepFailedError, StepOutput
from compile_runtime.executor import Executor
from compile_runtime.lora.request import LoRARequest

# How many more requests than the least loaded engine an engine may have and still be
# given a request whose prefix it holds.
AFFINITY_SLACK = 4


def _uniform_decode(engine: EngineCore, plan: SchedulerOutput) -> bool:
    """Every request of the plan runs one token and the same number of drafts."""
    spec = engine.runner_config.speculative_config
    q = 1 + (spec.num_speculative_tokens if spec else 0)
    return bool(plan.num_scheduled_tokens) and all(
        n == q for n in plan.num_scheduled_tokens.values()
    )


def _would_split(engine: EngineCore, plan: SchedulerOutput) -> bool:
    sizes = engine.runner_config
    return (
        sizes.enable_microbatching
        and len(plan.num_scheduled_tokens) >= 2
        and plan.total_num_scheduled_tokens >= sizes.microbatching_token_threshold
    )


def summed(stats: list[Any]) -> Any:
    """The field-by-field sum of stats dataclasses (prefix cache, speculative decoding)."""
    total = dataclasses.replace(stats[0])
    for s in stats[1:]:
        for f in dataclasses.fields(total):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


class DataParallelCore:
    def __init__(self, engines: list[EngineCore], lockstep: bool = False):
        """``lockstep``: before each step the engines agree on its padded token count, the
        uniform-decode flag and micro-batching (``coordinate``), as ranks whose graph
        replays must line up do."""
        if not engines:
            raise ValueError("DataParallelCore needs at least one engine")
        self.engines = engines
        first = engines[0]
        self.eos_token_ids = first.eos_token_ids
        self.adapters = first.adapters  # the same model: one check serves every engine
        self._ids = itertools.count()
        self._owner: dict[str, int] = {}  # request id -> engine index, while unfinished
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="dp-engine")
        self._failure: StepFailedError | None = None
        self.routed = [0] * len(engines)  # requests given to each engine so far
        self.lockstep = lockstep
        self.num_coordinations = 0  # steps the engines agreed on (one exchange each)

    # ---- what EngineCore offers ------------------------------------------------------

    @property
    def schedulers(self) -> list[Scheduler]:
        return [e.scheduler for e in self.engines]

    def make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Ids unique over every engine (each engine's own counter would repeat them)."""
        request = self.engines[0].make_request(prompt_token_ids, params, lora_request)
        request.req_id = f"dp{next(self._ids)}"
        return request

    def check(self, request: Request) -> None:
        self.engines[0].check(request)  # the same limits on every engine

    def add(self, requests: list[Request]) -> None:
        placed: list[int] = []  # the engine of each request of this call so far
        for r in requests:
            placed.append(self._choose(r, placed))
        for i, engine in enumerate(self.engines):
            mine = [r for r, c in zip(requests, placed, strict=True) if c == i]
            if mine:
                engine.add(mine)
                self.routed[i] += len(mine)
                for r in mine:
                    self._owner[r.req_id] = i

    def _choose(self, request: Request, placed: list[int]) -> int:
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        for i in placed:
            loads[i] += 1
        least = min(range(len(loads)), key=lambda i: (loads[i], self.routed[i] + placed.count(i)))
        best, best_hits = least, 0
        for i, engine in enumerate(self.engines):
            s = engine.scheduler
            if not s.enable_prefix_caching or loads[i] > loads[least] + AFFINITY_SLACK:
                continue
            hits = len(find_cached_prefix(s.block_pool, request, s.block_size))
            if hits > best_hits:
                best, best_hits = i, hits
        return best

    def abort(self, req_ids: list[str]) -> list[Request]:
        out = []
        for i, engine in enumerate(self.engines):
            mine = [r for r in req_ids if self._owner.get(r) == i]
            if mine:
                out += engine.abort(mine)
        self._forget([r.req_id for r in out])
        return out

    def abort_all(self) -> list[str]:
        ids = [r for e in self.engines for r in e.abort_all()]
        self._forget(ids)
        return ids

    def stop(self, stops: dict[str, str]) -> list[Request]:
        out = []
        for i, engine in enumerate(self.engines):
            mine = {r: s for r, s in stops.items() if self._owner.get(r) == i}
            if mine:
                out += engine.stop(mine)
        self._forget([r.req_id for r in out])
        return out

    def has_unfinished(self) -> bool:
        return self._failure is not None or any(e.has_unfinished() for e in self.engines)

    @property
    def num_blocks_in_use(self) -> int:
        return sum(e.num_blocks_in_use for e in self.engines)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return summed([e.prefix_cache_stats for e in self.engines])

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return summed([e.spec_decode_stats for e in self.engines])

    def step(self) -> StepOutput:
        """One step of every engine with work, at once; their outputs merged."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        start = time.perf_counter()
        active = [e for e in self.engines if e.has_unfinished()]
        plans = self.coordinate(active) if self.lockstep else [None] * len(active)
        if len(active) == 1:
            outs = [active[0].step(plans[0])]
        else:
            futures = [self._pool.submit(e.step, p) for e, p in zip(active, plans, strict=True)]
            outs, failures, fatal = [], [], None
            for future in futures:  # every engine's step finished before anything is raised
                try:
                    outs.append(future.result())
                except StepFailedError as e:
                    failures.append(e)
                except BaseException as e:  # an engine's workers are gone
                    fatal = fatal or e
            if fatal is not None:
                raise fatal
            if failures:
                self._failure = failures[0]
                for extra in failures[1:]:  # every failed request is named
                    self._failure.failed_req_ids += extra.failed_req_ids
        merged = StepOutput(
            tokens=[t for o in outs for t in o.tokens],
            finished=[r for o in outs for r in o.finished],
            decode_only=bool(outs) and all(o.decode_only for o in outs),
            num_scheduled_tokens=sum(o.num_scheduled_tokens for o in outs),
            seconds=time.perf_counter() - start,
            runtime_mode=next((o.runtime_mode for o in outs if o.runtime_mode), None),
            unreplayed_reason=next(
                (o.unreplayed_reason for o in outs if o.unreplayed_reason), None
            ),
            prompt_logprobs={k: v for o in outs for k, v in o.prompt_logprobs.items()},
        )
        self._forget([r.req_id for r in merged.finished])
        if self._failure is not None:
            self._forget(self._failure.failed_req_ids)
        return merged

    def coordinate(self, engines: list[EngineCore]) -> list[SchedulerOutput]:
        """Schedule every engine's step, then agree: the largest token count (each pads to
        it), a uniform decode only if every engine's is, micro-batches only if every engine
        would split. The engines' plans, the agreement written into each."""
        plans = [e.scheduler.schedule() for e in engines]
        self.num_coordinations += 1
        counts = [p.total_num_scheduled_tokens for p in plans]
        uniform = all(_uniform_decode(e, p) for e, p in zip(engines, plans, strict=True))
        split = all(_would_split(e, p) for e, p in zip(engines, plans, strict=True))
        for plan in plans:
            plan.dp_num_tokens = max(counts)
            plan.dp_uniform_decode = uniform
            plan.dp_microbatch = split
        return plans

    def reset(self, executors: list[Executor]) -> None:
        """Each engine on its new executor (``EngineCore.reset``), no request left anywhere."""
        for engine, executor in zip(self.engines, executors, strict=True):
            engine.reset(executor)
        self._owner.clear()
        self._failure = None

    def check_workers(self) -> None:
        for engine in self.engines:
            engine.check_workers()

    def _forget(self, req_ids: list[str]) -> None:
        for r in req_ids:
            self._owner.pop(r, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
