"""Decode-step latency on a GPU: our CUDA-graph modes vs eager vs transformers' reduce-overhead.

The ~33M-parameter Llama of ``llama_33m.py`` (random weights, built locally,
``--dtype``, float32 by default, on every side), greedy decoding. For each
configuration, the median milliseconds of one decode step at batch 1, 8 and 64
(``--batch-sizes``), side by side in one run:

* ``eager``: ``cr.LLM`` with mode ``NONE`` and cudagraph_mode ``NONE`` (no compile, no
  graphs; mode ``NONE`` alone would still capture FULL graphs on a GPU);
* ``piecewise``, ``full``, ``full_and_piecewise``: ``cr.LLM`` with mode
  ``PIECEWISE`` (``--backend``, Inductor by default) and that ``cudagraph_mode``
  (``FULL_AND_PIECEWISE`` is the default), graphs captured at ``CAPTURE_SIZES`` up to
  the largest batch;
* ``hf_reduce_overhead`` (the anchor): transformers' own model on the same weights, a
  static cache, and a plain greedy decode loop whose step (the forward and the argmax)
  is ``torch.compile(mode="reduce-overhead", fullgraph=True)``:
  ``torch.compiler.cudagraph_mark_step_begin()`` before each step and the step's tokens
  cloned out of the graph's memory (``generate`` under reduce-overhead read outputs its
  next replay had overwritten). On a CPU there are no CUDA graphs: the same loop runs
  compiled with ``--backend`` and no graphs (the code path, not a figure).

``--attention-backends torch_native triton flashinfer`` runs each of our configurations
once per attention backend (named ``config/backend``); FlashInfer runs in half precision
only (``--dtype bfloat16``). A backend that cannot run a mode is downgraded by the engine:
the table gives the mode each resolved to.

Ours: ``batch`` prompts of 16 token ids decode together for ``--max-tokens``
tokens (``ignore_eos``; one warm-up call of 4 tokens first); the figure is the
median of ``GenerateStats.decode_step_seconds``, the wall time of each engine
step in which every request decoded one token (scheduling, the forward, the
sampled tokens back on the host). The anchor: one untimed run of the loop per batch
(it compiles and records the graph), then ``--repeats`` timed runs; the figure is the
median wall time of its decode steps, each ending with the tokens on the host.

Each configuration's tokens are compared with its reference's: ``eager`` of the same
attention backend where that ran, else the first configuration of that backend (the
anchor's: ``eager``), and with the first backend's same configuration (reported, never
hidden). ``--check-tokens`` makes a difference from the reference an error (exit 1).

Results are written to JSON after every measurement, so a run cut short (or
stopped by SIGTERM: the table of what was measured is still printed) keeps what
it measured. One configuration failing (e.g. a FULL capture) is recorded with
its error and the others still run; the exit status is 1 if any failed (124 if
stopped).

Left out: start-up cost in the figures (reported apart: ``cr.LLM`` construction,
which compiles and captures; the anchor's load plus its compiling first run),
prefill and mixed steps, sampling other than greedy, EOS, and any model but this one.
On a CPU (``--device cpu``, a smoke test) the graph modes resolve to ``NONE``.

    python benchmarks/gpu_decode.py [--device cuda|cpu] [--configs eager piecewise ...]
        [--batch-sizes 1 8 64] [--max-tokens 64] [--repeats 3] [--backend inductor|eager]
        [--dtype float32|float16|bfloat16] [--attention-backends triton flashinfer ...]
        [--check-tokens] [--out benchmarks/results/gpu_decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import repo_root  # noqa: F401  (testing/ on the path)
import torch
import transformers
from llama_33m import MODEL
from vs_transformers import PROMPT_LEN, equal_workload

import compile_runtime as cr
from compile_runtime.attention.selector import ENV_VAR as ATTENTION_ENV
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
ATTENTION_BACKENDS = ["torch_native", "triton", "flashinfer", "cpu_batched"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
WARMUP_TOKENS = 4
LEFT_OUT = [
    "start-up (reported apart, not in the figures)",
    "prefill and mixed steps",
    "sampling other than greedy, stopping at EOS",
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
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the anchor's loop")
    p.add_argument(
        "--backend",
        default="inductor",
        choices=["inductor", "eager"],
        help="our compiled configs' backend, and the anchor's on a CPU (eager: a smoke test)",
    )
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="every side's")
    p.add_argument(
        "--attention-backends",
        nargs="+",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="run each of our configs once per attention backend (default: the engine's choice)",
    )
    p.add_argument(
        "--check-tokens",
        action="store_true",
        help="a configuration whose greedy tokens differ from its reference's is an error",
    )
    p.add_argument("--model-dir", default=str(ROOT / ".demo" / "llama-33m"))
    p.add_argument("--cache-dir", default=None, help="compile cache (default: a fresh temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_decode.json"))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.max_tokens < 8:
        p.error("--max-tokens must be >= 8")
    args.configs = [c for c in CONFIGS if c in args.configs]  # eager first: the reference
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def runs(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(label, config, attention backend) in the order they run: backend by backend, eager
    first in each, the anchor last."""
    ours = [c for c in args.configs if c in OURS]
    out = []
    for backend in args.attention_backends or [None]:
        out += [(c if backend is None else f"{c}/{backend}", c, backend) for c in ours]
    if HF in args.configs:
        out.append((HF, HF, None))
    return out


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of the largest batch prefills in one step; every request fits."""
    largest = max(args.batch_sizes)
    return dict(
        max_num_seqs=max(64, largest),
        max_num_batched_tokens=max(512, largest * PROMPT_LEN),
        max_model_len=max(128, PROMPT_LEN + args.max_tokens),
        device=args.device,
        dtype=args.dtype,  # explicit: "auto" would pick bf16 for float32 weights on a GPU
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


@contextlib.contextmanager
def attention_backend(name: str | None) -> Iterator[None]:
    """The engine's attention backend while it starts (None: its own choice)."""
    previous = os.environ.get(ATTENTION_ENV)
    if name is not None:
        os.environ[ATTENTION_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ATTENTION_ENV, None)
        else:
            os.environ[ATTENTION_ENV] = previous


