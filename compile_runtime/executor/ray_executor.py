"""``RayExecutor``: workers as Ray actors, placed with placement groups.

Ranks may live on different machines. Under pipeline parallelism each stage is one
placement group packed onto one node (``STRICT_PACK``): tensor parallelism stays inside a
node, and the stages go where Ray finds room, so a cluster of nodes that each hold one
stage runs one stage a node. ``rank_nodes`` says which node each rank got. Rank 0's actor
reports its node; when
every actor is on one node the process group meets on the loopback address,
otherwise on rank 0's node address. Each step the scheduler output is put in
Ray's object store once (``ray.put``) and every actor receives the same
reference; the sampling rank's reply holds the sampled tokens. A failed or dead actor
becomes ``WorkerDiedError`` naming its rank, and every actor is killed.

``ray`` is an optional dependency: ``pip install 'compile-runtime[ray]'``.
Without a running Ray instance (``ray.init`` not called), one is started
here and stopped again on ``shutdown()``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from compile_runtime.config import EngineConfig
from compile_runtime.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from compile_runtime.device import default_device
from compile_runtime.distributed.parallel_state import LOOPBACK, free_port
from compile_runtime.executor.base import (
    Executor,
    ExecutorError,
    WorkerDiedError,
)
from compile_runtime.worker.worker import Worker, error_summary

logger = logging.getLogger(__name__)

RAY_MISSING = (
    "distributed_executor_backend='ray' needs the ray package, which is not installed; "
    "install it with: pip install 'compile-runtime[ray]' (or: pip install ray)"
)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    return ray


class RayWorker:
    """The actor body: a ``Worker`` plus what the driver asks before it exists."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int):
        os.environ.update(config.worker_env)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.worker: Worker | None = None

    def node(self) -> tuple[str, str]:
        """(node id, node address) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, init_method: str):
        # Ray makes CUDA_VISIBLE_DEVICES hold this actor's GPU only: it is cuda:0 here.
        self.worker = Worker(self.config, self.rank, self.world_size, init_method, local_rank=0)
        return self.worker.start()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    local_ranks = False

    def __init__(self, config: EngineConfig):
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.closed = False
        self.actors: list[Any] = []
        self.placement_groups: list[Any] = []
        self._remove_pg = remove_placement_group
        self._pending: deque[list[Any]] = deque()  # per step out, oldest first
        self.num_steps = 0
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(include_dashboard=False, log_to_driver=False)
        world, tp, pp = (
            config.world_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        )
        use_gpu = (config.device or default_device()).startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        try:
            # One group a stage, on one node; without stages, one group packed where it fits.
            strategy = "STRICT_PACK" if pp > 1 else "PACK"
            for _ in range(pp):
                group = placement_group([dict(bundle)] * tp, strategy=strategy)
                self.placement_groups.append(group)
            try:
                ray.get(
                    [g.ready() for g in self.placement_groups], timeout=config.startup_timeout_s
                )
            except ray.exceptions.GetTimeoutError:
                raise ExecutorError(
                    f"Ray could not place {pp} stage(s) of {tp} workers of {bundle} "
                    f"({strategy}: a stage on one node) within {config.startup_timeout_s:.0f} s; "
                    f"the cluster has {ray.cluster_resources()}"
                ) from None
            actor_cls = ray.remote(RayWorker)
            for rank in range(world):
                self.actors.append(
                    actor_cls.options(
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.placement_groups[rank // tp],
                            placement_group_bundle_index=rank % tp,
                        ),
                        runtime_env={"env_vars": dict(config.worker_env)},
                    ).remote(config, rank, world)
                )
            nodes = self._get([a.node.remote() for a in self.actors], 300, "start-up")
            self.rank_nodes = {rank: node_id for rank, (node_id, _) in nodes.items()}
            ips = {rank: ip for rank, (_, ip) in nodes.items()}
            host = LOOPBACK if len(set(ips.values())) == 1 else ips[0]
            port = self._get([self.actors[0].free_port.remote(host)], 300, "start-up")[0]
            init_method = f"tcp://{host}:{port}"
            logger.info(
                "Ray workers on %s; process group at %s", sorted(set(ips.values())), init_method
            )
            infos = self._get(
                [a.start.remote(init_method) for a in self.actors],
                config.startup_timeout_s,
                "start-up",
            )
        except BaseException:
            self.shutdown()
            raise
        self.workers_info = [infos[r] for r in range(world)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.closed:
            raise ExecutorError("the executor is shut down (after a failure or shutdown())")
        ray = import_ray()
        ref = ray.put(scheduler_output)  # serialised once, read by every actor
        self._pending.append([a.call.remote("step", ref) for a in self.actors])

    def sample_tokens(self) -> ModelRunnerOutput:
        pending = self._pending.popleft()
        results = self._get(pending, self.config.step_timeout_s, "a step")
        self.num_steps += 1
        return results[self.output_rank]

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), ranks: Sequence[int] | None = None
    ) -> list[Any]:
        if self.closed:
            raise ExecutorError("the executor is shut down (after a failure or shutdown())")
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        refs = [self.actors[r].call.remote(method, *args) for r in ranks]
        results = self._get(refs, self.config.step_timeout_s, f"{method}()", ranks)
        return [results[r] for r in ranks]

    def _get(
        self, refs: list[Any], timeout: float, what: str, ranks: Sequence[int] | None = None
    ) -> dict[int, Any]:
        """Results by rank; the first failure (in completion order) fails the executor."""
        ray = import_ray()
        rank_of = dict(zip(refs, ranks if ranks is not None else range(len(refs)), strict=True))
        pending = list(refs)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = (
                ray.wait(pending, num_returns=1, timeout=remaining) if remaining > 0 else ([], [])
            )
            if not ready:
                missing = sorted(rank_of[r] for r in refs if rank_of[r] not in results)
                raise self._fail(
                    ExecutorError(
                        f"no reply from rank(s) {missing} within {timeout:.0f} s of {what}"
                    )
                )
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._fail(
                        WorkerDiedError(rank, f"its Ray actor died ({_first_line(e)})")
                    ) from None
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    summary = error_summary(cause) if cause is not None else _first_line(e)
                    raise self._fail(WorkerDiedError(rank, summary)) from None
        return results

    def _fail(self, error: Exception) -> Exception:
        logger.error("%s; stopping all %d workers", error, self.world_size)
        self.shutdown()
        return error

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        ray = import_ray()
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                pass
        for group in self.placement_groups:
            try:
                self._remove_pg(group)
            except Exception:
                pass
        if self.owns_ray:
            ray.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
