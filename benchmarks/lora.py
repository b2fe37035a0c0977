"""What serving LoRA adapters costs: one batch with and without adapters, in one run.

On the real model (SmolLM2-135M-Instruct, the GGUF file dequantized to float32, as
transformers and vLLM run it), greedy, EOS an ordinary token, 4 adapters of rank 16 on
all seven projections (q/k/v/o/gate/up/down) built with PEFT (random non-zero A and B):

* ``no LoRA``: an engine without LoRA, the batch of ``--batch`` prompts;
* ``LoRA engine, no adapters``: an engine with ``enable_lora=True`` (``max_loras=4``), the
  same batch with no adapter (its steps dispatch to the graphs without LoRA calls);
* ``LoRA engine, 4 adapters mixed``: the same batch, request i under adapter i % 4.

Each row is the best of ``--repeats`` generations (the rows interleaved), output tokens per
second. The adapters' tokens are checked against transformers + PEFT for the first prompt
of each adapter (they must be equal).

    python benchmarks/lora.py [--batch 16] [--tokens 64] [--repeats 3]
        [--out benchmarks/results/lora.json]

Left out: vLLM CPU with the same adapters (its CPU LoRA path needs its own venv set-up
with the peft adapters; not done this round), bf16 and quantized base weights, prefill-heavy
batches (the prompts are 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import repo_root  # noqa: F401  (testing/ importable)
import torch
from decode_replay import cpu_name

import compile_runtime as cr
from compile_runtime.lora import LoRARequest
from compile_runtime.models.smollm2 import smollm2_gguf
from compile_runtime.table import format_table
from testing.lora_adapters import make_peft_adapter, peft_greedy

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "lora.json"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    folder, name = os.path.split(gguf)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    root = tempfile.mkdtemp(prefix="lora_bench_")
    adapters = [
        LoRARequest(f"a{i}", i + 1, make_peft_adapter(
            hf, os.path.join(root, f"a{i}"), r=16, target_modules=PROJECTIONS, seed=i, scale=0.1,
        ))
        for i in range(4)
    ]  # fmt: skip
    prompts = [list(range(100 + 7 * i, 132 + 7 * i)) for i in range(args.batch)]
    params = cr.SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    mixed = [adapters[i % 4] for i in range(args.batch)]
    common = dict(dtype="float32", quantization="none")
    plain = cr.LLM(gguf, **common)
    lora = cr.LLM(gguf, **common, enable_lora=True, max_loras=4, max_lora_rank=16)

    def run(llm, loras):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=loras, use_tqdm=False)  # fmt: skip
        return [o.outputs[0].token_ids for o in outs]

    rows = {
        "no LoRA": (plain, None),
        "LoRA engine, no adapters": (lora, None),
        "LoRA engine, 4 adapters mixed": (lora, mixed),
    }
    tokens = {label: run(llm, loras) for label, (llm, loras) in rows.items()}  # warm-up
    best = dict.fromkeys(rows, 0.0)
    for _ in range(args.repeats):
        for label, (llm, loras) in rows.items():
            start = time.perf_counter()
            run(llm, loras)
            best[label] = max(best[label], args.batch * args.tokens / (time.perf_counter() - start))
    checked = peft_greedy(hf, None, prompts[:1], 16)[0] == tokens["no LoRA"][0][:16]
    for i, adapter in enumerate(adapters):
        want = peft_greedy(hf, adapter.lora_path, prompts[i : i + 1], 16)[0]
        checked = checked and want == tokens["LoRA engine, 4 adapters mixed"][i][:16]
    base = best["no LoRA"]
    table = [[label, f"{tps:.1f}", f"{tps / base:.2f}x"] for label, tps in best.items()]
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.tokens} tokens, rank 16 on all projections")  # fmt: skip
    print(format_table(["", "tok/s", "vs no LoRA"], table))
    print(f"tokens equal transformers + PEFT (first 16 of one prompt per adapter): {checked}")
    result = {
        "cpu": cpu_name(), "batch": args.batch, "tokens": args.tokens,
        "tok_s": best, "peft_tokens_equal": checked,
    }  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plain.shutdown()
    lora.shutdown()
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())