class Report:
    """Every configuration's results; written to JSON after each measurement."""

    def __init__(self, args: argparse.Namespace, engine: dict[str, Any]):
        self.args = args
        self.engine = engine
        self.configs: dict[str, dict[str, Any]] = {}
        self.tokens: dict[str, dict[int, list[list[int]]]] = {}  # per label, per batch
        self.notes: list[str] = []

    def start(self, name: str, **fields: Any) -> dict[str, Any]:
        self.configs[name] = {"status": "running", "decode_ms": {}, "tokens_match": {}}
        self.configs[name].update(fields)
        self.write()
        return self.configs[name]

    def record(self, name: str, batch: int, ms: float, tokens: list[list[int]]) -> None:
        entry = self.configs[name]
        ms = entry["decode_ms"][str(batch)] = round(ms, 4)
        self.tokens.setdefault(name, {})[batch] = tokens
        for role in ("reference", "first_backend"):
            other = entry.get(role)
            theirs = self.tokens.get(other, {}).get(batch) if other else None
            if theirs is not None and other != name:
                same = sum(a == b for a, b in zip(tokens, theirs, strict=True))
                entry["tokens_match"].setdefault(other, {})[str(batch)] = f"{same}/{len(tokens)}"
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

    def token_differences(self) -> list[str]:
        """Each configuration and batch whose tokens differ from its reference's."""
        out = []
        for name, c in self.configs.items():
            for batch, match in c["tokens_match"].get(c.get("reference"), {}).items():
                same, total = match.split("/")
                if same != total:
                    out.append(f"{name} batch {batch}: {match} requests = {c['reference']}")
        return out

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
            f"### decode step, median ms (speed-up over its reference): Llama ~33M "
            f"{self.args.dtype}, {device}, {self.args.max_tokens} new tokens\n"
        )
        print("| batch | " + " | ".join(names) + " |")
        print("|" + "---|" * (len(names) + 1))
        for batch in self.args.batch_sizes:
            cells = []
            for name in names:
                c = self.configs[name]
                ms = c["decode_ms"].get(str(batch))
                ref = self.configs.get(c.get("reference"), {}).get("decode_ms", {}).get(str(batch))
                if ms is None:
                    cells.append("-")
                elif c.get("reference") != name and ref:
                    cells.append(f"{ms:.3f} ({ref / ms:.2f}x)")
                else:
                    cells.append(f"{ms:.3f}")
            print(f"| {batch} | " + " | ".join(cells) + " |")
        print()
        print("| config | cudagraph mode | attention | start-up s | tokens equal | status |")
        print("|---|---|---|---|---|---|")
        for name, c in self.configs.items():
            match = "; ".join(
                f"= {other}: " + ", ".join(f"b{b} {m}" for b, m in per_batch.items())
                for other, per_batch in c["tokens_match"].items()
            )
            status = c["status"] + (f": {c['error']}" if c.get("error") else "")
            attention = ", ".join(c.get("attention", [])) or "-"
            print(
                f"| {name} | {c.get('cudagraph_mode', '-')} | {attention} "
                f"| {c.get('startup_s', '-')} | {match or '-'} | {status} |"
            )
        for note in self.notes:
            print(f"\n{note}")
        print(f"\nwrote {self.args.out}")


