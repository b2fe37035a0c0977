"""Triton paged attention: one kernel for mixed batches, so FULL graphs for every batch.

The cache write (torch ``index_copy_``) and the kernel launch both have shapes
fixed by the padded token count and read the step's metadata from fixed
addresses, so the whole op can be captured once per size and replayed for
any mix of prefills and decodes (support ALWAYS). On CPU tensors the kernel
runs in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
triton was imported, which is how the tests check it against
``torch_native`` without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from compile_runtime.attention.backend import AttentionBackend, AttentionImpl
from compile_runtime.attention.metadata import AttentionMetadata
from compile_runtime.config import AttentionCGSupport


class TritonImpl(AttentionImpl):
    def compute(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        output: torch.Tensor,
    ) -> int:
        """Every row, the padding rows as zeros: the kernel finds the real token count on the
        device, so a captured launch serves any count."""
        from compile_runtime.backends.attention.triton_kernel import paged_attention

        if metadata.num_reqs_padded == 0:  # nothing but padding (a dummy step)
            return 0
        paged_attention(
            query,
            kv_cache,
            output,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            self.spec.scale,
            self.spec.sliding_window,
            self.spec.logits_soft_cap,
        )
        return query.shape[0]


class TritonBackend(AttentionBackend):
    name = "triton"
    cg_support = AttentionCGSupport.ALWAYS
    supported_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    # "cpu" runs the kernel in Triton's interpreter: correct but slow, for tests.
    supported_devices = frozenset({"cuda", "cpu"})
    impl_cls = TritonImpl

    @classmethod
    def missing_dependency(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "needs Triton: pip install triton (CUDA builds of torch ship with it)"
        return None

    @classmethod
    def unsupported_reason(cls, device=None, dtype=None, head_size=None) -> str | None:
        reason = super().unsupported_reason(device, dtype, head_size)
        if reason is None and device is not None and torch.device(device).type == "cpu":
            if not interpreter_enabled():
                return (
                    "runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 before "
                    "triton is imported (slow; meant for tests)"
                )
        return reason


def interpreter_enabled() -> bool:
    """Whether Triton kernels run interpreted (read the way Triton reads it, without importing it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
