"""Soak: ``compile-runtime serve`` saturated by mixed traffic for long, as an operator runs
it, for what only time shows: memory, descriptors or threads that grow, requests lost or hung.

The server runs on the real model (SmolLM2-135M-Instruct Q4_1 GGUF; ``--model`` another)
with a 1 GiB KV cache, ``--max-num-seqs 16`` and ``--max-waiting 16``: the 24 clients keep
it saturated and some requests get the 503 of a full queue. Each client loops over random
requests (seeded): chat or text completion, streamed or not, ``max_tokens`` 1-96, ``n``
1-3, temperature 0 or 0.8, at times stop strings, a structured output (``response_format``
json_schema, ``structured_outputs`` json, regex or choice) or a disconnect on purpose (a
stream closed after a few chunks, a whole response given up within a second). A request
unanswered for 120 s counts as hung.

Every ``--sample-s`` seconds: RSS (and its shared part), open fds and threads of the server
and of each process under it (the model's worker, the standby kept for a restart), and KV
blocks in use, requests running and waiting from ``/metrics``; once more after the load and 5 s of quiet. Targets
(``--check``: exit 1 on a FAIL): no request lost (a 200 must end every choice and
``data: [DONE]``), hung or broken off; no 5xx but 503; KV blocks back to 0; from the first
minute (the first 20% of a shorter run) to the end, RSS less shared memory grows at most 5%
per process and in total; shared memory grows by at most the KV cache's size (the cache is
a shared mapping whose pages count in RSS once the block pool first hands each block out,
minutes into a run); after SIGTERM a clean exit, no process left and no traceback in the
server's output. Writes JSON (the CPU, samples, counts, verdicts), a PNG of the samples and
the server's ``.log`` beside it.

Left out: tool calls, LoRA, the Responses API, logprobs, several server processes, swap,
throughput and latency (``benchmarks/serve.py`` measures those).

    python benchmarks/soak.py [--minutes 60] [--clients 24] [--seed 0] [--sample-s 5]
        [--model PATH] [--check] [--out benchmarks/results/soak.json] [-- SERVE FLAGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from decode_replay import cpu_name

from compile_runtime.models.smollm2 import smollm2_gguf
from compile_runtime.table import format_table

HUNG_S = 120.0
NAME = "soak"
KINDS = ("chat-stream", "chat", "completion-stream", "completion")
OUTCOMES = ("2xx", "503", "4xx", "5xx", "disconnect", "lost", "hung", "error")
TEXTS = [
    "Write a short poem about the sea.",
    "Explain what a compiler does, in one paragraph.",
    "List three fruits and their colours.",
    "Summarize: inference servers batch requests, page the KV cache and stream tokens.",
]
STOPS = [["\n\n", "."], ["\n"], "!", [".", ",", "?"]]
SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}  # fmt: skip
STRUCTURED = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    {"structured_outputs": {"json": SCHEMA}},
    {"structured_outputs": {"regex": "[0-9]{1,4}( apples)?"}},
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
]
KEYS = ("rss_mib", "shmem_mib", "fds", "threads")
PANELS = [("rss_mib", "RSS (MiB; dashed: its shared part)"), ("kv", "KV blocks in use"),
          ("fds", "open fds"), ("threads", "threads")]  # fmt: skip


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it, from each thread's ``children`` list."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # gone meanwhile
            pass
    return pids


def process_name(pid: int, server_pid: int) -> str:
    """server, resource_tracker-PID, or COMM-PID: cr-rank0-PID for the model's worker,
    cr-standby-PID for the process kept for a restart."""
    if pid == server_pid:
        return "server"
    with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/comm") as g:
        cmdline, comm = f.read().decode(errors="replace"), g.read().strip()
    return f"{'resource_tracker' if 'resource_tracker' in cmdline else comm}-{pid}"


def process_stats(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        status = dict(ln.split(":", 1) for ln in f if ":" in ln)
    mib = {k: int(status.get(k, "0 kB").split()[0]) / 1024 for k in ("VmRSS", "RssShmem")}
    return {"pid": pid, "rss_mib": mib["VmRSS"], "shmem_mib": mib["RssShmem"],
            "threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}  # fmt: skip


async def sample(http, server_pid: int, t: float) -> dict:
    procs = {}
    for pid in process_tree(server_pid):
        try:
            procs[process_name(pid, server_pid)] = process_stats(pid)
        except OSError:
            pass
    out = {"t": round(t, 2), "procs": procs, "kv": None, "running": None, "waiting": None}
    try:
        text = (await http.get("/metrics", timeout=30)).text
    except Exception:  # noqa: BLE001 - a missed scrape is a gap in the plot, not a failure
        return out
    for key, name in (("kv", "kv_blocks_in_use"), ("running", "requests_running"),
                      ("waiting", "requests_waiting")):  # fmt: skip
        metric = f"compile_runtime_{name} "
        out[key] = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(metric))
    return out


def make_request(rng: random.Random) -> tuple[str, str, dict, int, float]:
    """(kind, path, body, close a stream after this many chunks (0: never), give up a
    whole response after this many seconds)."""
    kind = rng.choice(KINDS)
    stream = kind.endswith("stream")
    text = " ".join([rng.choice(TEXTS)] * rng.randint(1, 6))
    body = {"model": NAME, "stream": stream, "max_tokens": rng.randint(1, 96),
            "n": rng.randint(1, 3), "temperature": rng.choice([0.0, 0.8])}  # fmt: skip
    if kind.startswith("chat"):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    if rng.random() < 0.25:
        body.update(rng.choice(STRUCTURED))
    close_after = rng.randint(1, 4) if stream and rng.random() < 0.1 else 0
    give_up = rng.uniform(0.05, 1.0) if not stream and rng.random() < 0.1 else HUNG_S
    return kind, path, body, close_after, give_up


def status_outcome(code: int) -> str:
    return "2xx" if code < 300 else "503" if code == 503 else "4xx" if code < 500 else "5xx"


async def send(http, path: str, body: dict, close_after: int, give_up: float) -> tuple[str, str]:
    """(outcome, why) of one request."""
    import httpx2

    if not body["stream"]:
        try:
            r = await http.post(path, json=body, timeout=give_up)
        except httpx2.TimeoutException:
            if give_up == HUNG_S:
                raise  # hung
            return "disconnect", ""
        if r.status_code != 200:
            return status_outcome(r.status_code), r.text[:300]
        choices = r.json()["choices"]
        done = len(choices) == body["n"] and all(c["finish_reason"] for c in choices)
        return ("2xx", "") if done else ("lost", r.text[:300])
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return status_outcome(r.status_code), (await r.aread()).decode()[:300]
        finished, chunks, done = set(), 0, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return "5xx", line[:300]
                finished |= {c["index"] for c in event["choices"] if c.get("finish_reason")}
                chunks += 1
                if chunks == close_after:
                    return "disconnect", ""
    answered = done and len(finished) == body["n"]
    return ("2xx", "") if answered else ("lost", f"{len(finished)}/{body['n']} ended, {done=}")


async def run_load(url: str, server_pid: int, args: argparse.Namespace) -> dict:
    import httpx2

    limits = httpx2.Limits(max_connections=args.clients * 2)
    http = httpx2.AsyncClient(base_url=url, timeout=HUNG_S, limits=limits)
    probe = httpx2.AsyncClient(base_url=url)  # /metrics, never queued behind the clients
    counts = {k: dict.fromkeys(OUTCOMES, 0) for k in KINDS}
    failures: list[str] = []
    samples = [await sample(probe, server_pid, 0.0)]
    start = time.monotonic()
    deadline = start + args.minutes * 60

    async def client(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while time.monotonic() < deadline:
            kind, path, body, close_after, give_up = make_request(rng)
            try:
                outcome, why = await asyncio.wait_for(
                    send(http, path, body, close_after, give_up), HUNG_S + 10
                )
            except (asyncio.TimeoutError, httpx2.TimeoutException):
                outcome, why = "hung", f"{path} {body}"
            except Exception as e:  # noqa: BLE001 - counted and reported
                outcome, why = "error", f"{type(e).__name__}: {e}"
            counts[kind][outcome] += 1
            if outcome in ("4xx", "5xx", "lost", "hung", "error") and len(failures) < 20:
                failures.append(f"{kind} {outcome}: {why}")
            if outcome == "503":
                await asyncio.sleep(rng.uniform(0.2, 1.0))  # back off, as a client would

    async def sampler() -> None:
        while True:
            await asyncio.sleep(args.sample_s)
            samples.append(await sample(probe, server_pid, time.monotonic() - start))

    sampling = asyncio.ensure_future(sampler())
    await asyncio.gather(*(client(i) for i in range(args.clients)))
    load_s = time.monotonic() - start
    sampling.cancel()
    await asyncio.sleep(5)  # quiet: what the server frees once idle
    samples.append(await sample(probe, server_pid, time.monotonic() - start))
    await asyncio.gather(http.aclose(), probe.aclose())
    return {"counts": counts, "failures": failures, "samples": samples, "load_s": load_s}


def start_server(args: argparse.Namespace, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "compile_runtime.cli", "serve", "--model", args.model,
           "--port", str(port), "--served-model-name", NAME, "--max-num-seqs", "16",
           "--kv-cache-bytes", str(args.kv_cache_bytes), "--max-waiting", str(args.max_waiting),
           *args.server_flags]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1800):  # 900 s
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not up in 900 s; see {log.name}")


def stop_server(proc: subprocess.Popen, children: list[int], log: str) -> dict:
    """SIGTERM, its exit code, the processes it left behind (then killed), tracebacks."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = f"killed after 120 s (SIGTERM ignored), {proc.wait()}"
    time.sleep(2)
    left = [p for p in children if os.path.exists(f"/proc/{p}/exe")]  # a zombie has no exe
    for p in left:
        os.kill(p, signal.SIGKILL)
    with open(log) as f:
        return {"exit_code": code, "children_left": left, "tracebacks": f.read().count("Traceback")}


