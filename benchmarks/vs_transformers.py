"""Side by side with transformers: generation tokens/s on the same weights and prompts, one run.

The ~33M-parameter Llama of ``llama_33m.py`` (random weights, built locally),
greedy decoding, on every side:

* ``hf_eager``: transformers ``generate`` with its default dynamic cache;
* ``hf_static_compile``: transformers with a static cache and
  ``model.forward = torch.compile(model.forward, fullgraph=True)``, as its
  docs describe (default mode: "reduce-overhead" means CUDA graphs);
* ``ours_none``, ``ours_stock``, ``ours_piecewise``: ``cr.LLM`` with mode
  ``NONE``, ``STOCK_TORCH_COMPILE`` and ``PIECEWISE`` (inductor);
* ``floor``: only the model's matmuls of one decode step (every layer's
  q, k, v, o, gate, up, down weights and the lm_head through ``F.linear`` on a
  ``[batch, hidden]`` activation, best of several timings), as tokens/s: what
  the hardware allows with no attention, norms or runtime at all.

Workloads: (a) ``--batches`` equal prompts of 16 token ids, ``--max-tokens``
new tokens each, one ``generate`` call per batch on every side (no padding);
(b) ``mixed``: 64 requests, prompt lengths uniform in 8..200 and output lengths
in 8..128 (``random.Random(0)``); transformers runs them in arrival order in
batches of 8 with left padding, each batch generating its longest requested
output, while we run all 64 at once (continuous batching). tokens/s counts only
the tokens each request asked for, over the wall time of the generate calls
(prefill included). Every side is warmed up on the workload's shapes first
(compilation happens there and is reported separately), then ``--repeats``
rounds run every side once in turn and each side keeps its best. Greedy
tokens are compared with ``hf_eager`` and mismatches are printed, never
hidden. ``--cotenancy`` also times workload (a) at batch 1 and 8 while busy
processes hold every core, at the default and at ``--cotenancy-threads``
thread counts.

    python benchmarks/vs_transformers.py [--quick] [--configs hf_eager ours_piecewise ...]
        [--batches 1 8 32] [--max-tokens 64] [--repeats 2] [--workloads a b] [--threads N]
        [--cotenancy] [--cotenancy-threads 1] [--out benchmarks/results/vs_transformers.json]

Left out: tokenization and detokenization (prompts are token ids), sampling
other than greedy, stopping at EOS (EOS is an ordinary token on every side),
transformers' own continuous batching (``generate_batch``), the floor of the
mixed workload (its decode batch varies step to step), and GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import repo_root  # noqa: F401  (testing/ on the path)
import torch
import torch.nn.functional as F
import transformers
from llama_33m import MODEL
from transformers import AutoModelForCausalLM

import compile_runtime as cr
from testing.model_dirs import make_model_dir

OURS = {
    "ours_none": {"mode": "NONE"},
    "ours_stock": {"mode": "STOCK_TORCH_COMPILE"},
    "ours_piecewise": {"mode": "PIECEWISE", "backend": "inductor"},
}
HF = {"hf_eager": False, "hf_static_compile": True}  # name -> static cache + torch.compile
CONFIGS = [*HF, *OURS, "floor"]
PROMPT_LEN = 16
MIXED_REQUESTS = 64
HF_MIXED_BATCH = 8
WARMUP_TOKENS = 4  # prefill plus a few decode steps: enough to compile every shape
PAD = 0  # prompts use ids >= 3, so the pad id never appears in a prompt
LEFT_OUT = [
    "tokenization and detokenization (prompts are token ids)",
    "sampling other than greedy",
    "stopping at EOS (EOS is an ordinary token on every side)",
    "transformers' continuous batching (generate_batch)",
    "the floor of the mixed workload (its decode batch varies step to step)",
    "GPUs (CPU only)",
]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Row:
    """One timed unit of a workload: the requests every side generates for."""

    label: str
    requests: list[Request]
    hf_batch: int  # transformers runs the requests in groups of this size
    cache_len: int  # longest prompt + output: the static cache size, fixed so it compiles once
    floor_batch: int | None  # decode batch of the matmul floor; None where it varies

    @property
    def useful_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def warmup(self) -> Row:
        """The same shapes with a few new tokens: compiles without costing a full run."""
        short = [Request(r.prompt, min(r.max_tokens, WARMUP_TOKENS)) for r in self.requests]
        return Row(self.label, short, self.hf_batch, self.cache_len, self.floor_batch)


@dataclass(frozen=True)
class Workload:
    name: str
    rows: list[Row]
    exact: bool  # no padding on any side: every token is expected to match hf_eager


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    decode_ms: float | None = None  # median decode step (ours only)


def equal_workload(batches: Sequence[int], max_tokens: int) -> Workload:
    vocab = MODEL["vocab_size"]
    rows = []
    for b in batches:
        prompts = [
            [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(PROMPT_LEN)] for i in range(b)
        ]
        requests = [Request(p, max_tokens) for p in prompts]
        rows.append(Row(str(b), requests, b, PROMPT_LEN + max_tokens, b))
    return Workload("a", rows, exact=True)


def mixed_workload(n: int) -> Workload:
    rng = random.Random(0)
    requests = []
    for _ in range(n):
        prompt_len, out_len = rng.randint(8, 200), rng.randint(8, 128)
        prompt = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(prompt_len)]
        requests.append(Request(prompt, out_len))
    cache_len = max(len(r.prompt) + r.max_tokens for r in requests)
    return Workload("b", [Row("mixed", requests, HF_MIXED_BATCH, cache_len, None)], exact=False)


class HFSide:
    """transformers ``generate``, greedy; EOS is an ordinary token, as ``ignore_eos`` is for us."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        static: bool,
        *,
        device: str = "cpu",
        compile_mode: str | None = None,
    ):
        """``compile_mode``: torch.compile's ``mode`` for the static side (None: its default)."""
        self.name = name
        self.static = static
        self.device = torch.device(device)
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = self.model.to(self.device).eval()
        self.model.generation_config.eos_token_id = None  # every request runs to its length
        if static:
            self.model.generation_config.cache_implementation = "static"
            # Only the compile below: not also generate's own automatic one (CUDA, static cache).
            self.model.generation_config.disable_compile = True
            self.model.forward = torch.compile(
                self.model.forward, fullgraph=True, mode=compile_mode
            )
        self.build_s = time.perf_counter() - start
        self.compile_s: float | None = None

    def run(self, row: Row) -> Run:
        start = time.perf_counter()
        tokens: list[list[int]] = []
        for i in range(0, len(row.requests), row.hf_batch):
            tokens += self._generate(row.requests[i : i + row.hf_batch], row.cache_len)
        return Run(tokens, time.perf_counter() - start)

    def _generate(self, group: list[Request], cache_len: int) -> list[list[int]]:
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor(
            [[PAD] * (width - len(r.prompt)) + r.prompt for r in group], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group], device=self.device
        )
        if self.static:  # one cache size for warm-up and timed runs, so no recompile
            self.model.generation_config.max_cache_len = cache_len
        out = self.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(r.max_tokens for r in group),
            do_sample=False,
            pad_token_id=PAD,
        )
        return [out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(group)]

    def close(self) -> None:
        pass


