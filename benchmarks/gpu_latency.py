"""Per-step GPU latency: eager vs our PIECEWISE and FULL CUDA graphs vs stock reduce-overhead.

Two models: the toy model of the tests (testing/toy.py) and a small Llama-shaped
stack (testing/transformer.py: RMSNorm, rotary, GQA, SwiGLU;
its attention is causal over the step's tokens, no KV cache). One step is
what the runner does per batch: dispatch, copy into persistent buffers, run
the forward. At small batches a step is bound by kernel launches, which is
what CUDA graphs remove.

    python benchmarks/gpu_latency.py [--models toy llama] [--batch-sizes 1 8 64]
        [--modes eager piecewise full reduce-overhead] [--backend inductor]
        [--out benchmarks/results/gpu_latency.json]

Results are written to JSON after every measurement, so a run cut short
still leaves what it measured. Without CUDA only ``eager`` runs (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import repo_root  # noqa: F401  (testing/ on the path)

ROOT = Path(__file__).resolve().parent.parent
MODES = ["eager", "piecewise", "full", "reduce-overhead"]
GRAPH_MODES = {"piecewise": "PIECEWISE", "full": "FULL"}
LLAMA_SHAPE = dict(
    num_layers=8, hidden=1024, num_heads=16, num_kv_heads=4, intermediate=2816, vocab=32000
)
TOY_SHAPE = dict(num_layers=3, hidden=16, vocab=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["toy", "llama"], choices=["toy", "llama"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--iters", type=int, default=200, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_latency.json"))
    return p.parse_args(argv)


class Bench:
    """One model in one mode, with persistent input buffers and a ``step(n)``."""

    def __init__(self, model_name: str, mode: str, args: argparse.Namespace):
        import torch

        import compile_runtime as cr
        from compile_runtime.graphs.capture import capture
        from compile_runtime.graphs.wrapper import wrap_full_model

        self.torch, self.cr = torch, cr
        self.model_name, self.mode = model_name, mode
        device = args.device
        max_n = max(args.batch_sizes)
        shape = TOY_SHAPE if model_name == "toy" else LLAMA_SHAPE
        self.ids = torch.randint(0, shape["vocab"], (max_n,), device=device)
        self.positions = torch.arange(max_n, device=device)

        if mode in GRAPH_MODES:
            config = cr.CompilationConfig(
                backend=args.backend,
                cudagraph_mode=GRAPH_MODES[mode],
                cudagraph_capture_sizes=sorted(set(args.batch_sizes)),
            )
        else:
            config = cr.CompilationConfig(mode="NONE")
        model = build_model(model_name, config, shape).to(device)
        self.model: Callable[..., Any] = model
        self.dispatcher = None
        self.capture_report = None

        if mode == "reduce-overhead":
            self.model = torch.compile(model, mode="reduce-overhead", dynamic=False)
        elif mode in GRAPH_MODES:
            if mode == "full":
                self.model = wrap_full_model(model, config)
            self.dispatcher = cr.CudagraphDispatcher(config)
            self.dispatcher.initialize_keys(config.cudagraph_mode)
            self.capture_report = capture(
                self.model,
                lambda d, _mode: self.inputs(d.num_tokens),
                self.dispatcher,
                progress=False,
            )

    def inputs(self, n: int) -> tuple[Any, ...]:
        if self.model_name == "toy":
            return (self.ids[:n],)
        return (self.ids[:n], self.positions[:n])

    def step(self, n: int) -> Any:
        if self.mode == "reduce-overhead":
            self.torch.compiler.cudagraph_mark_step_begin()
            return self.model(*self.inputs(n))
        if self.dispatcher is None:
            return self.model(*self.inputs(n))
        mode, desc = self.dispatcher.dispatch(n)
        with self.cr.set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=desc):
            return self.model(*self.inputs(desc.num_tokens))


def build_model(name: str, config: Any, shape: dict[str, int]) -> Any:
    if name == "toy":
        from testing.toy import build

        return build(config, **shape)
    from testing.transformer import build_transformer

    return build_transformer(config, **shape)


def time_steps(bench: Bench, n: int, warmup: int, iters: int, cuda: bool) -> float:
    """Mean seconds per step, the device synchronised before and after the timed loop."""
    torch = bench.torch
    for _ in range(warmup):
        bench.step(n)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        bench.step(n)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def print_table(rows: list[dict[str, Any]], modes: list[str]) -> None:
    by_key: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["model"], r["batch_size"]), {})[r["mode"]] = r["latency_ms"]
    header = f"{'model':<8}{'batch':>6}" + "".join(f"{m + ' ms':>20}" for m in modes)
    print(header)
    print("-" * len(header))
    for (model, batch), cells in by_key.items():
        eager = cells.get("eager")
        line = f"{model:<8}{batch:>6}"
        for m in modes:
            if m not in cells:
                line += f"{'-':>20}"
            elif eager and m != "eager":
                line += f"{cells[m]:>11.3f} ({eager / cells[m]:4.1f}x)"
            else:
                line += f"{cells[m]:>20.3f}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    cuda = args.device == "cuda"
    # float32 weights (the Llama-shaped stack's rotary promotes to float32), TF32 matmuls.
    torch.set_float32_matmul_precision("high")
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for a smoke test", file=sys.stderr)
        return 2
    modes = args.modes if cuda else [m for m in args.modes if m == "eager"]
    if modes != args.modes:
        print(f"without CUDA only eager runs (skipping {sorted(set(args.modes) - set(modes))})")

    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": args.backend,
        "dtype": "float32 (TF32 matmuls)",
        "iters": args.iters,
        "rows": [],
        "capture": [],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    with torch.no_grad():
        for model_name in args.models:
            for mode in modes:
                start = time.perf_counter()
                bench = Bench(model_name, mode, args)
                setup = time.perf_counter() - start
                if bench.capture_report is not None:
                    report = bench.capture_report
                    result["capture"].append(
                        {
                            "model": model_name,
                            "mode": mode,
                            "graphs": report.num_graphs,
                            "seconds": report.seconds,
                            "memory_bytes": report.memory_bytes,
                        }
                    )
                for n in args.batch_sizes:
                    seconds = time_steps(bench, n, args.warmup, args.iters, cuda)
                    row = {
                        "model": model_name,
                        "mode": mode,
                        "batch_size": n,
                        "latency_ms": seconds * 1e3,
                        "setup_seconds": setup,
                    }
                    result["rows"].append(row)
                    save()
                    print(f"{model_name:<6} {mode:<16} batch {n:>4}: {seconds * 1e3:8.3f} ms/step")
                del bench
                if cuda:
                    torch.cuda.empty_cache()
    save()
    print()
    print_table(result["rows"], modes)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
