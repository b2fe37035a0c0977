"""Configuration: what to compile, how, and which CUDA graphs to capture.

Everything a user sets lives in ``CompilationConfig`` (pydantic, unknown
fields rejected). ``CompilationConfig.resolve`` turns a *requested* CUDA graph
mode into what can actually run given the attention backends in use, and
logs one line for every downgrade.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

logger = logging.getLogger(__name__)


class CompilationMode(enum.IntEnum):
    """How the model is turned into code."""

    NONE = 0  # eager
    STOCK_TORCH_COMPILE = 1  # plain torch.compile, guards kept
    DYNAMO_TRACE_ONCE = 2  # one trace, guards dropped, no split
    PIECEWISE = 3  # one trace, split at attention, per-piece compile


class CUDAGraphMode(enum.Enum):
    """CUDA graph modes.

    ``NONE``, ``PIECEWISE`` and ``FULL`` are runtime modes: what one batch runs
    in. The two tuple modes are configuration modes: ``(decode, mixed)``.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True when decode batches and mixed batches use different modes."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        if mode.separate_routine():
            raise ValueError(
                f"has_mode() takes a runtime mode (NONE/PIECEWISE/FULL), not {mode.name}"
            )
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def requires_piecewise_compilation(self) -> bool:
        return self.has_piecewise_cudagraphs()

    def is_runtime_mode(self) -> bool:
        return not self.separate_routine()

    def valid_runtime_modes(self) -> frozenset[CUDAGraphMode]:
        """The runtime modes a batch may be dispatched to under this mode.

        NONE is always valid: batches larger than every captured size run
        without a graph.
        """
        return frozenset({CUDAGraphMode.NONE, self.decode_mode(), self.mixed_mode()})

    @classmethod
    def from_parts(cls, decode: CUDAGraphMode, mixed: CUDAGraphMode) -> CUDAGraphMode:
        """The configuration mode whose decode/mixed parts are the given runtime modes."""
        if decode == mixed:
            return decode
        for mode in cls:
            if mode.separate_routine() and (mode.decode_mode(), mode.mixed_mode()) == (
                decode,
                mixed,
            ):
                return mode
        raise ValueError(
            f"no CUDAGraphMode has decode={decode.name} and mixed={mixed.name}; "
            "use NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE"
        )


