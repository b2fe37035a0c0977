"""Decode-step latency on a GPU: our CUDA-graph modes vs eager vs transformers' reduce-overhead.

The ~33M-parameter Llama of ``llama_33m.py`` (random weights, built locally,
float32 on every side), greedy decoding. For each configuration, the median
milliseconds of one decode step at batch 1, 8 and 64 (``--batch-sizes``),
side by side in one run:

* ``eager``: ``cr.LLM`` with mode ``NONE`` and cudagraph_mode ``NONE`` (no compile, no
  graphs; mode ``NONE`` alone would still capture FULL graphs on a GPU);
* ``piecewise``, ``full``, ``full_and_piecewise``: ``cr.LLM`` with mode
  ``PIECEWISE`` (Inductor) and that ``cudagraph_mode`` (``FULL_AND_PIECEWISE``
  is the default), graphs captured at ``CAPTURE_SIZES`` up to the largest batch;
* ``hf_reduce_overhead``: transformers' own model on the same weights, static
  cache, ``model.forward = torch.compile(model.forward, mode="reduce-overhead",
  fullgraph=True)`` (generate's automatic compile turned off, so that is the
  only compile).

Ours: ``batch`` prompts of 16 token ids decode together for ``--max-tokens``
tokens (``ignore_eos``; one warm-up call of 4 tokens first); the figure is the
median of ``GenerateStats.decode_step_seconds``, the wall time of each engine
step in which every request decoded one token (scheduling, the forward, the
sampled tokens back on the host). transformers: two greedy ``generate`` calls
of the same batch with ``--max-tokens`` and a quarter of it new tokens, the
static cache the same size in both (so nothing recompiles); the figure is the
difference of their median times (``--repeats`` each, after one untimed call of
each that compiles) over the extra tokens, so the prefill cancels out. Each
configuration's tokens are compared with ``eager``'s (reported, never hidden).

Results are written to JSON after every measurement, so a run cut short (or
stopped by SIGTERM: the table of what was measured is still printed) keeps what
it measured. One configuration failing (e.g. a FULL capture) is recorded with
its error and the others still run; the exit status is 1 if any failed (124 if
stopped).

Left out: start-up cost in the figures (reported apart: ``cr.LLM`` construction,
which compiles and captures; transformers' load plus its compiling first calls),
prefill and mixed steps, sampling other than greedy, EOS, bf16/fp16, and any
model but this one. On a CPU (``--device cpu``, a smoke test) the graph modes
resolve to ``NONE`` and ``hf_reduce_overhead`` is skipped (CUDA graphs).

    python benchmarks/gpu_decode.py [--device cuda|cpu] [--configs eager piecewise ...]
        [--batch-sizes 1 8 64] [--max-tokens 64] [--repeats 3] [--backend inductor|eager]
        [--out benchmarks/results/gpu_decode.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import repo_root  # noqa: F401  (testing/ on the path)
import torch
import transformers
from llama_33m import MODEL
from vs_transformers import PROMPT_LEN, HFSide, Request, Row, equal_workload

import compile_runtime as cr
from testing.model_dirs import make_model_dir

ROOT = Path(__file__).resolve().parent.parent
OURS = {
    # cudagraph_mode too: with mode NONE alone, the default FULL_AND_PIECEWISE resolves to
    # FULL graphs of the uncompiled model on a GPU.
    "eager": {"mode": "NONE", "cudagraph_mode": "NONE"},
    "piecewise": {"mode": "PIECEWISE", "cudagraph_mode": "PIECEWISE"},
    "full": {"mode": "PIECEWISE", "cudagraph_mode": "FULL"},
    "full_and_piecewise": {"mode": "PIECEWISE", "cudagraph_mode": "FULL_AND_PIECEWISE"},
}
HF = "hf_reduce_overhead"
CONFIGS = [*OURS, HF]
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
WARMUP_TOKENS = 4
LEFT_OUT = [
    "start-up (reported apart, not in the figures)",
    "prefill and mixed steps",
    "sampling other than greedy, stopping at EOS",
    "bf16/fp16 (float32 on every side)",
]


class Stopped(BaseException):
    """SIGTERM (the caller's time budget): not an error of the configuration being run."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(f"signal {signum}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per timed call")
    p.add_argument("--repeats", type=int, default=3, help="timed transformers calls of each length")
    p.add_argument(
        "--backend",
        default="inductor",
        choices=["inductor", "eager"],
        help="our compiled configs' backend (eager: a quick smoke test)",
    )
    p.add_argument("--model-dir", default=str(ROOT / ".demo" / "llama-33m"))
    p.add_argument("--cache-dir", default=None, help="compile cache (default: a fresh temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_decode.json"))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.max_tokens < 8:
        p.error("--max-tokens must be >= 8 (the transformers side needs two lengths)")
    args.configs = [c for c in CONFIGS if c in args.configs]  # eager first: the reference
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of the largest batch prefills in one step; every request fits."""
    largest = max(args.batch_sizes)
    return dict(
        max_num_seqs=max(64, largest),
        max_num_batched_tokens=max(512, largest * PROMPT_LEN),
        max_model_len=max(128, PROMPT_LEN + args.max_tokens),
        device=args.device,
        dtype="float32",  # as transformers' side; "auto" would pick bf16 on a GPU
    )


def compilation_config(name: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    config = {**OURS[name], "cache_dir": cache_dir}
    if config["mode"] != "NONE":
        largest = max(args.batch_sizes)
        sizes = {s for s in CAPTURE_SIZES if s <= largest} | set(args.batch_sizes)
        config |= {"backend": args.backend, "cudagraph_capture_sizes": sorted(sizes)}
    return config


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


class Report:
    """Every configuration's results; written to JSON after each measurement."""

    def __init__(self, args: argparse.Namespace, engine: dict[str, Any]):
        self.args = args
        self.engine = engine
        self.configs: dict[str, dict[str, Any]] = {}
        self.reference: dict[int, list[list[int]]] = {}  # eager's tokens per batch
        self.notes: list[str] = []

    def start(self, name: str, **fields: Any) -> dict[str, Any]:
        self.configs[name] = {"status": "running", "decode_ms": {}, "tokens_match_eager": {}}
        self.configs[name].update(fields)
        self.write()
        return self.configs[name]

    def record(self, name: str, batch: int, ms: float, tokens: list[list[int]]) -> None:
        entry = self.configs[name]
        ms = entry["decode_ms"][str(batch)] = round(ms, 4)
        if name == "eager":
            self.reference[batch] = tokens
        elif batch in self.reference:
            same = sum(a == b for a, b in zip(tokens, self.reference[batch], strict=True))
            entry["tokens_match_eager"][str(batch)] = f"{same}/{len(tokens)}"
        print(f"# {name} batch {batch}: {ms:.3f} ms/step", file=sys.stderr, flush=True)
        self.write()

    def finish(self, name: str, status: str, error: str | None = None) -> None:
        self.configs[name]["status"] = status
        if error is not None:
            self.configs[name]["error"] = error
        self.write()

    @property
    def failed(self) -> list[str]:
        return [n for n, c in self.configs.items() if c["status"] not in ("ok", "skipped")]

    def write(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if self.args.device == "cuda" else "cpu"
        data = {
            "model": MODEL,
            "device": device,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "args": vars(self.args),
            "engine": self.engine,
            "configs": self.configs,
            "notes": self.notes,
            "left_out": LEFT_OUT,
        }
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, out)  # a reader never sees half a file

    def print_tables(self) -> None:
        names = list(self.configs)
        device = torch.cuda.get_device_name() if self.args.device == "cuda" else "CPU"
        print(
            f"### decode step, median ms (speed-up over eager): Llama ~33M float32, {device}, "
            f"{self.args.max_tokens} new tokens\n"
        )
        print("| batch | " + " | ".join(names) + " |")
        print("|" + "---|" * (len(names) + 1))
        eager = self.configs.get("eager", {}).get("decode_ms", {})
        for batch in self.args.batch_sizes:
            cells = []
            for name in names:
                ms = self.configs[name]["decode_ms"].get(str(batch))
                if ms is None:
                    cells.append("-")
                elif name != "eager" and eager.get(str(batch)):
                    cells.append(f"{ms:.3f} ({eager[str(batch)] / ms:.2f}x)")
                else:
                    cells.append(f"{ms:.3f}")
            print(f"| {batch} | " + " | ".join(cells) + " |")
        print()
        print("| config | cudagraph mode | attention | start-up s | tokens = eager | status |")
        print("|---|---|---|---|---|---|")
        for name, c in self.configs.items():
            match = ", ".join(f"b{b}: {m}" for b, m in c["tokens_match_eager"].items())
            status = c["status"] + (f": {c['error']}" if c.get("error") else "")
            attention = ", ".join(c.get("attention", [])) or "-"
            print(
                f"| {name} | {c.get('cudagraph_mode', '-')} | {attention} "
                f"| {c.get('startup_s', '-')} | {match or '-'} | {status} |"
            )
        for note in self.notes:
            print(f"\n{note}")
        print(f"\nwrote {self.args.out}")


