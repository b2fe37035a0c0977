"""JIT-build the FlashInfer kernels the ~33M benchmark model needs, and nothing else.

The model of ``benchmarks/llama_33m.py`` (head dim, query and KV heads), the engine's KV
block size as FlashInfer's page size, in ``--dtype``: the decode kernel (what a FULL decode
graph replays; with tensor cores where the engine's builder uses them, four or more query
heads per KV head) and the paged prefill kernel (the engine's prefill and mixed steps).
Each is planned and run once on a tiny batch, which is what builds it; the seconds each
took are printed as they finish, so a run stopped at its time limit still says how far it
got. ``FLASHINFER_WORKSPACE_BASE`` decides where the built modules are cached; later runs
in the same process tree load them from there.

    python scripts/flashinfer_prebuild.py [--dtype bfloat16] [--modules decode prefill]
        [--dry-run]

Without CUDA (or with ``--dry-run``) it prints what it would build and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKSPACE_BYTES = 128 * 1024 * 1024  # as the engine's FlashInfer builder


def model_shape() -> dict[str, int]:
    """Head dim, query heads and KV heads of the benchmark model."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from llama_33m import MODEL

    heads = MODEL["num_attention_heads"]
    return {
        "num_heads": heads,
        "num_kv_heads": MODEL["num_key_value_heads"],
        "head_dim": MODEL.get("head_dim", MODEL["hidden_size"] // heads),
    }


def block_size() -> int:
    """The engine's default KV block size (FlashInfer's page size)."""
    try:
        from compile_runtime.config import RunnerConfig

        return int(RunnerConfig.model_fields["block_size"].default)
    except Exception:  # an engine config laid out otherwise: its documented default
        return 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--modules", nargs="+", default=["decode", "prefill"])
    p.add_argument("--block-size", type=int, default=None, help="default: the engine's")
    p.add_argument("--dry-run", action="store_true", help="print the plan, build nothing")
    args = p.parse_args(argv)
    for name in args.modules:
        if name not in ("decode", "prefill"):
            p.error(f"--modules: decode or prefill, not {name}")
    return args


def build(name: str, flashinfer, shape: dict[str, int], page: int, dtype, tensor_cores: bool):
    import torch

    heads, kv_heads, dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    cache = torch.randn(2, 2, page, kv_heads, dim, dtype=dtype, device="cuda")
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    indices = torch.tensor([1], dtype=torch.int32, device="cuda")
    common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=dim**-0.5)
    if name == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores
        )
        last = torch.tensor([3], dtype=torch.int32)
        wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page, **common)
        query = torch.randn(1, heads, dim, dtype=dtype, device="cuda")
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        qo_indptr = torch.tensor([0, 3], dtype=torch.int32)
        last = torch.tensor([3], dtype=torch.int32)
        wrapper.plan(
            qo_indptr, indptr, indices, last, heads, kv_heads, dim, page, causal=True, **common
        )
        query = torch.randn(3, heads, dim, dtype=dtype, device="cuda")
    out = wrapper.run(query, (cache[0], cache[1]))
    torch.cuda.synchronize()
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"FlashInfer's {name} kernel gave non-finite values")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = model_shape()
    page = args.block_size or block_size()
    tensor_cores = shape["num_heads"] // shape["num_kv_heads"] >= 4  # as the engine's builder
    print(
        f"FlashInfer JIT: {' + '.join(args.modules)}, head dim {shape['head_dim']}, "
        f"{shape['num_heads']} query / {shape['num_kv_heads']} KV heads, {args.dtype}, "
        f"page size {page}, decode tensor cores {'yes' if tensor_cores else 'no'}",
        flush=True,
    )
    import torch

    if args.dry_run or not torch.cuda.is_available():
        print("dry run: nothing built" if args.dry_run else "no CUDA here: nothing built")
        return 0
    start = time.perf_counter()
    import flashinfer

    print(
        f"flashinfer {flashinfer.__version__} imported in {time.perf_counter() - start:.1f}s; "
        f"device {torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))})",
        flush=True,
    )
    dtype = getattr(torch, args.dtype)
    for name in args.modules:
        start = time.perf_counter()
        build(name, flashinfer, shape, page, dtype, tensor_cores)
        print(f"built {name} in {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