def run_ours(
    label: str,
    name: str,
    backend: str | None,
    args: argparse.Namespace,
    model_dir: str,
    cache_dir: str,
    report: Report,
) -> None:
    torch._dynamo.reset()  # no configuration inherits another's compiled frames
    config = compilation_config(name, args, cache_dir)
    entry = report.configs[label]
    entry["compilation_config"] = config
    start = time.perf_counter()
    with attention_backend(backend):
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
            report.record(label, batch, ms, [list(o.outputs[0].token_ids) for o in outputs])
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)


class Anchor:
    """transformers' model, a static cache and a greedy loop whose decode step is compiled:
    reduce-overhead (CUDA graphs) on a GPU, ``--backend`` without graphs on a CPU."""

    def __init__(self, model_dir: str, args: argparse.Namespace):
        self.device = torch.device(args.device)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[args.dtype]
        )
        self.model = model.to(self.device).eval()
        params = inspect.signature(self.model.forward).parameters
        # transformers renamed past_key_values to cache, and dropped cache_position (the
        # static cache counts its own length): whichever this version takes.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        if args.device == "cuda":
            self.mode = "reduce-overhead"
            self.step = torch.compile(
                self._greedy, mode="reduce-overhead", fullgraph=True, dynamic=False
            )
        else:
            self.mode = f"torch.compile backend={args.backend}, no CUDA graphs (CPU)"
            self.step = torch.compile(
                self._greedy, backend=args.backend, fullgraph=True, dynamic=False
            )
        self.cache_len = PROMPT_LEN + args.max_tokens + 1
        self.caches: dict[int, Any] = {}

    def _greedy(self, ids: torch.Tensor, positions: torch.Tensor, cache_position, cache):
        kwargs = {self.cache_arg: cache, "use_cache": True}
        if self.cache_position:
            kwargs["cache_position"] = cache_position
        logits = self.model(input_ids=ids, position_ids=positions, **kwargs).logits
        return logits[:, -1, :].argmax(-1)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list, list[float]]:
        """Greedy tokens per request and the seconds of each decode step (tokens on the host)."""
        batch, length = len(prompts), len(prompts[0])
        cache = self.caches.get(batch)
        if cache is None:  # one per batch size: its addresses stay those the graph recorded
            cache = self.caches[batch] = transformers.StaticCache(
                config=self.model.config, max_cache_len=self.cache_len
            )
        cache.reset()  # in place
        ids = torch.tensor(prompts, device=self.device)
        positions = torch.arange(length, device=self.device).expand(batch, length)
        # The prefill eagerly: the cache is made there, its tensors marked static.
        token = self._greedy(ids, positions, torch.arange(length, device=self.device), cache)
        columns, seconds = [token.tolist()], []
        for pos in range(length, length + max_tokens - 1):
            start = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are done with
            position = torch.full((batch, 1), pos, device=self.device)
            cache_position = torch.tensor([pos], device=self.device)
            token = self.step(token[:, None], position, cache_position, cache).clone()
            columns.append(token.tolist())
            seconds.append(time.perf_counter() - start)
        return [list(row) for row in zip(*columns, strict=True)], seconds


