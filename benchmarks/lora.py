"""What serving LoRA adapters costs, side by side with vLLM's CPU build on the same adapters.

SmolLM2-135M-Instruct (the HF directory ``vs_vllm.py --setup`` builds from the GGUF file),
greedy, EOS an ordinary token, 4 adapters of rank 16 on all seven projections
(q/k/v/o/gate/up/down) built with PEFT (random non-zero A and B). Per side (``ours``:
``cr.LLM``; ``vllm``: vLLM 0.32 CPU, ``enable_lora=True, max_loras=4, max_lora_rank=16``),
each engine in its own process (``peers/worker.py``), all alive at once, the rows
interleaved, best of ``--repeats``, output tokens per second:

* ``no LoRA``: an engine without LoRA, a batch of ``--batch`` 32-token prompts;
* ``LoRA engine, no adapters``: an engine with LoRA enabled, the same batch, no adapter;
* ``LoRA engine, 4 adapters mixed``: the same batch, request i under adapter i % 4.

Checked: our tokens with adapters equal vLLM's (every request, fp32) and transformers +
PEFT's (the first 16 tokens of one prompt per adapter).

    python benchmarks/lora.py [--sides ours vllm] [--dtype fp32|bf16] [--batch 16]
        [--tokens 64] [--repeats 3] [--out benchmarks/results/lora.json]

Left out: quantized base weights; llama.cpp (its Python API runs one sequence: no batch to
mix adapters in); prefill-heavy batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import repo_root  # noqa: F401  (testing/ importable)
import torch
from decode_replay import cpu_name
from vs_vllm import WORKER, Worker, install

from compile_runtime.table import format_table
from testing.lora_adapters import make_peft_adapter, peft_greedy

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = ("no LoRA", "LoRA engine, no adapters", "LoRA engine, 4 adapters mixed")
LORA_OPTIONS = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4}
SIDE_OPTIONS = {"ours": {}, "vllm": {"gpu_memory_utilization": 0.15}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", nargs="+", choices=["ours", "vllm"], default=["ours", "vllm"])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "lora.json"))
    args = parser.parse_args(argv)
    if not os.path.isdir(install.HF_DIR):
        sys.exit(f"{install.HF_DIR} is missing: run `python benchmarks/vs_vllm.py --setup` first")

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(install.HF_DIR, dtype=torch.float32).eval()
    root = tempfile.mkdtemp(prefix="lora_bench_")
    adapters = [
        [f"a{i}", i + 1, make_peft_adapter(
            hf, os.path.join(root, f"a{i}"), r=16, target_modules=PROJECTIONS, seed=i, scale=0.1,
        )]
        for i in range(4)
    ]  # fmt: skip
    prompts = [list(range(1000 + 7 * i, 1032 + 7 * i)) for i in range(args.batch)]
    requests = [(p, args.tokens) for p in prompts]
    mixed = [adapters[i % 4] for i in range(args.batch)]
    calls = {ROWS[0]: ("plain", None), ROWS[1]: ("lora", None), ROWS[2]: ("lora", mixed)}

    workers: dict[tuple[str, str], Worker] = {}
    try:
        for side in args.sides:
            for kind, options in (("plain", {}), ("lora", LORA_OPTIONS)):
                workers[side, kind] = Worker(
                    side, args.dtype, install.HF_DIR, {**SIDE_OPTIONS[side], **options},
                    WORKER, log_name=f"lora-{side}-{kind}-{args.dtype}",
                )  # fmt: skip
        tokens: dict[tuple[str, str], list] = {}
        best: dict[tuple[str, str], float] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for side in args.sides:
                for row, (kind, loras) in calls.items():
                    out, seconds = workers[side, kind].run(requests, loras)
                    tokens[side, row] = out
                    if repeat:
                        tps = args.batch * args.tokens / seconds
                        best[side, row] = max(best.get((side, row), 0.0), tps)
    finally:
        for worker in workers.values():
            worker.close()

    checks = {}
    if "ours" in args.sides:
        ours = tokens["ours", ROWS[2]]
        checks["ours_equal_peft"] = all(
            peft_greedy(hf, adapters[i][2], prompts[i : i + 1], 16)[0] == ours[i][:16]
            for i in range(min(4, args.batch))
        )
        if "vllm" in args.sides:
            theirs = tokens["vllm", ROWS[2]]
            checks["ours_equal_vllm_requests"] = sum(
                a == b for a, b in zip(ours, theirs, strict=True)
            )
    table = []
    for side in args.sides:
        base = best[side, ROWS[0]]
        for row in ROWS:
            tps = best[side, row]
            vs_vllm = (
                f"{tps / best['vllm', row]:.2f}x"
                if side == "ours" and ("vllm", row) in best
                else ""
            )
            table.append([side, row, f"{tps:.1f}", f"{tps / base:.2f}x", vs_vllm])
    print(
        f"# {cpu_name()}, {args.dtype}, batch {args.batch}, {args.tokens} tokens out, "
        "4 adapters of rank 16 on all projections"
    )
    print(format_table(["side", "", "tok/s", "vs its no LoRA", "ours / vLLM"], table))
    print("checks:", checks)
    result = {
        "cpu": cpu_name(), "dtype": args.dtype, "batch": args.batch, "tokens": args.tokens,
        "tok_s": {f"{s}: {r}": v for (s, r), v in best.items()}, "checks": checks,
    }  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    ok = checks.get("ours_equal_peft", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
