"""Quality, measured: perplexity of the real model on a fixed text, ours vs llama.cpp.

SmolLM2-135M-Instruct on ``benchmarks/data/perplexity.txt`` (an original essay written for
this benchmark), per precision, each side on the SAME GGUF file and the SAME token ids:

* the text is tokenized once, by the tokenizer our engine loads for the project's GGUF file
  (``load_tokenizer(model_directory(file))``, what ``cr.LLM(file).tokenizer`` is), no BOS;
* the ids are cut into windows of ``--window`` tokens (512) every ``--stride`` tokens
  (default: the window, so the windows do not overlap; the last one may be shorter); each
  window is evaluated from an empty context and scores every token given the tokens before
  it in its window; a token already scored by an earlier window (``--stride`` < window) is
  not scored again, so every token but the first is scored at most once and a window's first
  token is scored only when an overlap gives it context;
* perplexity = exp(mean NLL over the scored tokens);
* ours: ``cr.LLM(file, dtype=...)``, one ``generate`` call over all windows with
  ``SamplingParams(prompt_logprobs=0, max_tokens=1)``: the chosen token's logprob at each
  prompt position (log-softmax in float32 over the full vocabulary);
* llama.cpp: llama-cpp-python 0.3.36 (``benchmarks/.peers/llamacpp``), ``logits_all=True``,
  per window ``reset()`` + ``eval(ids)``, log-softmax of its logits in float64 over the
  full vocabulary; its weight-repack path off (it segfaults here for Q8_0/Q4_1).

Files (``benchmarks/peers/install.py`` makes them): f32, bf16 and q8_0 are converted by
llama.cpp's ``convert_hf_to_gguf.py`` from the project's Q4_1 file dequantized by
transformers; q4_1 is the project's file itself. Rows: fp32 and bf16 (ours in that dtype
on the f32 / bf16 file); q8_0 and q4_1 twice for ours: the file dequantized to fp32
(``quantization="none"``) and kept quantized (``--ours-quant-options``,
``{"quantization": "gguf"}`` by default, what ``"auto"`` picks for these files; activations
in ``--ours-quant-dtype``, fp32 by default; the row says why when the engine refuses it).
Targets: our kept-quantized Q8_0 within 0.5% of llama.cpp's perplexity on the
same file, Q4_1 within 1%.

Greedy agreement: a few short text prompts (``GREEDY_PROMPTS``), ``--greedy-tokens`` new
tokens each, EOS ignored, the same ids on both sides; per prompt the count of identical
leading tokens, ours vs llama.cpp on the same file.

Each side runs in its own process (``benchmarks/peers/perplexity_worker.py``: llama.cpp in
its venv, ours in the package's), one at a time.

    python benchmarks/perplexity.py [--precisions fp32 bf16 q8_0 q4_1] [--window 512]
        [--stride 512] [--greedy-tokens 32] [--ours-quant-options JSON]
        [--out benchmarks/results/perplexity.json]

Left out: BOS (none, on both sides: the ids are the same), other texts and context lengths,
batch effects (ours runs all windows in one call, llama.cpp one at a time), K-quants, GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import install  # noqa: E402  (benchmarks/peers/install.py)

sys.path.insert(0, HERE)
from vs_vllm import Worker, WorkerError  # noqa: E402  (one worker process, one protocol)

TEXT = os.path.join(HERE, "data", "perplexity.txt")
WORKER = os.path.join(HERE, "peers", "perplexity_worker.py")
PRECISIONS = ["fp32", "bf16", "q8_0", "q4_1"]
FILE_KIND = {"fp32": "f32", "bf16": "bf16", "q8_0": "q8_0", "q4_1": "q4_1"}
TARGET_PCT = {"q8_0": 0.5, "q4_1": 1.0}  # |ours kept quantized / llama.cpp - 1|
GREEDY_PROMPTS = [
    "The history of the mechanical clock begins",
    "To bake a simple loaf of bread, you need",
    "In computer science, a hash table is",
    "The three largest planets in the solar system are",
]


# ---- the arithmetic (tests/test_perplexity.py checks it) ----


@dataclass(frozen=True)
class Window:
    start: int  # the window is ids[start:end]
    end: int
    first_scored: int  # tokens first_scored..end-1 are scored (first_scored > start)


def make_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows of ``window`` tokens every ``stride`` tokens, until the text's end; each scores
    the tokens no earlier window scored (and never its own first token: it has no context)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got {window}, {stride}")
    out: list[Window] = []
    scored_to = 1  # tokens before this index are scored (token 0 never is)
    start = 0
    while start + 1 < num_tokens and scored_to < num_tokens:  # windows of >= 2 tokens
        end = min(start + window, num_tokens)
        out.append(Window(start, end, max(start + 1, scored_to)))
        scored_to = end
        start += stride
    return out


def scored_nll(windows: list[Window], per_window: list[list[float]]) -> list[float]:
    """The scored tokens' NLL, in text order; ``per_window[i][j]`` is the NLL of token
    ``start + 1 + j`` of window i (every position but the first)."""
    out: list[float] = []
    for w, nll in zip(windows, per_window, strict=True):
        if len(nll) != w.end - w.start - 1:
            raise ValueError(f"window {w}: {len(nll)} scores for {w.end - w.start} tokens")
        out += nll[w.first_scored - w.start - 1 :]
    return out


def perplexity(nll: list[float]) -> float:
    return math.exp(math.fsum(nll) / len(nll))


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenizer_of(gguf_path: str):
    """The tokenizer our engine loads for a GGUF file (``cr.LLM(path).tokenizer``)."""
    from compile_runtime.models.gguf import model_directory
    from compile_runtime.models.tokenizer import load_tokenizer

    return load_tokenizer(model_directory(gguf_path), None)


# ---- the sides ----


@dataclass
class Row:
    """One side on one file: its perplexity and greedy tokens, or why there are none."""

    side: str
    precision: str  # the file's
    label: str  # what the side ran: "fp32", "bf16", "dequantized, fp32", "kept quantized"
    model: str
    options: dict
    ppl: float | None = None
    scored_tokens: int | None = None
    window_ppl: list[float] | None = None
    nll_seconds: float | None = None
    greedy: list[list[int]] | None = None
    startup_s: float | None = None
    info: dict | None = None
    skipped: str | None = None


def why(e: Exception) -> str:
    """The first line of a side's error, without the engine's list of every option."""
    return str(e).strip().splitlines()[0].split("; the options are")[0][:300]


def run_side(row: Row, run_as: str, windows: list[Window], ids: list[int], greedy) -> Row:
    log(f"{row.side} {row.precision} ({row.label}): {row.model}")
    try:
        slug = f"{row.precision}-{row.label}".replace(" ", "_").replace(",", "")
        side = Worker(
            row.side, run_as, row.model, row.options, WORKER, f"perplexity-{row.side}-{slug}"
        )
    except WorkerError as e:
        row.skipped = why(e)
        log(f"  skipped: {row.skipped}")
        return row
    try:
        row.startup_s, row.info = side.ready.get("startup_s"), side.info
        reply = side.ask({"op": "nll", "windows": [ids[w.start : w.end] for w in windows]})
        nll = scored_nll(windows, reply["nll"])
        row.ppl, row.scored_tokens, row.nll_seconds = perplexity(nll), len(nll), reply["seconds"]
        row.window_ppl = [
            perplexity(scored_nll([w], [n])) for w, n in zip(windows, reply["nll"], strict=True)
        ]
        row.greedy = side.ask({"op": "run", "requests": greedy})["tokens"]
        log(f"  ppl {row.ppl:.4f} over {row.scored_tokens} tokens ({row.nll_seconds:.1f} s)")
    except WorkerError as e:
        row.skipped = why(e)
        log(f"  failed: {row.skipped}")
    except BaseException:  # interrupted: no waiting for the worker to finish its request
        side.proc.kill()
        raise
    finally:
        side.close()
    return row


def log(msg: str) -> None:
    print(f"[perplexity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ours_variants(precision: str, quant_options: dict, quant_dtype: str):
    """(label, dtype the worker runs, options) of our rows for a file."""
    if precision in ("fp32", "bf16"):
        return [(precision, precision, {})]
    dequantized = {"quantization": "none"} if "quantization" in quant_options else {}
    return [
        ("dequantized, fp32", "fp32", dequantized),
        ("kept quantized", quant_dtype, quant_options),
    ]


def compare(ours: Row, ref: Row | None) -> dict:
    out: dict = {"precision": ours.precision, "ours": ours.label}
    out["ours_ppl"], out["llamacpp_ppl"] = ours.ppl, ref.ppl if ref else None
    if ours.ppl is not None and ref is not None and ref.ppl is not None:
        out["diff_pct"] = 100.0 * (ours.ppl / ref.ppl - 1.0)
        if ours.label == "kept quantized" and ours.precision in TARGET_PCT:
            out["target_pct"] = TARGET_PCT[ours.precision]
            out["within_target"] = abs(out["diff_pct"]) <= TARGET_PCT[ours.precision]
    if ours.greedy is not None and ref is not None and ref.greedy is not None:
        out["greedy_leading_equal"] = [
            leading_equal(a, b) for a, b in zip(ours.greedy, ref.greedy, strict=True)
        ]
    if ours.skipped:
        out["skipped"] = ours.skipped
    return out


def print_table(comparisons: list[dict], greedy_tokens: int) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print("| file | ours | ours ppl | llama.cpp ppl | ours / llama.cpp - 1 | greedy equal |")
    print("|---|---|---|---|---|---|")
    for c in comparisons:
        diff = "-" if "diff_pct" not in c else f"{c['diff_pct']:+.3f}%"
        if "within_target" in c:
            diff += f" ({'within' if c['within_target'] else 'OUTSIDE'} {c['target_pct']}%)"
        eq = c.get("greedy_leading_equal")
        greedy = "-" if eq is None else " ".join(map(str, eq)) + f" / {greedy_tokens}"
        ours = fmt(c["ours_ppl"], ".4f") if "skipped" not in c else "skipped"
        print(
            f"| {c['precision']} | {c['ours']} | {ours} | {fmt(c['llamacpp_ppl'], '.4f')} |"
            f" {diff} | {greedy} |"
        )
    for c in comparisons:
        if "skipped" in c:
            print(f"  {c['precision']} {c['ours']}: {c['skipped']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=TEXT)
    p.add_argument("--precisions", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=None, help="default: the window")
    p.add_argument("--max-tokens", type=int, default=None, help="only the text's first N")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--sides", nargs="+", default=["llamacpp", "ours"])
    p.add_argument(
        "--ours-quant-options",
        default='{"quantization": "gguf"}',
        help="JSON: cr.LLM options that keep a GGUF file's weights quantized",
    )
    p.add_argument("--ours-quant-dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--llamacpp-threads", type=int, default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results", "perplexity.json"))
    return p.parse_args()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # workers are stopped on the way out
    args = parse_args()
    stride = args.stride or args.window
    tokenizer_file = install.our_gguf()
    tok = tokenizer_of(tokenizer_file)
    with open(args.text) as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"]
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    windows = make_windows(len(ids), args.window, stride)
    greedy_prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in GREEDY_PROMPTS]
    greedy = [[p, args.greedy_tokens] for p in greedy_prompts]
    longest = max(args.window, max(len(p) for p in greedy_prompts) + args.greedy_tokens)
    log(f"{len(ids)} tokens, {len(windows)} windows of {args.window} every {stride}")
    lcpp_options: dict = {"logits_all": True, "n_ctx": longest, "n_batch": longest}
    if args.llamacpp_threads:
        lcpp_options |= {
            "n_threads": args.llamacpp_threads,
            "n_threads_batch": args.llamacpp_threads,
        }
    quant_options = json.loads(args.ours_quant_options)

    rows: list[Row] = []
    comparisons: list[dict] = []
    for precision in args.precisions:
        model = install.gguf_path(FILE_KIND[precision])
        ref = None
        if "llamacpp" in args.sides:
            run_as = precision if precision in ("fp32", "bf16") else "fp32"  # not read there
            ref = run_side(
                Row("llamacpp", precision, precision, model, lcpp_options),
                run_as,
                windows,
                ids,
                greedy,
            )
            rows.append(ref)
        if "ours" in args.sides:
            for label, dtype, options in ours_variants(
                precision, quant_options, args.ours_quant_dtype
            ):
                row = run_side(
                    Row("ours", precision, label, model, options), dtype, windows, ids, greedy
                )
                rows.append(row)
                comparisons.append(compare(row, ref))
        elif ref is not None:
            comparisons.append(
                {"precision": precision, "ours": "-", "ours_ppl": None, "llamacpp_ppl": ref.ppl}
            )

    print(
        f"\nSmolLM2-135M-Instruct, {os.path.relpath(args.text, ROOT)}: {len(ids)} tokens, "
        f"{len(windows)} windows of {args.window} every {stride}, "
        f"{len(scored_nll(windows, [[0.0] * (w.end - w.start - 1) for w in windows]))} "
        "scored; greedy: "
        f"{len(greedy)} prompts x {args.greedy_tokens} tokens (identical leading tokens)\n"
    )
    print_table(comparisons, args.greedy_tokens)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "text": os.path.relpath(args.text, ROOT),
                "tokenizer": tokenizer_file,
                "num_tokens": len(ids),
                "window": args.window,
                "stride": stride,
                "windows": [asdict(w) for w in windows],
                "greedy_prompts": GREEDY_PROMPTS,
                "greedy_tokens": args.greedy_tokens,
                "comparisons": comparisons,
                "rows": [asdict(r) for r in rows],
            },
            f,
            indent=1,
        )
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
