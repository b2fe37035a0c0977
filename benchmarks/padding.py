"""Padded-token waste of the default capture-size ladder vs sizes planned from the workload.

Three synthetic but realistic workloads, each the step sizes that our own
scheduler (compile_runtime/core/scheduler.py: continuous batching, chunked
prefill, max_num_seqs=64, max_num_batched_tokens=512) produces for a
stream of requests:

* ``steady-decode``: one-token prompts and long outputs, arrivals whose rate
  rises and falls, so the decode batch sweeps 1..64 (every step a uniform
  decode);
* ``chunked-prefill``: a steady Poisson stream of prompts (median 300
  tokens) and outputs (median 120): most steps mix decodes with a prefill
  chunk that fills the 512-token budget;
* ``bursty``: a quiet background plus bursts of 16-48 requests at once:
  long stretches of small decode batches, then full prefill steps.

For each workload, the table compares the default ladder as it is (51
sizes up to 512) with the plan of ``compile-runtime plan-sizes``: at the
default ladder's own count (as many sizes as the default needs to cover the
largest step, the ``auto:FILE`` default), and at 16 and 8 sizes against the
default ladder thinned to as many. "padded/step" is the expected padded
tokens per step; "waste" is padded over real tokens.

Every ladder is planned from one run of the workload's generator (the fit
run) and scored twice: on that run ("fit", in-sample, flattering to the
plans) and on a held-out run of the same generator with another seed
("held-out", what a plan can expect on traffic it has not seen). The
held-out columns are the ones to judge a plan by.

With ``--latency`` (CUDA; on a CPU it runs without graphs or padding, as a
smoke test only) it also times forward steps of a Llama-shaped model (bf16,
8 layers, hidden 1024) with piecewise CUDA graphs captured at each ladder's
sizes, on the same sample of held-out steps per workload: mean milliseconds
per step.
Attention runs dense over the step's (padded) tokens, no KV cache: the
same work for every ladder, so the difference is padding and graph reuse.

    python benchmarks/padding.py [--steps 20000] [--seed 0] [--holdout-seed 1000]
                                 [--out benchmarks/results/padding.json]
    python benchmarks/padding.py --latency [--device cuda] [--latency-steps 300]

The JSON is written after each workload's ladders are scored and after every latency
measurement, so a run cut short keeps what it did; stopped by SIGTERM (the caller's time
budget), it prints the table of what was done, marks the JSON ``"stopped"`` and exits 124.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compile_runtime.core.request import Request  # noqa: E402
from compile_runtime.core.sampling_params import SamplingParams  # noqa: E402
from compile_runtime.core.scheduler import Scheduler  # noqa: E402
from compile_runtime.core.scheduler_output import ModelRunnerOutput  # noqa: E402
from compile_runtime.planner.sizes import (  # noqa: E402
    DEFAULT_MAX_CAPTURE_SIZE,
    default_capture_sizes,
    default_ladder_with_k,
    default_num_graphs,
    ladder_cost,
    plan_sizes,
)
from compile_runtime.planner.workload import Workload  # noqa: E402

MAX_NUM_SEQS = 64
BUDGET = 512
LLAMA_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=8192,
    max_position_embeddings=4096,
)


# ---- workloads from the scheduler ---------------------------------------------------


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def simulate(arrivals, steps: int, seed: int) -> Workload:
    """Run the scheduler for ``steps`` steps; ``arrivals(step, rng)`` yields (prompt, output) lengths."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        num_blocks=20000, block_size=16, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BUDGET
    )
    workload = Workload()
    ids = 0
    for step in range(steps):
        for prompt_len, output_len in arrivals(step, rng):
            ids += 1
            scheduler.add_request(
                Request(
                    f"r{ids}",
                    [7] * prompt_len,
                    SamplingParams(max_tokens=output_len, ignore_eos=True),
                )
            )
        if not scheduler.has_unfinished():
            continue
        out = scheduler.schedule()
        counts = list(out.num_scheduled_tokens.values())
        if counts:
            (workload.decode if all(n == 1 for n in counts) else workload.mixed)[sum(counts)] += 1
        result = ModelRunnerOutput()
        for req_id, n in out.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            result.req_ids.append(req_id)
            result.sampled_token_ids.append(
                [8] if req.num_computed_tokens + n >= req.num_tokens else []
            )
        scheduler.update_from_output(out, result)
    return workload


def steady_decode(step: int, rng: random.Random):
    # The arrival rate swings over a 6000-step period: the batch sweeps 1..64.
    rate = 0.2 * (1 + math.sin(2 * math.pi * step / 6000)) + 0.005
    return [(1, _lognormal(rng, 150, 0.5, 8, 1000)) for _ in range(_poisson(rng, rate))]


def chunked_prefill(step: int, rng: random.Random):
    return [
        (_lognormal(rng, 300, 0.8, 4, 2048), _lognormal(rng, 120, 0.7, 1, 1024))
        for _ in range(_poisson(rng, 0.25))
    ]


