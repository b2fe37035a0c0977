"""The server's Prometheus metrics, updated from the engine loop after every step."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from compile_runtime.engine.async_engine import AsyncEngine, RequestStream
from compile_runtime.engine.core import StepOutput
from compile_runtime.engine.data_parallel import summed

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
        self.unreplayed_steps = Counter(
            f"{PREFIX}_unreplayed_steps",
            "Steps that ran without a graph while graphs are on, by reason",
            ["reason"],
            registry=r,
        )
        self.engine_running = Gauge(
            f"{PREFIX}_engine_requests_running",
            "Requests in each engine's batch (data parallelism: one per engine)",
            ["engine"],
            registry=r,
        )
        self.engine_kv_blocks = Gauge(
            f"{PREFIX}_engine_kv_blocks_in_use",
            "KV cache blocks each engine holds",
            ["engine"],
            registry=r,
        )
        r.register(SchedulerTotals(engine))
        r.register(WorkerDeaths(engine))
        self.refresh(engine)
        engine.step_hooks.append(self.on_step)
        engine.token_hooks.append(self.on_token)
        engine.finish_hooks.append(self.on_finish)

    def on_finish(self, stream: RequestStream, reason: str) -> None:
        """Each request once, by how it ended: "stop" (EOS, stop token or stop string),
        "length" or "abort" (its client went away)."""
        self.requests.labels(finish_reason=reason).inc()

    def on_token(self, stream: RequestStream, now: float) -> None:
        if stream.first_token_at is None:
            self.ttft.observe(now - stream.submitted)
        elif stream.last_token_at is not None:
            self.itl.observe(now - stream.last_token_at)
        self.generation_tokens.inc()

    def on_step(self, out: StepOutput, engine: AsyncEngine) -> None:
        self.refresh(engine)
        self.steps.labels(mode=out.runtime_mode or "NONE").inc()
        if out.unreplayed_reason:
            self.unreplayed_steps.labels(reason=out.unreplayed_reason).inc()

    def refresh(self, engine: AsyncEngine) -> None:
        """Values that change between steps too (an abort frees blocks with no step after)."""
        self.waiting.set(engine.num_waiting)
        schedulers = engine.core.schedulers  # new ones after a restart of the workers
        self.kv_blocks_total.set(sum(s.block_pool.num_usable for s in schedulers))
        self.kv_blocks.set(engine.core.num_blocks_in_use)
        self.running.set(sum(len(s.running) for s in schedulers))
        for i, s in enumerate(schedulers):
            self.engine_running.labels(engine=str(i)).set(len(s.running))
            pool = s.block_pool
            self.engine_kv_blocks.labels(engine=str(i)).set(pool.num_usable - pool.num_free)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulerTotals:
    """Counters the scheduler already keeps as running totals, read at scrape time."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        schedulers = self.engine.core.schedulers
        cache = summed([s.prefix_cache_stats for s in schedulers])
        spec = summed([s.spec_decode_stats for s in schedulers])
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", cache.queries),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache (hit rate: hits / queries)",
                cache.hits,
            ),
            (
                "spec_decode_draft_tokens",
                "Draft tokens verified (speculative decoding)",
                spec.num_draft_tokens,
            ),
            (
                "spec_decode_accepted_tokens",
                "Draft tokens accepted (acceptance rate: accepted / draft)",
                spec.num_accepted_tokens,
            ),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class WorkerDeaths:
    """Deaths of the model's workers, the restarts after them and the requests each failed,
    read at scrape time from the engine's ``WorkerRestarts``."""

    def __init__(self, engine: AsyncEngine):
        self.restarts = engine.restarts

    def collect(self):
        deaths = self.restarts.deaths
        yield CounterMetricFamily(
            f"{PREFIX}_worker_deaths", "Deaths of the model's worker processes", len(deaths)
        )
        yield CounterMetricFamily(
            f"{PREFIX}_worker_restarts",
            "Restarts of the workers that served again",
            self.restarts.restarted,
        )
        failed = CounterMetricFamily(
            f"{PREFIX}_requests_failed_by_worker_death",
            "Requests that ended in an error because the workers died, by death (1, 2, ...)",
            labels=["death"],
        )
        for i, death in enumerate(deaths, 1):
            failed.add_metric([str(i)], death.failed_requests)
        yield failed
        seconds = [d.restart_seconds for d in deaths if d.restart_seconds is not None]
        if seconds:
            yield GaugeMetricFamily(
                f"{PREFIX}_last_worker_restart_seconds",
                "From the last death to serving again",
                seconds[-1],
            )