class AttentionCGSupport(enum.IntEnum):
    """How much of an attention backend can run inside a CUDA graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # pure decode batches, one query token each
    UNIFORM_BATCH = 2  # uniform batches, any query length
    ALWAYS = 3  # any batch, mixed prefill and decode included


class PassConfig(BaseModel):
    """One flag per graph pass (see passes/manager.py for the pipeline and its order).

    A fusion flag of None means "auto": on for graphs on CUDA, off elsewhere.
    On a CPU Inductor already fuses these patterns into its own C++ loops and
    an opaque fused op only gets in its way (measured in benchmarks/passes.py).
    ``enable_fusion=False`` turns every fusion off whatever its own flag says.
    """

    model_config = ConfigDict(extra="forbid")

    enable_noop_elimination: bool = True
    enable_fusion: bool = True
    enable_rms_norm_fusion: bool | None = None  # RMSNorm and residual add + RMSNorm
    enable_silu_mul_fusion: bool | None = None  # SwiGLU gate: silu(x[:d]) * x[d:]
    enable_rotary_fusion: bool | None = None  # Q and K rotary in one in-place op
    enable_post_cleanup: bool = True  # dead code left by replacements
    enable_fix_functionalization: bool = True  # in-place custom ops back in place; last


def _coerce_enum(enum_cls: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, str):
        try:
            return enum_cls[value.upper()]
        except KeyError:
            names = ", ".join(m.name for m in enum_cls)
            raise ValueError(
                f"unknown {enum_cls.__name__} {value!r}; expected one of {names}"
            ) from None
    return value


def check_inductor_options(options: dict[str, Any]) -> None:
    """Every key must be an option of ``torch._inductor.config`` (dotted, e.g. "triton.cudagraphs")."""
    import difflib

    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if key in known:
            continue
        members = sorted(k for k in known if k.startswith(f"{key}."))
        close = difflib.get_close_matches(key, known, n=3)
        if members:
            hint = f"set its options one by one with dotted keys, e.g. {members[0]!r}"
        elif close:
            hint = f"did you mean {' or '.join(map(repr, close))}?"
        else:
            hint = "see torch._inductor.config for the options"
        raise ValueError(f"{key!r} is not an Inductor option; {hint}")


AUTO_PREFIX = "auto:"


@dataclass(frozen=True)
class AutoSpec:
    """``cudagraph_capture_sizes="auto:FILE[:K]"``: plan K sizes from a workload file at start-up."""

    path: str
    max_graphs: int | None  # None: as many as the default ladder needs


def parse_auto_spec(spec: str) -> AutoSpec:
    """``"auto:FILE"`` or ``"auto:FILE:K"``; anything else is an error that shows the forms."""
    forms = (
        "use a list of sizes, or 'auto:FILE' / 'auto:FILE:K' to plan K sizes from a workload "
        "file (compile-runtime generate --record-workload FILE)"
    )
    if not spec.startswith(AUTO_PREFIX):
        raise ValueError(f"cudagraph_capture_sizes={spec!r} is not understood; {forms}")
    rest = spec[len(AUTO_PREFIX) :]
    path, k = rest, None
    head, sep, tail = rest.rpartition(":")
    if sep and tail.strip().lstrip("+-").isdigit():
        path, k = head, int(tail)
        if k < 1:
            raise ValueError(f"cudagraph_capture_sizes={spec!r}: K must be >= 1, got {k}; {forms}")
    if not path:
        raise ValueError(f"cudagraph_capture_sizes={spec!r} names no file; {forms}")
    return AutoSpec(path, k)


class CompilationConfig(BaseModel):
    """What the user sets. Loads from a dict, JSON, or a ``-O`` JSON string."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: CompilationMode = CompilationMode.PIECEWISE
    backend: Literal["inductor", "eager"] = "inductor"
    splitting_ops: list[str] | None = None  # None = this package's attention ops
    compile_sizes: list[int] = Field(default_factory=list)
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    # None = default ladder; "auto:FILE[:K]" = K sizes planned from a recorded workload
    cudagraph_capture_sizes: list[int] | str | None = None
    max_cudagraph_capture_size: int | None = None  # None = largest capture size or 512
    cudagraph_num_warmups: int = Field(default=1, ge=0)
    cache_dir: str | None = None
    disable_cache: bool = False
    pass_config: PassConfig = Field(default_factory=PassConfig)
    inductor_compile_config: dict[str, Any] = Field(default_factory=dict)
    # Compile structurally identical pieces (every layer) once and share the code.
    dedupe_pieces: bool = True
    debug_dump_path: str | None = None

    # Fields that never change compiled code. Everything else is hashed, so a
    # new field is part of the cache key unless someone adds it here.
    HASH_EXCLUDED_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"cache_dir", "disable_cache", "debug_dump_path", "cudagraph_num_warmups"}
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_by_name(cls, v: Any) -> Any:
        return _coerce_enum(CompilationMode, v)

    @field_validator("cudagraph_mode", mode="before")
    @classmethod
    def _cg_mode_by_name(cls, v: Any) -> Any:
        return _coerce_enum(CUDAGraphMode, v)

    @field_serializer("mode", "cudagraph_mode")
    def _enum_by_name(self, v: enum.Enum) -> str:
        return v.name

    @field_validator("compile_sizes", "cudagraph_capture_sizes")
    @classmethod
    def _positive_sorted_unique(cls, v: list[int] | str | None) -> list[int] | str | None:
        if v is None:
            return v
        if isinstance(v, str):  # "auto:FILE[:K]", planned when the dispatcher is built
            parse_auto_spec(v)
            return v
        for size in v:
            if size <= 0:
                raise ValueError(f"size {size} is not positive; sizes are token counts >= 1")
        return sorted(set(v))

    @field_validator("max_cudagraph_capture_size")
    @classmethod
    def _positive_max(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"max_cudagraph_capture_size {v} is not positive")
        return v

    @field_validator("inductor_compile_config")
    @classmethod
    def _known_inductor_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        """Reject a misspelt option here, not deep inside the first compile."""
        if v:
            check_inductor_options(v)
        return v

    @model_validator(mode="after")
    def _sizes_agree_with_max(self) -> CompilationConfig:
        sizes, max_size = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if isinstance(sizes, list) and sizes and max_size is not None and max(sizes) != max_size:
            raise ValueError(
                f"cudagraph_capture_sizes ends at {max(sizes)} but max_cudagraph_capture_size is "
                f"{max_size}; set only one of them, or make them agree"
            )
        return self

    # ---- derived values -------------------------------------------------

    def compute_hash(self) -> str:
        """Stable hash over every field that changes compiled code."""
        data = self.model_dump(mode="json", exclude=set(self.HASH_EXCLUDED_FIELDS))
        blob = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2)

    # ---- resolution against attention support ----------------------------

    def resolve(
        self,
        min_cg_support: AttentionCGSupport,
        *,
        attention_split: bool | None = None,
        uniform_decode_query_len: int = 1,
        cuda_available: bool | None = None,
    ) -> ResolvedModes:
        """Effective modes for this machine and these attention backends.

        ``attention_split``: whether the traced graph really has splitting-op
        pieces; once the model is traced pass what its split produced
        (``compile_runtime.compiler.decorator.attention_split(model)``), since a
        ``splitting_ops`` entry can match nothing. None guesses from
        ``splitting_ops`` alone.
        """
        if attention_split is None:
            attention_split = self.splitting_ops is None or len(self.splitting_ops) > 0
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        mode = resolve_cudagraph_mode(
            self.cudagraph_mode,
            compilation_mode=self.mode,
            min_cg_support=min_cg_support,
            attention_split=attention_split,
            uniform_decode_query_len=uniform_decode_query_len,
            cuda_available=cuda_available,
            explicit="cudagraph_mode" in self.model_fields_set,
        )
        return ResolvedModes(compilation_mode=self.mode, cudagraph_mode=mode)