class OursSide:
    """``cr.LLM`` with a fresh compile cache, so start-up includes compiling."""

    def __init__(self, name: str, model_dir: str, config: dict, engine: dict):
        self.name = name
        self._cache = tempfile.TemporaryDirectory()
        start = time.perf_counter()
        self.llm = cr.LLM(model_dir, {**config, "cache_dir": self._cache.name}, **engine)
        self.build_s = time.perf_counter() - start
        self.compile_s: float | None = self.llm.startup.first_forward

    def run(self, row: Row) -> Run:
        prompts = [r.prompt for r in row.requests]
        params = [
            cr.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            for r in row.requests
        ]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        steps = self.llm.last_stats.decode_step_seconds
        decode_ms = 1000 * statistics.median(steps) if steps else None
        return Run([o.outputs[0].token_ids for o in outputs], seconds, decode_ms)

    def close(self) -> None:
        self.llm.shutdown()
        self._cache.cleanup()


Side = HFSide | OursSide


class Floor:
    """The matmuls of one decode step alone: the hardware's bound for any runtime."""

    def __init__(self, model_dir: str):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = model.state_dict()
        # q, k, v, o, gate, up, down of every layer, then the lm_head.
        self.weights = [w for k, w in state.items() if k.endswith("_proj.weight")]
        assert len(self.weights) == 7 * MODEL["num_hidden_layers"], sorted(state)
        self.weights.append(model.get_output_embeddings().weight)

    def tokens_per_s(self, batch: int, steps: int = 10, trials: int = 5) -> float:
        inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in self.weights}
        best = float("inf")
        with torch.inference_mode():
            for w in self.weights:  # one untimed pass: first-touch allocations
                F.linear(inputs[w.shape[1]], w)
            for _ in range(trials):
                start = time.perf_counter()
                for _ in range(steps):
                    for w in self.weights:
                        F.linear(inputs[w.shape[1]], w)
                best = min(best, (time.perf_counter() - start) / steps)
        return batch / best


