"""Decode latency of each attention backend: eager vs inside a CUDA graph.

One measurement is one attention op of one layer on a pure-decode batch
(``batch_size`` requests, each with ``context`` tokens in the paged cache,
one of them new): the cache write plus the attention kernel, exactly what the
custom op runs. ``eager`` launches it from Python every call; ``graph``
captures it once (for backends whose CUDA graph support covers decode
batches) and replays. ``build_ms`` is the per-step metadata build (FlashInfer
plans there), paid once per step for all layers.

    python benchmarks/attention.py [--backends triton flashinfer torch_native]
        [--batch-sizes 1 8 64] [--context 1024] [--dtype bfloat16]
        [--out benchmarks/results/attention.json]

Results are written to JSON after every measurement, so a run cut short
still leaves what it measured (stopped by SIGTERM, it prints the table of what it
measured, marks the JSON ``"stopped"`` and exits 124). Backends that cannot run here are recorded
with the reason. Without CUDA only ``eager`` runs (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from compile_runtime.backends.attention import load_backend

from compile_runtime.attention.kv_cache import kv_cache_shape
from compile_runtime.attention.spec import AttentionSpec
from compile_runtime.config import AttentionCGSupport

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
logger = logging.getLogger("benchmarks.attention")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer", "torch_native"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--context", type=int, default=1024, help="tokens per request, new one included")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--iters", type=int, default=100, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention.json"))
    return p.parse_args(argv)


def decode_step(args: argparse.Namespace, batch_size: int, device: torch.device) -> dict[str, Any]:
    """Tensors of one decode step: every request's blocks are distinct, the null block unused."""
    dtype, bs = DTYPES[args.dtype], args.block_size
    blocks_per_req = -(-args.context // bs)
    num_blocks = 1 + batch_size * blocks_per_req
    cache = torch.randn(
        kv_cache_shape(num_blocks, bs, args.num_kv_heads, args.head_size),
        dtype=dtype,
        device=device,
    )
    table = (1 + torch.randperm(num_blocks - 1)).view(batch_size, blocks_per_req).to(torch.int32)
    last = args.context - 1
    slots = table[:, last // bs].long() * bs + last % bs
    return {
        "query": torch.randn(
            batch_size, args.num_heads, args.head_size, dtype=dtype, device=device
        ),
        "key": torch.randn(
            batch_size, args.num_kv_heads, args.head_size, dtype=dtype, device=device
        ),
        "value": torch.randn(
            batch_size, args.num_kv_heads, args.head_size, dtype=dtype, device=device
        ),
        "cache": cache,
        "table": table.to(device),
        "slots": slots.to(device),
        "qsl": torch.arange(batch_size + 1, dtype=torch.int32),
        "seq_lens": torch.full((batch_size,), args.context, dtype=torch.int32),
    }


def time_ms(fn: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def measure(args: argparse.Namespace, name: str, batch_size: int) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    base = {"backend": name, "batch_size": batch_size, "context": args.context}
    backend = load_backend(name)
    reason = backend.unsupported_reason(device, dtype, args.head_size)
    if reason:
        return [{**base, "skipped": reason}]
    spec = AttentionSpec(
        args.num_heads, args.num_kv_heads, args.head_size, args.head_size**-0.5, dtype=dtype
    )
    step = decode_step(args, batch_size, device)
    builder = backend.make_builder(spec, args.block_size, max(batch_size, 1), device)
    impl = backend.make_impl(spec)
    out = torch.empty_like(step["query"])

    def build(for_cudagraph: bool):
        return builder.build(
            step["qsl"],
            step["seq_lens"],
            step["table"],
            step["slots"],
            batch_size,
            num_padded_tokens=batch_size,
            for_cudagraph=for_cudagraph,
        )

    metadata = build(False)
    build_ms = time_ms(lambda: build(False), max(args.iters // 10, 1), 1, device)
    metadata = build(False)

    def call(md=metadata) -> None:
        impl.forward(step["query"], step["key"], step["value"], step["cache"], md, out)

    results = [{**base, "mode": "eager", "ms": time_ms(call, args.iters, args.warmup, device)}]
    results[0]["build_ms"] = build_ms
    graph_ok = backend.cg_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    if device.type != "cuda":
        results.append({**base, "mode": "graph", "skipped": "CUDA graphs need a CUDA device"})
    elif not graph_ok:
        results.append({**base, "mode": "graph", "skipped": f"support {backend.cg_support.name}"})
    else:
        graph_md = build(True)
        call(graph_md)  # compile / JIT outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(graph_md)
        results.append(
            {**base, "mode": "graph", "ms": time_ms(graph.replay, args.iters, args.warmup, device)}
        )
    return results


def table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'backend':<14}{'batch':>6}{'mode':>7}{'ms/call':>10}{'build ms':>10}  note"]
    for r in records:
        ms = f"{r['ms']:.4f}" if "ms" in r else "-"
        build = f"{r['build_ms']:.3f}" if "build_ms" in r else ""
        lines.append(
            f"{r['backend']:<14}{r['batch_size']:>6}{r.get('mode', '-'):>7}{ms:>10}{build:>10}"
            f"  {r.get('skipped', '')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "shape": {
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_size": args.head_size,
            "block_size": args.block_size,
        },
    }
    records: list[dict[str, Any]] = []

    def write(**extra: Any) -> None:  # replaced at once: a reader never sees half a file
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"env": env, "results": records, **extra}, indent=2))
        os.replace(tmp, out)

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as KeyboardInterrupt
    stopped = False
    try:
        for name in args.backends:
            for batch_size in args.batch_sizes:
                try:
                    records.extend(measure(args, name, batch_size))
                except Exception as e:  # one backend failing must not hide the others' numbers
                    logger.exception("%s at batch %d failed", name, batch_size)
                    records.append(
                        {"backend": name, "batch_size": batch_size, "skipped": f"error: {e!r}"}
                    )
                write()
    except KeyboardInterrupt:
        stopped = True
        write(stopped=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(table(records))
    print(f"wrote {out}" + (" (stopped: what was measured before)" if stopped else ""))
    if stopped:
        raise SystemExit(124)
    return records


if __name__ == "__main__":
    main()