def bursty(step: int, rng: random.Random):
    n = _poisson(rng, 0.02)
    if rng.random() < 1 / 400:
        n += rng.randint(16, 48)
    return [
        (_lognormal(rng, 150, 0.8, 4, 2048), _lognormal(rng, 100, 0.7, 1, 1024)) for _ in range(n)
    ]


WORKLOADS = {"steady-decode": steady_decode, "chunked-prefill": chunked_prefill, "bursty": bursty}


def summarize(workload: Workload, seed: int) -> dict:
    hist = workload.combined()
    return {
        "seed": seed,
        "steps": workload.num_steps,
        "decode_steps": sum(workload.decode.values()),
        "mixed_steps": sum(workload.mixed.values()),
        "distinct_sizes": len(hist),
        "min": min(hist),
        "max": max(hist),
        "mean": workload.num_tokens / workload.num_steps,
    }


# ---- padding ------------------------------------------------------------------------------


def ladders(histogram: Counter[int]) -> list[tuple[str, list[int]]]:
    """(name, sizes) of each ladder compared: the default, the plans and their baselines."""
    top = DEFAULT_MAX_CAPTURE_SIZE
    auto_k = default_num_graphs(histogram, top)
    out = [("default as is", default_capture_sizes(top))]
    out.append(
        (f"plan, K={auto_k} (default's count to the max)", plan_sizes(histogram, auto_k, top))
    )
    for k in (16, 8):
        baseline = default_ladder_with_k(histogram, k, top)
        label = (
            f"default thinned to {k}"
            if len(baseline) == k
            else f"default to the max (all {len(baseline)})"
        )
        out.append((label, baseline))
        out.append((f"plan, K={k}", plan_sizes(histogram, k, top)))
    return out


def _score(histogram: Counter[int], sizes: list[int]) -> dict:
    cost = ladder_cost(histogram, sizes)
    return {
        "in_graphs": cost.coverage,
        "padded_per_step": cost.padded_per_step,
        "waste": cost.waste_fraction,
    }


def padding_rows(name: str, fit: Workload, heldout: Workload) -> list[dict]:
    """Ladders planned from ``fit``, each scored on ``fit`` and on ``heldout``."""
    fit_hist, heldout_hist = fit.combined(), heldout.combined()
    rows = []
    for ladder_name, sizes in ladders(fit_hist):
        rows.append(
            {
                "workload": name,
                "ladder": ladder_name,
                "graphs": len(set(sizes)),
                "largest": max(sizes) if sizes else None,
                "sizes": sorted(set(sizes)),
                "fit": _score(fit_hist, sizes),
                "heldout": _score(heldout_hist, sizes),
            }
        )
    return rows