def run_anchor(args: argparse.Namespace, model_dir: str, report: Report) -> None:
    torch._dynamo.reset()
    entry = report.configs[HF]
    start = time.perf_counter()
    anchor = Anchor(model_dir, args)
    startup = time.perf_counter() - start  # the load, then each batch's compiling first run
    entry["cudagraph_mode"] = anchor.mode
    entry["attention"] = [getattr(anchor.model.config, "_attn_implementation", None) or "-"]
    try:
        for batch, row in zip(
            args.batch_sizes, equal_workload(args.batch_sizes, args.max_tokens).rows, strict=True
        ):
            prompts = [r.prompt for r in row.requests]
            start = time.perf_counter()
            anchor.generate(prompts, args.max_tokens)  # compiles and records this batch's graph
            startup += time.perf_counter() - start
            entry["startup_s"] = round(startup, 2)
            steps: list[float] = []
            for _ in range(args.repeats):
                tokens, seconds = anchor.generate(prompts, args.max_tokens)
                steps += seconds
            report.record(HF, batch, 1000 * statistics.median(steps), tokens)
    finally:
        del anchor
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
    plan = runs(args)
    labels = [label for label, _, _ in plan]
    first_backend = (args.attention_backends or [None])[0]
    stopped = False
    try:
        for label, name, backend in plan:
            # The reference: eager of the same backend, else that backend's first config.
            same = [lb for lb, _, b in plan if b == backend and lb != HF]
            eager = next((lb for lb, c, b in plan if c == "eager" and b == backend), None)
            reference = eager or (same[0] if same else labels[0])
            fields = {"reference": reference, "attention_backend": backend}
            if backend is not None and backend != first_backend:
                fields["first_backend"] = f"{name}/{first_backend}"
            report.start(label, **fields)
            print(f"# {label} ...", file=sys.stderr, flush=True)
            try:
                if name == HF:
                    run_anchor(args, model_dir, report)
                else:
                    run_ours(label, name, backend, args, model_dir, cache_dir, report)
            except Exception as e:  # one configuration failing must not hide the others
                traceback.print_exc()
                report.finish(
                    label, "error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                )
            else:
                report.finish(label, "ok")
    except (Stopped, KeyboardInterrupt) as e:
        stopped = True
        running = [n for n, c in report.configs.items() if c["status"] == "running"]
        for name in running:
            report.finish(name, "stopped")
        report.notes.append(
            f"stopped ({e or 'interrupted'}) during {', '.join(running) or 'set-up'}; "
            f"not run: {', '.join(n for n in labels if n not in report.configs) or '-'}"
        )
        report.write()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        differences = report.token_differences()
        if args.check_tokens and differences:
            report.notes.append("tokens differ (--check-tokens): " + "; ".join(differences))
            report.write()
        report.print_tables()
        if cache is not None:
            cache.cleanup()
    if stopped:
        return 124
    if args.check_tokens and differences:
        return 1
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