def resources(samples: list[dict], baseline_s: float) -> list[dict]:
    """Per process (and their sum): RSS, its shared part, fds, threads at the baseline and the
    end; the growth of RSS less shared memory (the KV cache: see the module's docstring)."""
    base = next((s for s in samples if s["t"] >= baseline_s), samples[-1])
    rows = []
    for name in [*samples[-1]["procs"], "total"]:
        a, b = (s["procs"].get(name) if name != "total" else
                {k: sum(p[k] for p in s["procs"].values()) for k in KEYS}
                for s in (base, samples[-1]))  # fmt: skip
        if a and b:
            private = [p["rss_mib"] - p["shmem_mib"] for p in (a, b)]
            growth = 100 * (private[1] - private[0]) / private[0] if private[0] else 0.0
            rows.append({"process": name, **{k: [a[k], b[k]] for k in KEYS}, "growth_pct": growth})
    return rows


def verdicts(totals: dict, samples: list[dict], procs: list[dict], args, stop: dict) -> dict:
    # uvicorn ends by re-raising the SIGTERM it caught, after the drain: -15 is a clean stop.
    clean = stop["exit_code"] in (0, -signal.SIGTERM) and not stop["children_left"]
    worst = max((p["growth_pct"] for p in procs), default=0.0)
    shared = [sum(p["shmem_mib"] for p in s["procs"].values()) for s in (samples[0], samples[-1])]
    kv_mib, kv_end = args.kv_cache_bytes / 2**20, samples[-1]["kv"]
    bad = sum(totals[k] for k in ("lost", "hung", "error"))
    return {
        "0 lost, hung or broken off": [bad, bad == 0],
        "no 5xx but 503": [totals["5xx"], totals["5xx"] == 0],
        "KV blocks back to 0": [kv_end, kv_end == 0],
        f"RSS less shared: growth <= {args.rss_growth_pct:g}% (each process, total)": [
            round(worst, 2), worst <= args.rss_growth_pct],
        f"shared memory added <= the KV cache ({kv_mib:.0f} MiB)": [
            round(shared[1] - shared[0], 1), shared[1] - shared[0] <= kv_mib],
        "SIGTERM: clean exit, no process left, no traceback": [
            stop["exit_code"], clean and not stop["tracebacks"]],
    }  # fmt: skip


