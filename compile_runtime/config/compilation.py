"""What the user sets about compiling: ``CompilationConfig`` and its parts.

Pydantic, unknown fields rejected, frozen once built: a changed value is a new config,
``config.replace(field=...)`` (validated again). ``CompilationConfig.resolve`` asks ``modes``
which of the requested CUDA graphs can run; ``parse_config`` reads the ``-O`` JSON string.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from compile_runtime.config.modes import (
    AttentionCGSupport,
    CompilationMode,
    CUDAGraphMode,
    ResolvedModes,
    resolve_cudagraph_mode,
)
from compile_runtime.platforms.cuda import CUDA


class FrozenConfigError(AttributeError):
    """A field of a frozen config assigned (or deleted) after construction."""


class _FrozenModel(BaseModel):
    """Frozen after construction: assigning a field raises ``FrozenConfigError``, which names
    the field and the way to a changed config (``CompilationConfig.replace``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # How to get a config with field {name} changed, for the error.
    _REPLACE_HINT: ClassVar[str] = "compilation_config.replace({name}=...)"

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenConfigError(f"{type(self).__name__}.{name}={value!r}: {self._frozen(name)}")

    def __delattr__(self, name: str) -> None:
        raise FrozenConfigError(f"{type(self).__name__}.{name}: {self._frozen(name)}")

    def _frozen(self, name: str) -> str:
        hint = self._REPLACE_HINT.format(name=name)
        return f"the config is frozen once built; build a changed one with {hint}"


class PassConfig(_FrozenModel):
    """One flag per graph pass (see passes/manager.py for the pipeline and its order).

    A fusion flag of None means "auto": on for graphs on CUDA, off elsewhere.
    On a CPU Inductor already fuses these patterns into its own C++ loops and
    an opaque fused op only gets in its way (measured in benchmarks/passes.py).
    ``enable_fusion=False`` turns every fusion off whatever its own flag says.
    """

    _REPLACE_HINT: ClassVar[str] = "compilation_config.replace(pass_config={{{name!r}: ...}})"

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

    from compile_runtime.torch_internals import inductor_options

    known = inductor_options()
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


class CompilationConfig(_FrozenModel):
    """What the user sets. Loads from a dict, JSON, or a ``-O`` JSON string.

    Frozen: every reader (the engine, each worker, the models built inside
    ``set_compilation_config``) sees the value it was built with; ``replace`` makes a
    changed one. Hashable (equal configs hash equal)."""

    mode: CompilationMode = CompilationMode.PIECEWISE
    backend: Literal["inductor", "eager"] = "inductor"
    splitting_ops: list[str] | None = None  # None = this package's attention ops
    compile_sizes: list[int] = Field(default_factory=list)
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    # None = default ladder; "auto:FILE[:K]" = K sizes planned from a recorded workload
    cudagraph_capture_sizes: list[int] | str | None = None
    max_cudagraph_capture_size: int | None = None  # None = largest capture size or 512
    cudagraph_num_warmups: int = Field(default=1, ge=0)
    # When graphs are captured: None = on first use for CPU graphs (a size's first step runs
    # unreplayed, its second is captured while it runs), at start-up for CUDA graphs.
    lazy_capture: bool | None = None
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
        {"cache_dir", "disable_cache", "debug_dump_path", "cudagraph_num_warmups", "lazy_capture"}
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

    # ---- a changed config ------------------------------------------------

    def replace(self, **changes: Any) -> CompilationConfig:
        """A new config: this one with ``changes``, every validator run again. The fields set
        stay set (``resolve`` tells an explicit ``cudagraph_mode`` from the default)."""
        data = self.model_dump(exclude_unset=True)
        data.update(changes)
        return type(self).model_validate(data)

    def model_copy(
        self, *, update: dict[str, Any] | None = None, deep: bool = False
    ) -> CompilationConfig:
        """pydantic's copy, except that an ``update`` is validated (``replace``)."""
        if update:
            return self.replace(**update)
        return super().model_copy(deep=deep)

    def __hash__(self) -> int:
        # repr for what JSON cannot hold (an Inductor option set to a pass object, say)
        dump = self.model_dump(mode="json", fallback=repr)
        return hash(json.dumps(dump, sort_keys=True))

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
        cpu_graphs: bool = False,
    ) -> ResolvedModes:
        """Effective modes for this machine and these attention backends.

        ``attention_split``: whether the traced graph really has splitting-op
        pieces; once the model is traced pass what its split produced
        (``compile_runtime.compiler.decorator.attention_split(model)``), since a
        ``splitting_ops`` entry can match nothing. None guesses from
        ``splitting_ops`` alone. ``cpu_graphs``: the model runs on a CPU that can replay
        CPU graphs (``compile_runtime/cpu/graph.py``), which then stand in for CUDA graphs.
        """
        if attention_split is None:
            attention_split = self.splitting_ops is None or len(self.splitting_ops) > 0
        if cuda_available is None:
            cuda_available = CUDA.available()
        mode = resolve_cudagraph_mode(
            self.cudagraph_mode,
            compilation_mode=self.mode,
            min_cg_support=min_cg_support,
            attention_split=attention_split,
            uniform_decode_query_len=uniform_decode_query_len,
            cuda_available=cuda_available or cpu_graphs,
            explicit="cudagraph_mode" in self.model_fields_set,
        )
        return ResolvedModes(compilation_mode=self.mode, cudagraph_mode=mode)


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
