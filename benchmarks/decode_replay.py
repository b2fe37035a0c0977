"""Where a CPU decode step's time goes: the replayed forward, its native calls alone, the rest.

The runtime captures each decode size into a CPU graph (``compile_runtime/cpu/graph.py``) and
replays it from C. This measures, on the real model, at batch 1 and batch 8, in one run:

* ``unreplayed``: the decode forward with ``cudagraph_mode="NONE"`` (every step through
  Python: the Inductor wrappers, ``cpu_linear``, the attention layer): what it was before;
* ``replayed``: the same forward as the runtime runs it now (the FULL wrapper: address
  checks, then the C loop over the recorded calls);
* ``native calls alone``: the captured graph's C loop called directly, nothing around it:
  the floor of this design, what the kernels themselves take;
  timed with the pause a step leaves between forwards (the weights then come back from
  memory, as in a step), and back to back (on a CPU whose cache holds the weights, faster
  than any step can be);
* ``logits``: the LM head on the sampled rows (outside the graph);
* ``rest of the step``: scheduler, inputs, attention metadata, sampling, outputs: the
  generate call's time per step less every forward (the prefill's too) and the logits.

Medians over the decode steps of a ``--tokens`` generation (the native loop: as many calls).
Both engines' greedy tokens are compared (they must be equal).

    python benchmarks/decode_replay.py [--file PATH] [--dtype float32|bfloat16]
        [--batches 1 8] [--tokens 64] [--out results/decode_replay.json]

Left out: prefill and mixed steps (PIECEWISE graphs), the kernels' own distance to the
memory bandwidth floor (the next issue's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import compile_runtime as cr
from compile_runtime.graphs.wrapper import CUDAGraphWrapper
from compile_runtime.table import format_table

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILE = os.path.join(HERE, "..", ".models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def measure(llm: cr.LLM, batch: int, tokens: int) -> dict:
    """Per-step times of one greedy generation of ``batch`` prompts (decode steps only)."""
    runner = llm.executor.driver_runner
    plan = runner.cudagraph_plan
    forward = plan.forward_model
    forward_s: list[float] = []
    prefill_s: list[float] = []
    padded = _padded(runner, batch)

    def timed(*inputs):
        start = time.perf_counter()
        out = forward(*inputs)
        elapsed = time.perf_counter() - start
        # A decode step has the padded batch's rows; the prompts are longer.
        (forward_s if inputs[0].shape[0] == padded else prefill_s).append(elapsed)
        return out

    model = runner.model
    compute_logits = model.compute_logits
    logits_s: list[float] = []

    def timed_logits(hidden):
        start = time.perf_counter()
        out = compute_logits(hidden)
        logits_s.append(time.perf_counter() - start)
        return out

    model.compute_logits = timed_logits
    object.__setattr__(plan, "forward_model", timed)  # the plan is a frozen dataclass
    prompts = [[1000 + 17 * i + j for j in range(16)] for i in range(batch)]
    params = cr.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        forward_s.clear()
        prefill_s.clear()
        logits_s.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - start
    finally:
        object.__setattr__(plan, "forward_model", forward)
        del model.compute_logits
    steps = tokens - 1  # one prefill, then decode steps
    forward_s = forward_s[-steps:]
    result = {
        "forward_ms": 1e3 * statistics.median(forward_s),
        "step_ms": 1e3 * total / tokens,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    result["logits_ms"] = 1e3 * statistics.median(logits_s)
    result["prefill_ms"] = 1e3 * sum(prefill_s)
    # The rest of a decode step: the call's time less every forward (the prefill's too)
    # and every LM head, per step.
    outside = total - sum(forward_s) - sum(prefill_s) - sum(logits_s)
    result["outside_forward_ms"] = 1e3 * outside / tokens
    if isinstance(forward, CUDAGraphWrapper):
        entry = next(e for d, e in forward.entries.items() if d.num_tokens == padded)
        # The loop alone with the gap a step leaves between forwards (the weights come back
        # from memory, as in a step), and back to back (they stay in this CPU's cache).
        gap = (outside + sum(logits_s)) / tokens
        for key, pause in (("native_ms", gap), ("native_warm_ms", 0.0)):
            loop_s = []
            for _ in range(len(forward_s)):
                if pause:
                    time.sleep(pause)
                start = time.perf_counter()
                entry.graph.replay()
                loop_s.append(time.perf_counter() - start)
            result[key] = 1e3 * statistics.median(loop_s)
        result["native_calls"] = len(entry.graph.calls)
    return result


def _padded(runner, batch: int) -> int:
    mode, descriptor = runner.dispatcher.dispatch(batch, True)
    return descriptor.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=DEFAULT_FILE)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "decode_replay.json"))
    args = parser.parse_args()

    options = dict(dtype=args.dtype, max_num_seqs=max(args.batches), max_model_len=512)
    engines = {
        "replayed": cr.LLM(args.file, **options),
        "unreplayed": cr.LLM(args.file, {"cudagraph_mode": "NONE"}, **options),
    }
    rows, results = [], {"cpu": cpu_name(), "file": os.path.basename(args.file)}
    ok = True
    for batch in args.batches:
        got = {name: measure(llm, batch, args.tokens) for name, llm in engines.items()}
        equal = got["replayed"]["tokens"] == got["unreplayed"]["tokens"]
        ok &= equal
        rep, unrep = got["replayed"], got["unreplayed"]
        for side in got.values():
            side.pop("tokens")
        results[f"batch_{batch}"] = {**got, "tokens_equal": equal}
        rows.append(
            [
                batch,
                args.dtype,
                round(unrep["forward_ms"], 2),
                round(rep["forward_ms"], 2),
                round(rep["native_ms"], 2),
                round(rep["native_warm_ms"], 2),
                f"{rep['forward_ms'] / rep['native_ms']:.2f}x",
                round(rep["logits_ms"], 2),
                round(rep["outside_forward_ms"], 2),
                round(1e3 / rep["step_ms"] * batch, 1),
                round(1e3 / unrep["step_ms"] * batch, 1),
                "yes" if equal else "NO",
            ]
        )
    print(f"CPU: {results['cpu']}; {results['file']}")
    print(
        format_table(
            [
                "batch",
                "dtype",
                "forward unreplayed ms",
                "forward replayed ms",
                "native calls alone ms",
                "same, back to back ms",
                "replayed / native",
                "logits ms",
                "rest of the step ms",
                "tok/s replayed",
                "tok/s unreplayed",
                "tokens equal",
            ],
            rows,
        )
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
