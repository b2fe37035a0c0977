"""The engine's configs: the runner's sizes, speculative decoding, and what a worker needs to
build its runner. Every bad field becomes one ``ConfigError`` line that says the fix."""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from compile_runtime.config.compilation import CompilationConfig


class ConfigError(ValueError):
    """A configuration value no engine can run with: one line per bad field, each with the fix."""


class CheckedConfig(BaseModel):
    """Base of the engine's configs: unknown fields are rejected and every validation error
    becomes one ``ConfigError`` line, ``Class.field=value: what is wrong (what the field is)``,
    at construction. A config is decided once, in the driver, and frozen: every rank gets the
    same value, and a changed size is a new config (``model_copy(update=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(self._one_line_per_field(e)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(
            f"{type(self).__name__}.{name}={value!r}: the configuration is frozen once built; "
            f"pass {name} when building it (or model_copy(update={{{name!r}: ...}}))"
        )

    @classmethod
    def _one_line_per_field(cls, error: ValidationError) -> str:
        lines = []
        for err in error.errors():
            name = ".".join(str(part) for part in err["loc"])
            field = cls.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            if err["type"] == "extra_forbidden":
                lines.append(
                    f"{cls.__name__}.{name}: unknown field; the fields are "
                    f"{', '.join(cls.model_fields)}"
                )
                continue
            message = err["msg"].removeprefix("Value error, ")
            hint = f" ({field.description})" if field is not None and field.description else ""
            lines.append(f"{cls.__name__}.{name}={err['input']!r}: {message}{hint}")
        return "\n".join(lines)


class SpeculativeConfig(CheckedConfig):
    """Speculative decoding: draft tokens proposed without a second model, verified in one step.

    ``method="ngram"`` (prompt lookup): the drafts are the tokens that followed
    the most recent earlier occurrence of a request's last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own prompt and output.
    """

    method: Literal["ngram"] = Field(
        description="how drafts are proposed; 'ngram' is the one method so far"
    )
    num_speculative_tokens: int = Field(
        ge=1, description="draft tokens proposed per request and step, e.g. 4"
    )
    prompt_lookup_min: int = Field(2, ge=1, description="shortest n-gram matched, e.g. 2")
    prompt_lookup_max: int = Field(4, ge=1, description="longest n-gram matched, e.g. 4")

    @model_validator(mode="after")
    def _min_at_most_max(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} is larger than "
                f"prompt_lookup_max={self.prompt_lookup_max}; make min <= max"
            )
        return self


class RunnerConfig(CheckedConfig):
    """Sizes of the runner's batch and KV cache (the same on every rank)."""

    # Defaults chosen on the real model (SmolLM2-135M, 2 CPU cores, the mixed workload of
    # benchmarks/vs_vllm.py): enough requests and tokens per step that a CPU's GEMMs run at
    # full width; worker/kv_sizing.py fills what is None from the model and the machine.
    max_num_seqs: int = Field(256, ge=1, description="requests in one step, e.g. 256")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens in one step (prefill chunks + decodes), e.g. 2048"
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="prompt + output tokens of one request; None: the model's "
        "max_position_embeddings, capped by what the KV cache holds",
    )
    block_size: int = Field(16, ge=1, description="tokens per KV cache block, e.g. 16")
    # CPU: the KV cache's byte budget (None: kv_cache_memory_fraction of the available RAM).
    # CUDA: gpu_memory_utilization decides.
    kv_cache_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes of KV cache on a CPU, e.g. 2 GiB = 2147483648; None: "
        "kv_cache_memory_fraction of the available RAM",
    )
    kv_cache_memory_fraction: float = Field(
        0.2,
        gt=0.0,
        le=0.9,
        description="CPU: fraction of the available RAM the KV cache takes when "
        "kv_cache_bytes is None, e.g. 0.2",
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="fraction of GPU memory this engine may use, e.g. 0.85"
    )
    num_gpu_blocks_override: int | None = Field(
        None, ge=2, description="KV cache blocks, block 0 reserved; None sizes the cache"
    )
    enable_prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of prompt prefixes computed before (automatic "
        "prefix caching); False computes every prompt from scratch",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4}',
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:
        """A JSON string (the CLI's ``--speculative-config``) reads as the dict it holds."""
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e}): {v!r}") from None
        return v

    # CPU: keep a copy of each linear weight packed for oneDNN (faster GEMMs at every row
    # count, one more copy of the weights in memory); see compile_runtime/cpu/linear.py.
    cpu_pack_weights: bool = True
    # CPU: each float linear weight shape runs the kernel measured fastest on this CPU per
    # row count (measured at the first start, cached; compile_runtime/cpu/kernel_tuning.py).
    cpu_tune_kernels: bool = True
    # Weights kept quantized (CPU, native models; compile_runtime/ops/cpu_quant_*.py).
    quantization: Literal["auto", "gguf", "none", "int8"] = Field(
        "auto",
        description="'auto': a GGUF file's Q8_0/Q4_0/Q4_1 weights stay quantized ('gguf'), a "
        "float checkpoint stays float ('none'); 'int8': a float checkpoint's linear weights "
        "quantized to int8 per block of 32 (Q8_0); 'none' dequantizes a GGUF file",
    )
    enable_microbatching: bool = Field(
        False,
        description="split a step of several requests into two micro-batches, each with its "
        "own attention metadata (on a CPU: correctness, not speed)",
    )
    microbatching_token_threshold: int = Field(
        32, ge=2, description="fewest tokens in a step that is split into micro-batches"
    )
    # LoRA adapters (compile_runtime/lora/): vLLM's names and defaults.
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (requests name theirs with a LoRARequest)"
    )
    max_loras: int = Field(1, ge=1, description="distinct adapters in one step (slots), e.g. 4")
    max_lora_rank: int = Field(16, ge=1, description="largest adapter rank accepted, e.g. 64")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept read in memory; None: max_loras"
    )
    # CPU: torch/OpenMP threads of this process; None = free cores (compile_runtime/cpu/threads.py).
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads of each rank; None uses the free cores"
    )

    @property
    def max_num_tokens(self) -> int:
        """Tokens in the largest step: no step holds more than max_num_seqs full-length
        requests."""
        self.check_decided(on_cpu=False)
        return min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)

    def check_decided(self, on_cpu: bool) -> None:
        """Every size a runner reads is decided: by ``decide_engine_config`` (or, for a runner
        built alone, ``worker/kv_sizing.size_runner_config``); a runner decides none."""
        undecided = ["max_model_len"] if self.max_model_len is None else []
        undecided += ["kv_cache_bytes"] if on_cpu and self.kv_cache_bytes is None else []
        if undecided:
            raise ConfigError(
                f"RunnerConfig.{' and '.join(undecided)} left to the engine (None): size the "
                "config with decide_engine_config or worker/kv_sizing.size_runner_config "
                "before a runner gets it"
            )

    @model_validator(mode="after")
    def _cpu_loras_hold_the_slots(self) -> RunnerConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}; "
                "keep at least as many adapters in memory as there are slots"
            )
        return self

    def check_model(self, hf_config: Any, model_dir: str) -> None:
        """Reject a max_model_len past the positions the model has (its rotary table ends there)."""
        max_positions = getattr(hf_config, "max_position_embeddings", None)
        if (
            max_positions is not None
            and self.max_model_len is not None
            and self.max_model_len > max_positions
        ):
            raise ConfigError(
                f"RunnerConfig.max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={max_positions} ({model_dir}/config.json); set "
                f"max_model_len (--max-model-len) to at most {max_positions}, or leave it unset"
            )


ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class EngineConfig(CheckedConfig):
    """Everything a worker needs to build its runner (plain data: it travels to workers),
    the model's config included: read once by the engine, no worker reads it again."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_dir: str
    compilation_config: CompilationConfig
    runner_config: RunnerConfig
    dtype: torch.dtype = torch.float32
    device: str | None = None  # None: CUDA when available, else CPU
    use_transformers: bool = False
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="stages the layers are split into, each on tensor_parallel_size ranks"
    )
    pipeline_layer_partition: tuple[int, ...] | None = Field(
        None, description="layers per pipeline stage, e.g. (16, 14); None: an even split"
    )
    data_parallel_size: int = Field(
        1, ge=1, description="engines, each a whole copy of the model, sharing the requests"
    )
    data_parallel_lockstep: bool = Field(
        False,
        description="data-parallel engines agree each step on the padded token count, the "
        "uniform-decode flag and micro-batching before they run it",
    )
    # Seconds a step may take before the driver gives up on a silent (hung) worker.
    step_timeout_s: float = Field(600.0, gt=0, description="seconds one step may take")
    # Seconds start-up (load, compile, capture) may take on any rank.
    startup_timeout_s: float = Field(1800.0, gt=0, description="seconds start-up may take")
    # Environment variables set in every worker (Ray workers do not inherit the driver's).
    worker_env: dict[str, str] = Field(default_factory=dict)
    # The graph sizes every rank captures, decided by the engine from compilation_config,
    # the device and the runner's tokens per step (planner/capture_sizes.py); None: the
    # runner takes compilation_config's as they are.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # The model's transformers config (models/registry.py:read_hf_config), as the engine read
    # it; None: the worker reads it. Not part of equality, repr or a dump.
    hf_config: Any = Field(None, exclude=True, repr=False)

    def _compared(self) -> tuple:
        return tuple(getattr(self, f) for f in type(self).model_fields if f != "hf_config")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineConfig):
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    @property
    def world_size(self) -> int:
        """Ranks of one engine: every pipeline stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @field_validator("dtype")
    @classmethod
    def _float_dtype(cls, v: torch.dtype) -> torch.dtype:
        if v not in ENGINE_DTYPES:
            raise ValueError(f"dtype {v} is not one of {', '.join(map(str, ENGINE_DTYPES))}")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            kind = torch.device(v).type
        except RuntimeError:  # not a device string at all
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {v!r}; use 'cpu', 'cuda' or 'cuda:N', or None")
        return v