def run_ours(name: str, args: argparse.Namespace, model_dir: str, cache_dir: str, report: Report):
    torch._dynamo.reset()  # no configuration inherits another's compiled frames
    config = compilation_config(name, args, cache_dir)
    entry = report.start(name, compilation_config=config)
    start = time.perf_counter()
    llm = cr.LLM(model_dir, config, **report.engine)
    try:
        entry["startup_s"] = round(time.perf_counter() - start, 2)
        try:
            runner = llm.runner
            entry["cudagraph_mode"] = runner.cudagraph_plan.cudagraph_mode.name
            entry["attention"] = sorted({layer.attn_backend.name for layer in runner.layers})
        except AttributeError:  # runners in worker processes, or renamed internals
            pass
        try:  # where start-up went (compile, capture, ...), in the engine's own words
            entry["startup_detail"] = llm.startup.summary()
        except AttributeError:
            pass
        report.write()
        for batch, row in zip(
            args.batch_sizes, equal_workload(args.batch_sizes, args.max_tokens).rows, strict=True
        ):
            prompts = [r.prompt for r in row.requests]
            warm = cr.SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
            llm.generate(prompts, warm, use_tqdm=False)
            params = cr.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            steps = llm.last_stats.decode_step_seconds
            if not steps:
                raise RuntimeError(f"batch {batch}: no step decoded every request at once")
            ms = 1000 * statistics.median(steps)
            report.record(name, batch, ms, [o.outputs[0].token_ids for o in outputs])
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)