def markdown(rows: list[dict], latency: bool) -> str:
    head = ["workload", "ladder", "graphs", "largest"]
    for split in ("fit", "held-out"):
        head += [f"in graphs ({split})", f"padded/step ({split})", f"waste ({split})"]
    if latency:
        head.append("ms/step (held-out)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], r["ladder"], str(r["graphs"]), str(r["largest"])]
        for split in ("fit", "heldout"):
            score = r[split]
            cells += [
                f"{score['in_graphs']:.1%}",
                f"{score['padded_per_step']:.2f}",
                f"{score['waste']:.2%}",
            ]
        if latency:
            cells.append("-" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- latency (CUDA graphs) ------------------------------------------------------------------


def sample_steps(workload: Workload, n: int, seed: int) -> list[tuple[int, bool]]:
    rng = random.Random(seed)
    population = [(k, False) for k in workload.mixed] + [(k, True) for k in workload.decode]
    weights = [workload.mixed[k] for k in workload.mixed] + [
        workload.decode[k] for k in workload.decode
    ]
    return rng.choices(population, weights=weights, k=n)


class LatencyBench:
    """A Llama-shaped model compiled once; each ladder gets its own dispatcher and graphs.

    The piece wrappers keep every graph captured so far, so a later ladder
    captures only the sizes it adds; each ladder's dispatcher pads to its own
    sizes only, so a step never runs in another ladder's graph.
    """

    def __init__(self, args: argparse.Namespace):
        import torch

        import compile_runtime as cr
        from compile_runtime.models.llama import CausalLM
        from compile_runtime.models.registry import default_dtype_and_device
        from testing.model_dirs import tiny_config

        self.args = args
        self.device = torch.device(args.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config = cr.CompilationConfig(backend=args.backend, cudagraph_mode="PIECEWISE")
        torch.manual_seed(0)
        with cr.set_compilation_config(self.config), default_dtype_and_device(dtype, self.device):
            model = CausalLM(tiny_config("llama", **LLAMA_SHAPE)).eval()
        self.model = model
        self.forward = model.model
        self.ids = torch.randint(0, LLAMA_SHAPE["vocab_size"], (BUDGET,), device=self.device)
        self.pos = torch.arange(BUDGET, device=self.device)
        self.mode = self.config.resolve(
            cr.AttentionCGSupport.NEVER, cuda_available=self.device.type == "cuda"
        ).cudagraph_mode
        with torch.no_grad(), cr.set_forward_context(None, num_tokens=BUDGET):
            self.forward(self.ids, self.pos)  # trace and compile at the largest size
        self.captured: set[int] = set()  # sizes whose piecewise graphs exist

    def _dispatcher(self, sizes: list[int]):
        from compile_runtime.graphs.dispatcher import CudagraphDispatcher

        config = self.config.replace(cudagraph_capture_sizes=sizes)
        dispatcher = CudagraphDispatcher(config, max_num_tokens=BUDGET, max_num_reqs=MAX_NUM_SEQS)
        dispatcher.initialize_keys(self.mode)
        return dispatcher

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, sizes: list[int], steps: list[tuple[int, bool]]) -> float:
        """Mean ms per step over ``steps`` with piecewise graphs at ``sizes``."""
        import torch

        import compile_runtime as cr
        from compile_runtime.graphs.capture import CaptureInputs, capture

        dispatcher = self._dispatcher(sizes)
        ids, pos = self.ids, self.pos
        with torch.no_grad():
            # The wrappers keep earlier ladders' graphs: capture only the sizes this one adds
            # (capturing a size twice is an error).
            new_sizes = sorted(set(sizes) - self.captured)
            if new_sizes:
                capture(
                    self.forward,
                    lambda d, _mode: CaptureInputs(args=(ids[: d.num_tokens], pos[: d.num_tokens])),
                    self._dispatcher(new_sizes),
                    progress=False,
                )
                self.captured.update(new_sizes)

            def run(n: int, uniform: bool) -> None:
                mode, desc = dispatcher.dispatch(n, uniform)
                with cr.set_forward_context(
                    None,
                    cudagraph_runtime_mode=mode,
                    batch_descriptor=desc,
                    num_tokens=desc.num_tokens,
                ):
                    self.forward(ids[: desc.num_tokens], pos[: desc.num_tokens])

            for n, uniform in steps[: self.args.warmup]:
                run(n, uniform)
            self.sync()
            start = time.perf_counter()
            for n, uniform in steps:
                run(n, uniform)
            self.sync()
        return (time.perf_counter() - start) / len(steps) * 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20000, help="scheduler steps per workload")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the runs the ladders are planned from"
    )
    p.add_argument(
        "--holdout-seed",
        type=int,
        default=None,
        help="seed of the held-out runs they are scored on (default: --seed + 1000)",
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--latency", action="store_true", help="also time steps with graphs (CUDA)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--latency-steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--save-workloads", metavar="DIR", help="write each histogram as a workload file"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "padding.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    holdout_seed = args.seed + 1000 if args.holdout_seed is None else args.holdout_seed
    if holdout_seed == args.seed:
        raise SystemExit("--holdout-seed must differ from --seed: a plan is scored on other data")
    if args.latency and args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict] = []
    summaries = {}
    bench: LatencyBench | None = None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(**extra) -> None:
        data = {
            "budget": BUDGET,
            "max_num_seqs": MAX_NUM_SEQS,
            "steps": args.steps,
            "seed": args.seed,
            "holdout_seed": holdout_seed,
            "device": args.device if args.latency else None,
            "workloads": summaries,
            "rows": rows,
            **extra,
        }
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, out)  # a reader never sees half a file

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as KeyboardInterrupt
    stopped = None
    try:
        for i, name in enumerate(args.workloads):
            stopped = f"stopped during {name}"
            fit = simulate(WORKLOADS[name], args.steps, args.seed + i)
            heldout = simulate(WORKLOADS[name], args.steps, holdout_seed + i)
            summaries[name] = {
                "fit": summarize(fit, args.seed + i),
                "heldout": summarize(heldout, holdout_seed + i),
            }
            print(f"# {name}: {summaries[name]}", file=sys.stderr)
            if args.save_workloads:
                Path(args.save_workloads).mkdir(parents=True, exist_ok=True)
                fit.save(str(Path(args.save_workloads) / f"{name}.json"))
            workload_rows = padding_rows(name, fit, heldout)
            rows.extend(workload_rows)  # scored: written now, timed below
            write()
            if args.latency:
                bench = bench or LatencyBench(args)
                steps = sample_steps(heldout, args.latency_steps, holdout_seed)
                for row in workload_rows:
                    row["ms_per_step"] = bench.time(row["sizes"], steps)
                    print(f"#   {row['ladder']}: {row['ms_per_step']:.3f} ms/step", file=sys.stderr)
                    write()
        stopped = None
    except KeyboardInterrupt:
        write(stopped=stopped)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown(rows, args.latency))
    print(f"# written to {out}", file=sys.stderr)
    if stopped:
        print(f"\n{stopped}: the rows above are what was done (ms/step '-': not timed)")
        return 124
    return 0


if __name__ == "__main__":
    sys.exit(main())
