"""The server's Prometheus metrics, updated from the engine loop after every step."""

from __future__ import annotations

import dataclasses

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from compile_runtime.engine.async_engine import AsyncEngine, RequestStream
from compile_runtime.engine.core import StepOutput
from compile_runtime.runner.prefix_cache import PrefixCacheStats
from compile_runtime.runner.spec_decode_stats import SpecDecodeStats

PREFIX = "compile_runtime"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge(
            f"{PREFIX}_requests_waiting", "Requests waiting for their first step", registry=r
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens sampled", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}_requests_finished",
            "Requests finished, by reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From submission to the first sampled token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between two sampled tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_blocks = Gauge(f"{PREFIX}_kv_blocks_in_use", "KV cache blocks held", registry=r)
        self.kv_blocks_total = Gauge(
            f"{PREFIX}_kv_blocks_total", "KV cache blocks that can be held", registry=r
        )
        self.steps = Counter(
            f"{PREFIX}_steps", "Engine steps, by CUDA graph runtime mode", ["mode"], registry=r
        )
        self.prefix_cache_queries = Counter(
            f"{PREFIX}_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            f"{PREFIX}_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (hit rate: hits / queries)",
            registry=r,
        )
        self._prefix_cache_seen = PrefixCacheStats()
        self.draft_tokens = Counter(
            f"{PREFIX}_spec_decode_draft_tokens",
            "Draft tokens verified (speculative decoding)",
            registry=r,
        )
        self.accepted_tokens = Counter(
            f"{PREFIX}_spec_decode_accepted_tokens",
            "Draft tokens accepted (acceptance rate: accepted / draft)",
            registry=r,
        )
        self._spec_seen = SpecDecodeStats()
        self.kv_blocks_total.set(engine.core.scheduler.block_pool.num_usable)
        engine.step_hooks.append(self.on_step)
        engine.token_hooks.append(self.on_token)
        engine.abort_hooks.append(lambda stream: self.requests.labels(finish_reason="abort").inc())

    def on_token(self, stream: RequestStream, now: float) -> None:
        if stream.first_token_at is None:
            self.ttft.observe(now - stream.submitted)
        elif stream.last_token_at is not None:
            self.itl.observe(now - stream.last_token_at)
        self.generation_tokens.inc()

    def on_step(self, out: StepOutput, engine: AsyncEngine) -> None:
        scheduler = engine.core.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(engine.num_waiting)
        self.kv_blocks.set(engine.core.num_blocks_in_use)
        self.steps.labels(mode=out.runtime_mode or "NONE").inc()
        cache = scheduler.prefix_cache_stats
        new = cache.since(self._prefix_cache_seen)
        self.prefix_cache_queries.inc(new.queries)
        self.prefix_cache_hits.inc(new.hits)
        self._prefix_cache_seen = dataclasses.replace(cache)
        spec = scheduler.spec_decode_stats
        new_spec = spec.since(self._spec_seen)
        self.draft_tokens.inc(new_spec.num_draft_tokens)
        self.accepted_tokens.inc(new_spec.num_accepted_tokens)
        self._spec_seen = dataclasses.replace(spec)
        for request in out.finished:
            self.requests.labels(finish_reason=request.finish_reason or "stop").inc()

    def refresh(self, engine: AsyncEngine) -> None:
        """Values that change between steps too (an abort frees blocks with no step after)."""
        self.waiting.set(engine.num_waiting)
        self.kv_blocks.set(engine.core.num_blocks_in_use)
        self.running.set(len(engine.core.scheduler.running))

    def render(self) -> bytes:
        return generate_latest(self.registry)