def run_hf(args: argparse.Namespace, model_dir: str, report: Report) -> None:
    torch._dynamo.reset()
    entry = report.start(HF, cudagraph_mode="reduce-overhead")
    warmup_s = 0.0  # start-up: the load, then the untimed calls that compile
    side = HFSide(HF, model_dir, True, device=args.device, compile_mode="reduce-overhead")
    short = max(2, args.max_tokens // 4)
    try:
        for long_row in equal_workload(args.batch_sizes, args.max_tokens).rows:
            batch = len(long_row.requests)
            short_row = Row(
                long_row.label,
                [Request(r.prompt, short) for r in long_row.requests],
                long_row.hf_batch,
                long_row.cache_len,  # the same static cache as the long call: no recompile
                long_row.floor_batch,
            )
            warm = time.perf_counter()
            side.run(short_row)  # compiles (prefill and decode shapes of this batch)
            side.run(long_row)
            warmup_s += time.perf_counter() - warm
            entry["startup_s"] = round(side.build_s + warmup_s, 2)
            times: dict[int, list[float]] = {short: [], args.max_tokens: []}
            for _ in range(args.repeats):
                for row in (short_row, long_row):
                    run = side.run(row)  # ends with the tokens on the host: synchronized
                    times[row.requests[0].max_tokens].append(run.seconds)
            extra = args.max_tokens - short
            ms = 1000 * (
                statistics.median(times[args.max_tokens]) - statistics.median(times[short])
            )
            report.record(HF, batch, ms / extra, run.tokens)
    finally:
        side.close()
        del side
        free_memory(args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available (--device cpu for a smoke test)")
    signal.signal(signal.SIGTERM, _stop)
    model_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    report = Report(args, engine_kwargs(args))
    cache = tempfile.TemporaryDirectory() if args.cache_dir is None else None
    cache_dir = args.cache_dir or cache.name
    stopped = False
    try:
        for name in args.configs:
            if name == HF and args.device != "cuda":
                report.start(name)
                report.finish(name, "skipped", "reduce-overhead captures CUDA graphs: needs CUDA")
                continue
            print(f"# {name} ...", file=sys.stderr, flush=True)
            try:
                if name == HF:
                    run_hf(args, model_dir, report)
                else:
                    run_ours(name, args, model_dir, cache_dir, report)
            except Exception as e:  # one configuration failing must not hide the others
                traceback.print_exc()
                report.finish(
                    name, "error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                )
            else:
                report.finish(name, "ok")
    except (Stopped, KeyboardInterrupt) as e:
        stopped = True
        running = [n for n, c in report.configs.items() if c["status"] == "running"]
        for name in running:
            report.finish(name, "stopped")
        report.notes.append(
            f"stopped ({e or 'interrupted'}) during {', '.join(running) or 'set-up'}; "
            f"not run: {', '.join(n for n in args.configs if n not in report.configs) or '-'}"
        )
        report.write()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        report.print_tables()
        if cache is not None:
            cache.cleanup()
    if stopped:
        return 124
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