def plot(samples: list[dict], load_s: float, baseline_s: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    names = sorted({n for s in samples for n in s["procs"]})
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        if key == "kv":
            pts = [(s["t"], s["kv"]) for s in samples if s["kv"] is not None]
            ax.plot(*zip(*pts, strict=True), label="KV blocks")
        for i, name in enumerate(names if key != "kv" else ()):
            for k, style in [(key, "-"), ("shmem_mib", "--")][: 1 + (key == "rss_mib")]:
                pts = [(s["t"], s["procs"][name][k]) for s in samples if name in s["procs"]]
                kw = {"color": f"C{i}", "label": name if style == "-" else None}
                ax.plot(*zip(*pts, strict=True), style, **kw)
        ax.axvline(baseline_s, color="grey", linestyle=":")
        ax.axvline(load_s, color="grey", linestyle="-.")
        ax.set_title(title)
        ax.legend(fontsize="small")
    fig.supxlabel("seconds (dotted: RSS baseline, dash-dot: load stops)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--model", default=None, help="default: the SmolLM2 GGUF (make model)")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-waiting", type=int, default=16, help="past this: a 503")
    parser.add_argument("--rss-growth-pct", type=float, default=5.0, help="the RSS target")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args(argv[:split])
    args.server_flags = argv[split + 1 :]
    args.model = args.model or smollm2_gguf()
    stem = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with open(stem + ".log", "w") as log:
        proc = start_server(args, port, log)
        try:
            load = asyncio.run(run_load(f"http://127.0.0.1:{port}", proc.pid, args))
        finally:
            children = process_tree(proc.pid)[1:]
            stopped = stop_server(proc, children, log.name)
    samples, counts = load["samples"], load["counts"]
    baseline_s = min(60.0, 0.2 * args.minutes * 60)
    totals = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    procs = resources(samples, baseline_s)
    verdict = verdicts(totals, samples, procs, args, stopped)

    print("\n\n".join([
        format_table(["kind", *OUTCOMES], [[k, *c.values()] for k, c in counts.items()]
                     + [["total", *totals.values()]]),
        format_table([f"process ({baseline_s:.0f} s -> end)", "RSS MiB", "shared MiB",
                      "RSS less shared, growth %", "fds", "threads"],
                     [[p["process"], *("{:.0f} -> {:.0f}".format(*p[k]) for k in KEYS[:2]),
                       f"{p['growth_pct']:+.2f}", *("{} -> {}".format(*p[k]) for k in KEYS[2:])]
                      for p in procs]),
        format_table(["target", "value", "verdict"],
                     [[t, v, "PASS" if ok else "FAIL"] for t, (v, ok) in verdict.items()]),
    ]))  # fmt: skip
    print(f"\n{sum(totals.values())} requests in {load['load_s']:.0f} s; server exit code "
          f"{stopped['exit_code']}, processes left behind: {stopped['children_left'] or 'none'}")  # fmt: skip
    for failure in load["failures"]:
        print("  ", failure)

    plot(samples, load["load_s"], baseline_s, stem + ".png")
    result = {
        "cpu": cpu_name(), "args": vars(args), "load_s": load["load_s"], "baseline_s": baseline_s, "counts": counts,
        "totals": totals, "failures": load["failures"], "processes": procs,
        "verdicts": {t: {"value": v, "pass": ok} for t, (v, ok) in verdict.items()},
        "server": stopped, "samples": samples,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}, {stem}.png, {stem}.log")
    return 1 if args.check and not all(ok for _, ok in verdict.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
