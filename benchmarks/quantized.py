"""Quantized GGUF files at batch 1: us (weights kept quantized) against llama.cpp, same files.

Each side runs in its own process through ``benchmarks/peers/worker.py`` (llama.cpp in
its venv, ``benchmarks/.peers/llamacpp``, as ``vs_vllm.py`` runs it), one side at a time,
on the same token ids: one 32-token prompt of plain vocabulary ids, greedy, ``--tokens``
new tokens, EOS ignored. Tokens per second of the generate call (prompt included), best
of ``--repeats`` after a warm-up call. The greedy tokens of every side are compared with
llama.cpp's on the same file (tokens equal before the first difference).

    python benchmarks/quantized.py [--files q8_0 q4_1] [--sides ours llamacpp]
        [--tokens 128] [--repeats 3] [--ours-options JSON] [--out results/quantized.json]

Ours runs ``cr.LLM(file)`` with its defaults (``dtype="auto"``: bf16 on a CPU with
AVX512-BF16 or AMX, float32 on one without; ``quantization="auto"``: the file's Q8_0/Q4_1
kept) plus ``--ours-options``; the JSON records the dtype it ran in.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vs_vllm import Worker, others_busy_cores  # noqa: E402

GGUF = os.path.join(HERE, ".peers", "gguf")
FILES = {
    "q8_0": os.path.join(GGUF, "smollm2-135m-q8_0.gguf"),
    "q4_1": os.path.join(GGUF, "smollm2-135m-q4_1.gguf"),
}


def prompt(seed: int = 0, length: int = 32) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def measure(side: str, quant: str, args) -> dict:
    options = json.loads(args.ours_options) if side == "ours" else {}
    if side == "ours":
        options = {"max_num_seqs": 1, "max_model_len": 512, **options}
    # The file's precision on both sides: for ours that leaves dtype at "auto" (bf16 where the
    # CPU has AVX512-BF16/AMX, else float32), as a user's cr.LLM(file) gets it.
    worker = Worker(side, quant, FILES[quant], options)
    try:
        requests = [(prompt(), args.tokens)]
        tokens, _ = worker.run(requests)  # warm-up
        times = []
        for _ in range(args.repeats):
            time.sleep(0.5)
            busy = others_busy_cores()
            _, seconds = worker.run(requests)
            times.append((seconds, busy))
        best = min(s for s, _ in times)
        return {
            "side": side,
            "file": quant,
            "tok_s": args.tokens / best,
            "all_tok_s": [round(args.tokens / s, 1) for s, _ in times],
            "others_busy_cores": [b for _, b in times],
            "startup_s": round(worker.startup_s, 1),
            "tokens": tokens[0],
            "info": worker.info,
            "peak_rss_gib": worker.peak_rss_gib(),
        }
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES), choices=list(FILES))
    parser.add_argument("--sides", nargs="+", default=["ours", "llamacpp"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ours-options", default="{}", help="JSON: extra cr.LLM options")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quantized.json"))
    args = parser.parse_args()

    results = []
    for quant in args.files:
        if not os.path.exists(FILES[quant]):
            print(f"skip {quant}: {FILES[quant]} missing (benchmarks/peers/install.py)")
            continue
        for side in args.sides:
            r = measure(side, quant, args)
            results.append(r)
            print(f"{side:9s} {quant}: {r['tok_s']:.1f} tok/s (all {r['all_tok_s']})", flush=True)
    print(
        f"\n| file | side | tok/s batch 1 (best of {args.repeats}) | vs llama.cpp | greedy = llama.cpp |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        ref = next((x for x in results if x["file"] == r["file"] and x["side"] == "llamacpp"), None)
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref else "-"
        agree = (
            f"{first_difference(r['tokens'], ref['tokens'])}/{len(ref['tokens'])} tokens"
            if ref and ref is not r
            else "-"
        )
        r["vs_llamacpp"] = ratio
        r["agree_with_llamacpp"] = agree
        print(f"| {r['file']} | {r['side']} | {r['tok_s']:.1f} | {ratio} | {agree} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tokens": args.tokens, "repeats": args.repeats, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