@dataclass(frozen=True)
class ResolvedModes:
    compilation_mode: CompilationMode
    cudagraph_mode: CUDAGraphMode

    @property
    def decode_mode(self) -> CUDAGraphMode:
        return self.cudagraph_mode.decode_mode()

    @property
    def mixed_mode(self) -> CUDAGraphMode:
        return self.cudagraph_mode.mixed_mode()


class CudagraphModeError(ValueError):
    """A CUDA graph mode was asked for explicitly and nothing of it can run."""


def resolve_cudagraph_mode(
    requested: CUDAGraphMode,
    *,
    compilation_mode: CompilationMode,
    min_cg_support: AttentionCGSupport,
    attention_split: bool,
    uniform_decode_query_len: int = 1,
    cuda_available: bool = True,
    explicit: bool = False,
) -> CUDAGraphMode:
    """Downgrade ``requested`` until every part of it can run.

    Each downgrade logs one line. If the user asked for graphs explicitly and
    none survive (for a reason other than a missing GPU), that is an error
    naming what to set instead.
    """
    if uniform_decode_query_len < 1:
        raise ValueError(f"uniform_decode_query_len must be >= 1, got {uniform_decode_query_len}")
    if requested == CUDAGraphMode.NONE:
        return requested
    if not cuda_available:
        logger.log(
            logging.WARNING if explicit else logging.INFO,
            "CUDA is not available: cudagraph_mode %s -> NONE",
            requested.name,
        )
        return CUDAGraphMode.NONE

    mode = requested
    reasons: list[str] = []

    def downgrade(new: CUDAGraphMode, why: str) -> None:
        nonlocal mode
        if new != mode:
            # The default mode is downgraded routinely; an explicit request the user must see.
            logger.log(
                logging.WARNING if explicit else logging.INFO,
                "cudagraph_mode %s -> %s: %s",
                mode.name,
                new.name,
                why,
            )
            reasons.append(why)
            mode = new

    piecewise_compiled = compilation_mode == CompilationMode.PIECEWISE
    if not piecewise_compiled and mode.has_piecewise_cudagraphs():
        downgrade(
            CUDAGraphMode.FULL,
            f"piecewise graphs need CompilationMode.PIECEWISE (mode is {compilation_mode.name})",
        )
    if piecewise_compiled and not attention_split:
        no_split = (
            "the graph has no splitting-op pieces (splitting_ops=[], or none of them is in "
            "the graph), so a piecewise graph would capture attention"
        )
        if mode == CUDAGraphMode.PIECEWISE:
            downgrade(CUDAGraphMode.NONE, no_split)
        elif mode == CUDAGraphMode.FULL_AND_PIECEWISE:
            downgrade(CUDAGraphMode.FULL, no_split)
    can_piecewise = piecewise_compiled and attention_split

    if mode.mixed_mode() == CUDAGraphMode.FULL and min_cg_support < AttentionCGSupport.ALWAYS:
        fallback = (
            CUDAGraphMode.FULL_AND_PIECEWISE if can_piecewise else CUDAGraphMode.FULL_DECODE_ONLY
        )
        downgrade(
            fallback,
            f"FULL graphs of mixed batches need attention support ALWAYS, have {min_cg_support.name}",
        )

    needed = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        if uniform_decode_query_len == 1
        else AttentionCGSupport.UNIFORM_BATCH
    )
    if mode.decode_mode() == CUDAGraphMode.FULL and min_cg_support < needed:
        fallback = CUDAGraphMode.PIECEWISE if can_piecewise else CUDAGraphMode.NONE
        downgrade(
            fallback,
            f"FULL graphs of decode batches (query length {uniform_decode_query_len}) need attention "
            f"support {needed.name}, have {min_cg_support.name}",
        )

    if explicit and mode == CUDAGraphMode.NONE:
        raise CudagraphModeError(
            f"cudagraph_mode={requested.name} was requested but no graph can run: "
            + "; ".join(reasons)
            + ". Set cudagraph_mode='NONE', use CompilationMode.PIECEWISE with attention split "
            "out (splitting_ops=None) for piecewise graphs, or pick an attention backend with "
            "higher AttentionCGSupport for FULL graphs."
        )
    return mode


