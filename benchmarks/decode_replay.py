"""How much of a CPU decode step is Python: record its C calls once, replay them, time both.

A measurement for the planned CPU analog of FULL graph replay, not a runtime feature.
On a CPU the compiled decode step is a sequence of C calls: Inductor's kernels (each an
exported ``kernel`` symbol of its ``.so``), our quantized GEMM, the embedding's row
dequantization and the paged decode attention (ctypes). Around them runs Python: the
Inductor/AOT wrappers, the ``cpu_linear`` dispatches, the attention layer. This script
runs one real batch-1 decode step with every one of those calls recorded (the wrapper
modules' kernel globals and our ctypes entry points swapped for recording proxies, a
dispatch mode listing every other op), zeroes every intermediate buffer, replays the
recorded calls from a plain Python loop over ctypes and checks that the step's output
is the same to the bit. Then it times the real forward of the following decode steps
against that replay (median of each). A replay from C would cost less again (no ctypes
call per kernel); the replay here skips what a runtime feature must still do per step
(the attention's per-step arguments, the token ids' bounds check, checking that the
input buffers are the recorded ones).

    python benchmarks/decode_replay.py [--file PATH] [--dtype float32|bfloat16]
        [--tokens 64] [--out results/decode_replay.json]

Left out: batches above 1, prefill and mixed steps, float (not quantized) weights.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
import types
from collections import Counter

import torch
from compile_runtime.backends.attention import cpu_batched
from torch._inductor.codecache import PyCodeCache
from torch.utils._python_dispatch import TorchDispatchMode

import compile_runtime as cr
from compile_runtime.forward_context import get_forward_context
from compile_runtime.ops import cpu_quant_gemm
from compile_runtime.table import format_table

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILE = os.path.join(HERE, "..", ".models", "SmolLM2-135M-Instruct.Q4_1.gguf")


class Recorder:
    """The C calls of one forward, in order, with every tensor they touched kept alive."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, tuple]] = []
        self.tensors: list[torch.Tensor] = []
        self.other_ops: Counter[str] = Counter()
        self.context = None  # the step's forward context: its metadata's pointers stay valid

    def inductor(self, builtin):
        c_kernel = ctypes.CDLL(builtin.__self__.__file__).kernel

        def call(*args):
            values = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    values.append(ctypes.c_void_p(a.data_ptr()))
                    self.tensors.append(a)
                elif isinstance(a, int):
                    values.append(ctypes.c_int64(a))
                else:
                    raise TypeError(f"an Inductor kernel argument of type {type(a).__name__}")
            self.calls.append(("inductor", c_kernel, tuple(values)))
            return builtin(*args)

        return call

    def c_function(self, kind: str, fn):
        def call(*args):
            self.calls.append((kind, fn, args))
            return fn(*args)

        return call

    def replay(self) -> None:
        for _, fn, args in self.calls:
            fn(*args)