@dataclass
class Measured:
    """Each side's best run per row label, and the floor's best tokens/s per label."""

    best: dict[str, dict[str, Run]]
    floor: dict[str, float]
    warmup_s: dict[str, float]


def measure(
    workload: Workload,
    sides: Sequence[Side],
    floor: Floor | None,
    repeats: int,
    threads: int,
    warm: bool = True,
) -> Measured:
    """Warm every side up on every row, then interleave: each round runs every side once."""
    warmup_s = {s.name: 0.0 for s in sides}
    if warm:
        for row in workload.rows:
            for side in sides:
                torch.set_num_threads(threads)  # compiled kernels bake in the count at compile
                start = time.perf_counter()
                side.run(row.warmup())
                warmup_s[side.name] += time.perf_counter() - start
    best: dict[str, dict[str, Run]] = {row.label: {} for row in workload.rows}
    floor_best: dict[str, float] = {}
    for _ in range(repeats):
        for row in workload.rows:
            for side in sides:
                torch.set_num_threads(threads)
                run = side.run(row)
                kept = best[row.label].get(side.name)
                if kept is None or run.seconds < kept.seconds:
                    best[row.label][side.name] = run
            if floor is not None and row.floor_batch is not None:
                torch.set_num_threads(threads)
                tps = floor.tokens_per_s(row.floor_batch)
                floor_best[row.label] = max(tps, floor_best.get(row.label, 0.0))
    return Measured(best, floor_best, warmup_s)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def report_rows(workload: Workload, m: Measured) -> list[dict]:
    """Per row: tokens/s per side, ratios, and how many requests' tokens match hf_eager."""
    out = []
    for row in workload.rows:
        runs = m.best[row.label]
        tps = {name: row.useful_tokens / run.seconds for name, run in runs.items()}
        if row.label in m.floor:
            tps["floor"] = m.floor[row.label]
        hf = [tps[n] for n in HF if n in tps]
        pw = tps.get("ours_piecewise")
        match = {}
        if "hf_eager" in runs:
            ref = runs["hf_eager"].tokens
            for name, run in runs.items():
                if name != "hf_eager":
                    same = sum(a == b for a, b in zip(run.tokens, ref, strict=True))
                    match[name] = {"requests_matching": same, "requests": len(ref)}
        out.append(
            {
                "batch": row.label,
                "requests": len(row.requests),
                "useful_tokens": row.useful_tokens,
                "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
                "seconds": {k: round(r.seconds, 3) for k, r in runs.items()},
                "decode_ms": {
                    k: round(r.decode_ms, 2) for k, r in runs.items() if r.decode_ms is not None
                },
                "piecewise_vs_best_hf": ratio(pw, max(hf, default=None)),
                "piecewise_vs_floor": ratio(pw, tps.get("floor")),
                "piecewise_vs_none": ratio(pw, tps.get("ours_none")),
                "match_vs_hf_eager": match,
                "tokens_match": {
                    k: v["requests_matching"] == v["requests"] for k, v in match.items()
                },
            }
        )
    return out


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    def cell(v: object) -> str:
        return "-" if v is None else str(v)

    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join(cell(v) for v in r) + " |")
    print()


