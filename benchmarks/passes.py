"""Per-step latency of a Llama-shaped model with the graph passes on and off.

The native Llama model (compile_runtime/models/llama.py) at a small Llama
shape, PIECEWISE-compiled with Inductor, no CUDA graphs (so the difference is
the passes alone). One step is one forward over ``n`` tokens; attention is
causal over the step's tokens (no KV cache), the same work for every variant.

Variants: ``off`` (every pass off), ``on`` (every pass on, fusions forced on),
``default`` (the PassConfig defaults: fusions are CUDA-only), and one variant
per fusion (``rms``, ``silu``, ``rotary``: that fusion alone, plus no-op
elimination, cleanup and fix-functionalization). The table gives median
milliseconds per step and the fused ops in one decoder layer (the piece
between two attention ops, which every layer but the first and last shares).

    python benchmarks/passes.py [--device cpu|cuda] [--tokens 1 16 256] [--threads 1]
        [--variants off on default rms silu rotary] [--out benchmarks/results/passes.json]

Variants are timed interleaved, step by step, so that other load on the
machine falls on all of them alike; on a shared CPU ``--threads 1`` keeps
OpenMP threads from stalling on each other. Compile seconds are in the JSON
(the first variant pays the process's first C++ compile).

The JSON is written after every compiled variant and every token count measured, so
a run cut short keeps what it did; stopped by SIGTERM (the caller's time budget), it
prints the table of what was measured, marks the JSON ``"stopped"`` and exits 124.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import repo_root  # noqa: F401  (testing/ on the path)

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=4096,
)
ALL_ON = dict(
    enable_noop_elimination=True,
    enable_rms_norm_fusion=True,
    enable_silu_mul_fusion=True,
    enable_rotary_fusion=True,
    enable_post_cleanup=True,
    enable_fix_functionalization=True,
)
ALL_OFF = {k: False for k in ALL_ON}
ONLY = {
    "rms": "enable_rms_norm_fusion",
    "silu": "enable_silu_mul_fusion",
    "rotary": "enable_rotary_fusion",
}
VARIANTS = ["off", "on", "default", *ONLY]


def pass_config(variant: str) -> dict:
    if variant == "off":
        return ALL_OFF
    if variant == "on":
        return ALL_ON
    if variant == "default":
        return {}
    flags = {k: False for k in ONLY.values()}
    flags[ONLY[variant]] = True
    return flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--iters", type=int, default=None, help="timed steps (default by device)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 keeps other load from stalling OpenMP",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "passes.json"))
    return p.parse_args(argv)


def fused_ops_per_layer(record) -> dict[str, int]:
    """Fused ops in the compiled piece that the middle layers share (one layer's worth)."""
    from compile_runtime.passes import Phase

    records = [r for r in record.pass_manager.records if r.phase == Phase.POST_GRAD]
    graphs: list[str] = []
    for r in records:
        if r.graph not in graphs:
            graphs.append(r.graph)
    # Unique pieces compile in order: first, shared middle, last.
    pieces = [r for r in record.result.pieces if not r.is_splitting_op]
    unique = [r for r in pieces if r.shared_with is None]
    shared = max(unique, key=lambda u: sum(p.shared_with == u.index for p in pieces))
    graph = graphs[unique.index(shared)] if len(graphs) == len(unique) else None
    counts = {"rms_norm": 0, "fused_add_rms_norm": 0, "silu_and_mul": 0, "rotary_qk": 0}
    for r in records:
        if r.graph == graph:
            for name, n in r.details.items():
                if name in counts:
                    counts[name] += n
    return counts


def build_variant(variant: str, args: argparse.Namespace):
    """The compiled model of one variant (compiled by a first call), and what it reports."""
    import torch

    import compile_runtime as cr
    from compile_runtime.compiler.decorator import compiled_model
    from compile_runtime.models.llama import CausalLM
    from compile_runtime.models.registry import default_dtype_and_device
    from testing.model_dirs import tiny_config

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    config = cr.CompilationConfig(
        backend="inductor",
        cudagraph_mode="NONE",
        disable_cache=True,
        pass_config=pass_config(variant),
        # Inductor's FX cache would skip the passes (and their counts) on a warm start.
        inductor_compile_config={"fx_graph_cache": False},
    )
    torch.manual_seed(0)
    with cr.set_compilation_config(config), default_dtype_and_device(dtype, device):
        model = CausalLM(tiny_config("llama", **SHAPE)).eval()
    start = time.perf_counter()
    with torch.no_grad():
        # The first call traces: not at 1 token, which Dynamo would specialize on.
        step(model, 16, device)
    sync(device)
    record = compiled_model(model.model)
    info = {
        "variant": variant,
        "compile_s": round(time.perf_counter() - start, 2),
        "fused_per_layer": fused_ops_per_layer(record),
        "ms": {},
    }
    return model, info


def step(model, n: int, device):
    import torch

    ids = torch.randint(0, SHAPE["vocab_size"], (n,), device=device)
    return model(ids, torch.arange(n, device=device))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(models: dict, infos: dict, args: argparse.Namespace, done=lambda: None) -> None:
    """Median step time per variant, the variants interleaved step by step, so that
    other load on the machine falls on all of them alike; ``done()`` after each token count."""
    import torch

    device = torch.device(args.device)
    names = list(models)
    with torch.no_grad():
        for n in args.tokens:
            iters = args.iters or (100 if device.type == "cuda" else (20 if n >= 256 else 60))
            for name in names:
                for _ in range(args.warmup):
                    step(models[name], n, device)
            sync(device)
            times: dict[str, list[float]] = {name: [] for name in names}
            for i in range(iters):
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    t = time.perf_counter()
                    step(models[name], n, device)
                    sync(device)
                    times[name].append(time.perf_counter() - t)
            for name in names:
                infos[name]["ms"][n] = round(statistics.median(times[name]) * 1e3, 3)
            print(
                f"  n={n:4d}: " + ", ".join(f"{k} {infos[k]['ms'][n]:.3f} ms" for k in names),
                file=sys.stderr,
            )
            done()


def table(results: list[dict], tokens: list[int]) -> str:
    by = {r["variant"]: r for r in results}
    head = "| tokens | " + " | ".join(f"{v} (ms)" for v in by) + " |"
    if "off" in by and "on" in by:
        head += " on vs off |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in tokens:
        ms = {v: by[v]["ms"].get(n) for v in by}  # None: not measured (a run cut short)
        row = f"| {n} | " + " | ".join("-" if m is None else f"{m:.3f}" for m in ms.values())
        row += " |"
        if "off" in by and "on" in by:
            ratio = "-" if None in (ms["off"], ms["on"]) else f"{ms['off'] / ms['on']:.2f}x"
            row += f" {ratio} |"
        lines.append(row)
    lines.append("")
    lines.append("Fused ops per decoder layer:")
    lines.append("")
    lines.append("| variant | RMSNorm | add + RMSNorm | SiLU-and-mul | rotary Q+K (in place) |")
    lines.append("|---|---|---|---|---|")
    for v, r in by.items():
        f = r["fused_per_layer"]
        lines.append(
            f"| {v} | {f['rms_norm']} | {f['fused_add_rms_norm']} | {f['silu_and_mul']} | "
            f"{f['rotary_qk']} |"
        )
    return "\n".join(lines)


def write(path: str, data: dict) -> None:
    """The JSON as it stands, replaced at once (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shape": SHAPE,
    }
    models, infos = {}, {}

    def save(**extra) -> None:
        write(args.out, {"meta": meta, "results": list(infos.values()), **extra})

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as KeyboardInterrupt
    stopped = None
    try:
        for variant in args.variants:
            models[variant], infos[variant] = build_variant(variant, args)
            print(f"  {variant}: compiled in {infos[variant]['compile_s']} s", file=sys.stderr)
            save()
        measure(models, infos, args, done=save)
    except KeyboardInterrupt:
        running = [v for v in args.variants if v not in infos] or ["measuring"]
        stopped = f"stopped during {running[0]}; not compiled: {', '.join(running[1:]) or '-'}"
        save(stopped=stopped)
    finally:
        signal.signal(signal.SIGTERM, previous)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"Llama-shaped model ({SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"{name}, {torch.get_num_threads()} threads), median ms per step:\n"
    )
    if infos:
        print(table(list(infos.values()), args.tokens))
    if stopped:
        print(f"\n{stopped}")
        return 124
    return 0


if __name__ == "__main__":
    sys.exit(main())