class _ListOps(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.recorder.other_ops[str(func)] += 1
        if isinstance(out, torch.Tensor):
            self.recorder.tensors.append(out)  # custom ops' outputs, read by later calls
        return out


def _is_inductor_kernel(value) -> bool:
    return (
        type(value) is types.BuiltinFunctionType
        and value.__name__ == "kernel"
        and getattr(value.__self__, "__file__", "").endswith(".so")
    )


def record(forward, args, recorder: Recorder):
    """``forward(*args)`` with its C calls recorded; every patch undone after."""
    swapped = []
    for module in PyCodeCache.modules:
        for name, value in list(vars(module).items()):
            if _is_inductor_kernel(value):
                swapped.append((module, name, value))
                setattr(module, name, recorder.inductor(value))
    qgemm, lib, decode = (
        cpu_quant_gemm._kernel(),
        cpu_quant_gemm._library(),
        cpu_batched.load_decode_kernel(),
    )
    originals = (cpu_quant_gemm._kernel, cpu_quant_gemm._library, cpu_batched.load_decode_kernel)
    recording_qgemm = recorder.c_function("qgemm", qgemm)
    rows = types.SimpleNamespace(qrows=recorder.c_function("qrows", lib.qrows))
    attention = types.SimpleNamespace(
        paged_decode_f32=recorder.c_function("decode", decode.paged_decode_f32),
        paged_decode_bf16=recorder.c_function("decode", decode.paged_decode_bf16),
    )
    cpu_quant_gemm._kernel = lambda: recording_qgemm
    cpu_quant_gemm._library = lambda: rows
    cpu_batched.load_decode_kernel = lambda: attention
    try:
        with _ListOps(recorder):
            out = forward(*args)
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)
        cpu_quant_gemm._kernel, cpu_quant_gemm._library, cpu_batched.load_decode_kernel = originals
    recorder.context = get_forward_context()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=DEFAULT_FILE)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "decode_replay.json"))
    args = parser.parse_args()

    llm = cr.LLM(args.file, dtype=args.dtype, max_num_seqs=1, max_model_len=512)
    runner = llm.executor.driver_runner
    plan = runner.cudagraph_plan
    real_forward = plan.forward_model
    recorder = Recorder()
    found: dict = {"forward_s": []}

    def forward(*inputs):
        if inputs[0].shape[0] != 1 or not found.get("armed"):
            return real_forward(*inputs)
        if "equal" in found:  # a later decode step: time the real forward
            start = time.perf_counter()
            out = real_forward(*inputs)
            found["forward_s"].append(time.perf_counter() - start)
            return out
        out = record(real_forward, inputs, recorder)
        expected = out.clone()
        fixed = {p.data_ptr() for p in runner.model.parameters()}
        fixed |= {b.data_ptr() for b in runner.model.buffers()}
        fixed |= {t.data_ptr() for t in inputs}
        zeroed = [
            t for t in recorder.tensors if t.data_ptr() not in fixed and t.is_floating_point()
        ]
        for t in zeroed:
            t.zero_()
        recorder.replay()  # the same step again: the same cache slot, the same values
        found.update(equal=torch.equal(out, expected), zeroed=len(zeroed))
        return out

    object.__setattr__(plan, "forward_model", forward)  # the plan is a frozen dataclass
    params = cr.SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["The capital of France is"], params)  # warm-up
    found["armed"] = True
    llm.generate(["The capital of France is"], params)
    replay_s = []
    for _ in range(max(len(found["forward_s"]), 20)):
        start = time.perf_counter()
        recorder.replay()  # the recorded step: rewrites its own cache slot
        replay_s.append(time.perf_counter() - start)

    kinds = dict(Counter(kind for kind, _, _ in recorder.calls))
    result = {
        "file": os.path.basename(args.file),
        "dtype": args.dtype,
        "c_calls": kinds,
        "other_ops": dict(recorder.other_ops),
        "zeroed_buffers": found["zeroed"],
        "replay_equals_forward": found["equal"],
        "forward_ms_median": 1e3 * statistics.median(found["forward_s"]),
        "replay_ms_median": 1e3 * statistics.median(replay_s),
        "decode_steps_timed": len(found["forward_s"]),
    }
    print(f"C calls of one decode step: {kinds}; other ops: {dict(recorder.other_ops)}")
    print(
        f"replayed with {found['zeroed']} intermediate buffers zeroed first: "
        f"{'equal to' if found['equal'] else 'DIFFERENT from'} the real forward's output"
    )
    print(
        format_table(
            ["file", "dtype", "forward ms (median)", "replay ms (ctypes loop)", "saved"],
            [
                [
                    result["file"],
                    args.dtype,
                    round(result["forward_ms_median"], 2),
                    round(result["replay_ms_median"], 2),
                    f"{1 - result['replay_ms_median'] / result['forward_ms_median']:.0%}",
                ]
            ],
        )
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if not found["equal"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
