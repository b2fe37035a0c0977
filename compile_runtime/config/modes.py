"""The compilation and CUDA graph modes, and the policy that downgrades a requested graph mode.

``resolve_cudagraph_mode`` turns a *requested* CUDA graph mode into what can actually run
given how the model is compiled and what its attention backends support, and logs one
line for every downgrade.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

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
            "CUDA is not available: cudagraph_mode %s -> NONE (no CPU graphs either)",
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
