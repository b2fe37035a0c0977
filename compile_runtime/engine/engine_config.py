"""The engine's configuration, decided once in the driver: option names checked, the device,
the dtype, the KV cache and length sizes, the CPU thread count and the environment every
worker gets, the graph sizes, with the model's config (read once, here), into one frozen
``EngineConfig`` that every rank receives as it is: no worker decides a size again (only the
KV cache's block count, measured after the weights load).
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch

from compile_runtime.config import (
    CompilationConfig,
    ConfigError,
    EngineConfig,
    RunnerConfig,
    parse_config,
)
from compile_runtime.cpu.graph import asks_for_cpu_graphs
from compile_runtime.cpu.threads import choose_num_threads
from compile_runtime.device import default_device
from compile_runtime.models.dtype import resolve_dtype
from compile_runtime.models.gguf import gguf_file_in, model_directory
from compile_runtime.models.registry import read_hf_config
from compile_runtime.planner.capture_sizes import decide_capture_sizes
from compile_runtime.platforms.select import platform_for
from compile_runtime.torch_internals import check_torch_version
from compile_runtime.worker.kv_sizing import size_runner_config

# EngineConfig fields decided here, not options a user passes.
_DECIDED_HERE = {
    "model_dir",
    "compilation_config",
    "runner_config",
    "dtype",
    "worker_env",
    "hf_config",
    "cudagraph_capture_sizes",
}
# Environment variables every worker gets (Ray workers do not inherit the driver's).
FORWARDED_ENV_PREFIXES = ("COMPILE_RUNTIME_", "TORCHINDUCTOR_", "TRITON_")


def _check_option_names(options: dict[str, Any]) -> None:
    """An unknown keyword is a typo: name it, with the closest options, before anything starts."""
    known = (set(RunnerConfig.model_fields) | set(EngineConfig.model_fields)) - _DECIDED_HERE
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"LLM({name}=...): unknown option; {hint}the options are {sorted(known)}"
            )


def decide_engine_config(
    model: str,
    compilation_config: CompilationConfig | dict | str | None,
    dtype: str | torch.dtype,
    options: dict[str, Any],
) -> EngineConfig:
    """The frozen engine configuration for ``LLM(model, compilation_config, dtype=...,
    **options)``, the model's config in it (read once here: no worker reads it again)."""
    check_torch_version()  # before anything of torch's internals runs (once per process)
    model_dir = model_directory(model)
    _check_option_names(options)
    options = dict(options)
    runner_options = {k: options.pop(k) for k in list(options) if k in RunnerConfig.model_fields}
    device = options.pop("device", None) or default_device()  # one device for every worker
    hf_config = read_hf_config(model_dir)
    resolved_dtype = resolve_dtype(
        dtype, hf_config, device, quantized=gguf_file_in(model_dir) is not None
    )
    config = EngineConfig(
        model_dir=model_dir,
        compilation_config=parse_config(compilation_config),
        runner_config=RunnerConfig(**runner_options),
        dtype=resolved_dtype,
        device=device,
        worker_env={k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)},
        hf_config=hf_config,
        **options,
    )
    # Decided before any worker starts: starting workers would count each other as busy cores,
    # and every rank must get the same sizes.
    tp_size, dp_size = config.tensor_parallel_size, config.data_parallel_size
    ranks = config.world_size * dp_size  # processes sharing this machine's cores and RAM
    runner_config = choose_num_threads(config.runner_config, device, ranks)
    if dp_size > 1:  # each engine its share of the RAM the KV caches may take
        share = config.runner_config.kv_cache_memory_fraction / dp_size
        runner_config = runner_config.model_copy(update={"kv_cache_memory_fraction": share})
    runner_config = size_runner_config(
        runner_config, hf_config, resolved_dtype, device, tp_size, config.pipeline_parallel_size
    )
    # The graph sizes too: an "auto:FILE" spec read here once, not on every rank.
    compilation = config.compilation_config
    cpu_graphs = platform_for(device).graph_kind == "cpu" and asks_for_cpu_graphs(compilation)
    capture_sizes = decide_capture_sizes(
        compilation, runner_config.max_num_tokens, cpu_graphs=cpu_graphs
    )
    return config.model_copy(
        update={"runner_config": runner_config, "cudagraph_capture_sizes": capture_sizes}
    )