_active_config: list[CompilationConfig] = []


@contextlib.contextmanager
def set_compilation_config(config: CompilationConfig) -> Iterator[CompilationConfig]:
    """Models constructed inside this block use ``config``."""
    if not isinstance(config, CompilationConfig):
        raise TypeError(
            f"set_compilation_config expects a CompilationConfig, got {type(config).__name__}"
        )
    _active_config.append(config)
    try:
        yield config
    finally:
        _active_config.pop()


def get_compilation_config() -> CompilationConfig:
    """The active config, or the defaults when none is set."""
    return _active_config[-1] if _active_config else CompilationConfig()


def parse_config(
    text_or_dict: str | dict[str, Any] | CompilationConfig | None,
) -> CompilationConfig:
    """A config from a JSON string (``-O``), a dict, or a config (returned as is)."""
    if text_or_dict is None:
        return CompilationConfig()
    if isinstance(text_or_dict, CompilationConfig):
        return text_or_dict
    if isinstance(text_or_dict, str):
        try:
            text_or_dict = json.loads(text_or_dict)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"compilation config is not valid JSON ({e}): {text_or_dict!r}"
            ) from None
    return CompilationConfig.model_validate(text_or_dict)


# ---- the engine's configs: the runner's sizes, and what a worker needs to build its runner


class ConfigError(ValueError):
    """A configuration value no engine can run with: one line per bad field, each with the fix."""


class CheckedConfig(BaseModel):
    """Base of the engine's configs: unknown fields are rejected and every validation error
    becomes one ``ConfigError`` line, ``Class.field=value: what is wrong (what the field is)``,
    both at construction and on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(self._one_line_per_field(e)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise ConfigError(self._one_line_per_field(e)) from None

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
    # full width; runner/kv_sizing.py fills what is None from the model and the machine.
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
    # count, one more copy of the weights in memory); see compile_runtime/ops/cpu_linear.py.
    cpu_pack_weights: bool = True
    # CPU: torch/OpenMP threads of this process; None = free cores (runner/cpu_threads.py).
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads of each rank; None uses the free cores"
    )

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
    """Everything a worker needs to build its runner (plain data: it travels to workers)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_dir: str
    compilation_config: CompilationConfig
    runner_config: RunnerConfig
    dtype: torch.dtype = torch.float32
    device: str | None = None  # None: CUDA when available, else CPU
    use_transformers: bool = False
    tensor_parallel_size: int = Field(1, ge=1, description="ranks the model is split over")
    # Seconds a step may take before the driver gives up on a silent (hung) worker.
    step_timeout_s: float = Field(600.0, gt=0, description="seconds one step may take")
    # Seconds start-up (load, compile, capture) may take on any rank.
    startup_timeout_s: float = Field(1800.0, gt=0, description="seconds start-up may take")
    # Environment variables set in every worker (Ray workers do not inherit the driver's).
    worker_env: dict[str, str] = Field(default_factory=dict)

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
