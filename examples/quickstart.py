"""The main job on a tiny model: generate with eager and with the compiled runtime.

Builds a small Llama model directory locally (transformers config, random
weights from a fixed seed, safetensors, a small BPE tokenizer), then
generates for a batch of prompts of different lengths twice: eager
(CompilationMode.NONE) and the default compiled configuration (one trace,
split at attention, Inductor per piece). Prints a table.

    python examples/quickstart.py [--model-dir .demo/tiny-llama] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import logging

import compile_runtime as cr
from compile_runtime.table import format_table
from compile_runtime.testing.model_dirs import make_model_dir

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog. a compiler turns a model into code.",
    "one two three",
    "inference runtimes batch requests, page the kv cache and capture graphs. once upon a time",
]


def run(model_dir: str, config: dict, max_tokens: int) -> tuple[list, dict]:
    before = cr.compilation_counter.clone()
    llm = cr.LLM(model_dir, config, max_num_seqs=8, max_num_batched_tokens=128)
    params = cr.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, progress=False)  # warm-up request
    outputs = llm.generate(PROMPTS, params, progress=False)
    stats = llm.last_stats
    counter = cr.compilation_counter
    loaded = counter.num_compiled_artifacts_loaded - before.num_compiled_artifacts_loaded
    saved = counter.num_compiled_artifacts_saved - before.num_compiled_artifacts_saved
    cache = "-" if not (loaded or saved) else ("warm" if loaded and not saved else "cold")
    return outputs, {
        "tokens/s": f"{stats.tokens_per_second:.1f}",
        "first token ms": f"{1000 * min(stats.first_token_seconds):.1f}",
        "compile s": f"{llm.startup.first_forward:.1f}",
        "traces": counter.num_graphs_seen - before.num_graphs_seen,
        "compiles": counter.num_backend_compilations - before.num_backend_compilations,
        "cache": f"{cache} ({loaded} loaded, {saved} saved)" if cache != "-" else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default=".demo/tiny-llama")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model_dir = make_model_dir(
        args.model_dir,
        arch="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
    )
    print(f"model: {model_dir} (Llama, 4 layers, hidden 256, random weights)")
    rows = {}
    results = {}
    for name, config in [("eager", {"mode": "NONE"}), ("compiled (PIECEWISE, inductor)", {})]:
        results[name], rows[name] = run(model_dir, config, args.max_tokens)

    same = [a.token_ids == b.token_ids for a, b in zip(*results.values(), strict=True)]
    print()
    columns = list(next(iter(rows.values())))
    print(format_table(["configuration", *columns], [[n, *r.values()] for n, r in rows.items()]))
    print(f"\ngreedy tokens identical across configurations: {all(same)}")
    for prompt, out in zip(PROMPTS, results["compiled (PIECEWISE, inductor)"], strict=True):
        print(f"  {prompt[:40]!r:44} -> {out.text[:60]!r}")


if __name__ == "__main__":
    main()
