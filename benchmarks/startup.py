"""Start-up: what a user waits for, from process start to the first token, in one run.

Every start is a fresh process (``python`` start, imports, model build and weight load,
compile or load, KV cache, then one greedy token for one prompt) on the same
Llama-shaped model (~33M-parameter layers, random weights, built locally), for
each depth:

* ``cold``: our cache and Inductor's caches empty;
* ``warm``: our cache filled by the cold start, Inductor's caches empty (as on
  another machine after ``compile-runtime cache import``): the saved program runs,
  no trace, no compile;
* ``stock cold`` / ``stock warm``: the same engine with ``CompilationMode.
  STOCK_TORCH_COMPILE`` (plain ``torch.compile``, Inductor): cold with empty caches,
  warm with its own caches kept: Inductor's cache directory (FX graph and AOTAutograd
  caches) and torch's cache artifacts (``torch.compiler.save_cache_artifacts`` after
  the cold start, ``load_cache_artifacts`` before the warm one).

Columns: ``process s`` (spawn to the first token, the whole wait), ``imports s``,
``engine s`` (``LLM(...)``: weights, trace/compile/load, KV cache), ``first token s``
(the first ``generate`` call: stock torch.compile compiles again there, for the new
shapes), and the compile work counted in the process. Left out: CUDA graph capture
(none on a CPU) and tokenizer loading (the prompt is token ids).

    python benchmarks/startup.py [--layers 2 16 32] [--out benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import repo_root  # noqa: F401  (testing/ on the path)

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "ours": {"backend": "inductor"},
    "stock": {"mode": "STOCK_TORCH_COMPILE", "backend": "inductor"},
}


def child(args: argparse.Namespace) -> None:
    started = float(args.started)
    t0 = time.time()
    import torch

    import compile_runtime as cr

    LLM, SamplingParams = cr.LLM, cr.SamplingParams  # imported on first use: count it here
    if args.load_artifacts and os.path.exists(args.load_artifacts):
        with open(args.load_artifacts, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    t1 = time.time()
    llm = LLM(
        args.model,
        {**CONFIGS[args.config], "cache_dir": args.cache_dir},
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    t2 = time.time()
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t3 = time.time()
    if args.save_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.save_artifacts, "wb") as f:
                f.write(saved[0])
    c = cr.compilation_counter
    print(
        json.dumps(
            {
                "process_s": round(t3 - started, 2),
                "imports_s": round(t1 - t0, 2),
                "engine_s": round(t2 - t1, 2),
                "first_token_s": round(t3 - t2, 2),
                "interpreter_s": round(t0 - started, 2),
                "dynamo_traces": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "inductor_compiles": c.num_inductor_compiles,
                "programs_loaded": c.num_programs_loaded,
                "startup_line": llm.startup.summary(),
                "token": out[0].outputs[0].token_ids,
            }
        )
    )


def start(model: str, config: str, cache_dir: str, inductor_dir: str, **extra: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir)
    cmd = [sys.executable, __file__, "--child", "--model", model, "--config", config]
    cmd += ["--cache-dir", cache_dir, "--started", repr(time.time())]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"start {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(layers: int, root: str) -> list[dict]:
    sys.path.insert(0, HERE)
    from llama_33m import MODEL

    from testing.model_dirs import make_model_dir

    model = make_model_dir(
        os.path.join(root, f"model-{layers}"),
        arch="llama",
        **{**MODEL, "num_hidden_layers": layers},
    )
    rows = []

    def run(name: str, config: str, cache: str, inductor: str, **extra: str) -> None:
        r = start(model, config, cache, inductor, **extra)
        rows.append({"layers": layers, "start": name, **r})
        print({k: v for k, v in rows[-1].items() if k != "startup_line"}, file=sys.stderr)

    ours = os.path.join(root, f"ours-{layers}")
    run("cold", "ours", ours, tempfile.mkdtemp(dir=root))
    run("warm", "ours", ours, tempfile.mkdtemp(dir=root))  # Inductor's caches empty
    stock_inductor = tempfile.mkdtemp(dir=root)
    artifacts = os.path.join(root, f"stock-{layers}.bin")
    stock = os.path.join(root, f"stock-{layers}")
    run("stock cold", "stock", stock, stock_inductor, save_artifacts=artifacts)
    run("stock warm", "stock", stock, stock_inductor, load_artifacts=artifacts)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16, 32])
    parser.add_argument("--out", default="benchmarks/results/startup.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("model", "config", "cache-dir", "started", "save-artifacts", "load-artifacts"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from compile_runtime.table import format_table

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for layers in args.layers:
            rows += measure(layers, root)
    headers = [
        "layers",
        "start",
        "process_s",
        "imports_s",
        "engine_s",
        "first_token_s",
        "dynamo_traces",
        "inductor_compiles",
        "programs_loaded",
    ]
    print(format_table(headers, [[r[h] for h in headers] for r in rows]))

    def get(layers: int, name: str) -> dict:
        return next(r for r in rows if r["layers"] == layers and r["start"] == name)

    for layers in args.layers:
        cold, warm, stock = get(layers, "cold"), get(layers, "warm"), get(layers, "stock warm")
        after_imports = (warm["engine_s"] + warm["first_token_s"]) / (
            cold["engine_s"] + cold["first_token_s"]
        )
        print(
            f"{layers} layers: warm/cold after imports {after_imports:.2f}, whole process "
            f"{warm['process_s'] / cold['process_s']:.2f}; warm vs stock warm "
            f"{warm['process_s'] / stock['process_s']:.2f}; "
            f"tokens agree: {len({str(r['token']) for r in rows if r['layers'] == layers}) == 1}"
        )
    first, last = get(args.layers[0], "warm"), get(args.layers[-1], "warm")
    flat = (last["engine_s"] + last["first_token_s"]) / (first["engine_s"] + first["first_token_s"])
    print(f"warm start, {args.layers[-1]} vs {args.layers[0]} layers (after imports): {flat:.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