def print_workload(workload: Workload, rows: list[dict], sides: Sequence[str]) -> None:
    title = "equal-length prompts" if workload.exact else "mixed offline workload"
    print(f"### workload {workload.name}: {title} (tokens/s)\n")
    ratios = ["piecewise / best hf", "piecewise / floor", "piecewise / none"]
    headers = ["batch", *sides, *ratios, "tokens match hf_eager"]
    table = []
    for r in rows:
        match = ", ".join(
            f"{k}={v['requests_matching'] == v['requests']}"
            if workload.exact
            else f"{k}={v['requests_matching']}/{v['requests']}"
            for k, v in r["match_vs_hf_eager"].items()
        )
        table.append(
            [
                r["batch"],
                *(r["tokens_per_s"].get(s) for s in sides),
                r["piecewise_vs_best_hf"],
                r["piecewise_vs_floor"],
                r["piecewise_vs_none"],
                match or None,
            ]
        )
    print_table(headers, table)


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` processes spinning in Python: another tenant holding every core."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def engine_kwargs(workloads: Sequence[Workload], threads: int | None) -> dict:
    """Sized so every workload fits at once: no chunk limits or preemption in the timing."""
    rows = [row for w in workloads for row in w.rows]
    max_num_seqs = max(64, *(len(r.requests) for r in rows))
    max_model_len = max(512, *(r.cache_len for r in rows))
    head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    kv_per_token = 2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * head_dim * 4
    kwargs: dict = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        max_model_len=max_model_len,
        kv_cache_bytes=(max_num_seqs + 1) * max_model_len * kv_per_token,
    )
    if threads is not None and "num_threads" in inspect.signature(cr.LLM).parameters:
        kwargs["num_threads"] = threads
    return kwargs


def cotenancy(
    args: argparse.Namespace,
    model_dir: str,
    sides: dict[str, Side],
    default_threads: int,
) -> list[dict]:
    """Workload (a) at batch 1 and 8, quiet and with every core busy, per thread count."""
    workload = equal_workload([1, 8], args.max_tokens)
    names = [n for n in ("hf_eager", "ours_piecewise") if n in args.configs]
    results = []
    for threads in dict.fromkeys([default_threads, *args.cotenancy_threads]):
        torch.set_num_threads(threads)
        fresh: list[Side] = []
        chosen: list[Side] = []
        for name in names:
            if name == "hf_eager" or threads == default_threads:
                chosen.append(sides[name])
            else:  # Inductor's CPU kernels bake the thread count in: compile anew
                side = OursSide(name, model_dir, OURS[name], engine_kwargs([workload], threads))
                fresh.append(side)
                chosen.append(side)
        try:
            quiet = measure(workload, chosen, None, args.repeats, threads)
            with busy_cores(os.cpu_count() or 1):
                shared = measure(workload, chosen, None, args.repeats, threads, warm=False)
        finally:
            for side in fresh:
                side.close()
        for row in workload.rows:
            for side in chosen:
                q, s = quiet.best[row.label][side.name], shared.best[row.label][side.name]
                results.append(
                    {
                        "side": side.name,
                        "threads": threads,
                        "batch": row.label,
                        "quiet_tokens_per_s": round(row.useful_tokens / q.seconds, 1),
                        "shared_tokens_per_s": round(row.useful_tokens / s.seconds, 1),
                        "slowdown": round(s.seconds / q.seconds, 2),
                        "quiet_decode_ms": q.decode_ms and round(q.decode_ms, 2),
                        "shared_decode_ms": s.decode_ms and round(s.decode_ms, 2),
                    }
                )
    torch.set_num_threads(default_threads)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    parser.add_argument(
        "--threads", type=int, help="torch threads on every side (default: torch's)"
    )
    parser.add_argument("--cotenancy", action="store_true", help="also time with every core busy")
    parser.add_argument("--cotenancy-threads", nargs="+", type=int, default=[1])
    parser.add_argument("--model-dir", default=".demo/llama-33m")
    parser.add_argument("--out", default="benchmarks/results/vs_transformers.json")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: batch 1 and 8, 8 new tokens, 8 mixed requests, 1 repeat",
    )
    args = parser.parse_args()
    args.mixed_requests = MIXED_REQUESTS
    if args.quick:
        args.batches, args.max_tokens, args.repeats, args.mixed_requests = [1, 8], 8, 1, 8
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    workloads = []
    if "a" in args.workloads:
        workloads.append(equal_workload(args.batches, args.max_tokens))
    if "b" in args.workloads:
        workloads.append(mixed_workload(args.mixed_requests))
    engine = engine_kwargs(workloads, args.threads)
    names = [n for n in CONFIGS if n in args.configs and n != "floor"]

    sides: dict[str, Side] = {}
    try:
        for name in names:
            sides[name] = (
                HFSide(name, model_dir, HF[name])
                if name in HF
                else OursSide(name, model_dir, OURS[name], engine)
            )
        floor = Floor(model_dir) if "floor" in args.configs else None
        columns = [*names, *(["floor"] if floor else [])]
        results: dict[str, list[dict]] = {}
        warmups: dict[str, dict[str, float]] = {}
        for workload in workloads:
            m = measure(workload, list(sides.values()), floor, args.repeats, threads)
            results[workload.name] = report_rows(workload, m)
            warmups[workload.name] = {k: round(v, 2) for k, v in m.warmup_s.items()}
            print_workload(workload, results[workload.name], columns)
        startup = {
            name: {
                "build_s": round(side.build_s, 2),
                "compile_s": side.compile_s and round(side.compile_s, 2),
                "warmup_s": {w: warmups[w][name] for w in warmups},
            }
            for name, side in sides.items()
        }
        print("### start-up (not in tokens/s)\n")
        print(
            "build s: model load or LLM construction (ours: includes compiling); "
            "warm-up s: first runs of the workload's shapes (hf_static_compile compiles here)\n"
        )
        print_table(
            ["side", "build s", "ours' compile s", *(f"warm-up s ({w})" for w in warmups)],
            [
                [n, s["build_s"], s["compile_s"], *s["warmup_s"].values()]
                for n, s in startup.items()
            ],
        )
        shared = cotenancy(args, model_dir, sides, threads) if args.cotenancy else None
        if shared is not None:
            print(f"### co-tenancy: {os.cpu_count()} busy processes on the cores\n")
            headers = ["side", "threads", "batch", "quiet tok/s", "shared tok/s", "slowdown x"]
            headers += ["quiet decode ms", "shared decode ms"]
            print_table(headers, [list(r.values()) for r in shared])
    finally:
        for side in sides.values():
            side.close()

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": MODEL,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "cpu_count": os.cpu_count(),
                "threads": threads,
                "args": vars(args),
                "engine": engine,
                "startup": startup,
                "workloads": results,
                "cotenancy": shared and {"busy_processes": os.cpu_count(), "rows": shared},
                "left_out": LEFT_OUT,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
