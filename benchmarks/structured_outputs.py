"""Structured outputs (JSON schema) on the real model: what the constraint costs, ours and vLLM's.

SmolLM2-135M-Instruct, fp32, 32 chat requests over 3 JSON schemas (a city
``{city, country}``, a person ``{name, age 0..120, email}``, a product ``{name,
price 0..1000, in_stock}``; strings bounded by ``maxLength`` so that every
output ends), each prompt asking for that JSON. The conversations go through
our chat template to token ids once, and every side gets those ids. Greedy
(temperature 0) everywhere. Sides, one engine at a time (never two on the
cores together):

* ``constrained``: every request with ``structured_outputs=json=<its schema>``,
  ``max_tokens=128``; each request ends when its grammar does (EOS, "stop").
* ``unconstrained``: the same prompts with no constraint, ``ignore_eos=True``
  and ``max_tokens`` = that request's output length in this engine's
  constrained run, so both batches generate exactly the same number of tokens
  per request (the text runs past the JSON; its validity is not counted).
* ``mixed``: one batch of 16 constrained (the even requests) and 16
  unconstrained (the odd ones, as in ``unconstrained``): the same tokens as the
  other two. Its tokens/s over the all-free batch's is the cost free requests
  see when constrained ones share their batch (the whole batch is timed, so it
  includes the constrained half's own mask work: a bound from below on what
  the free requests pay). The free requests' tokens must equal their tokens in
  the all-free batch, and the constrained ones' their tokens in ``constrained``.

Engines: ``ours`` is ``cr.LLM(model, dtype="float32", num_threads=<cores>)``
(the GGUF file by default, ``--ours-model hf`` for the HF directory; every core
as vLLM, since its own choice counts the cores busy at start-up and on a shared
machine may take one, ``--ours-threads 0`` for that); ``vllm`` is vLLM 0.32's
CPU build in its own venv on the HF directory (the same weights dequantized),
``structured_outputs_config={"backend": "xgrammar"}``. Each runs in a worker
process (this file run by that venv's Python, spawned by ``vs_vllm.Worker``:
its environment, vLLM's core binding and preload, log files under
``benchmarks/.peers/logs``). Per engine: start, a warm-up call of each side
(compiles, and each schema's grammar: both engines cache grammars by schema),
then ``--repeats`` rounds of the three sides in rotating order; each side
keeps its best round. tokens/s = output tokens (EOS included) / wall time of
the generate call, timed in the worker, prefill included. The prompts repeat
from call to call, so after the warm-up both engines' prefix caches (on by
default on both) hold them: the timed calls are mostly decode, where the
constraint's cost is.

The two cores are shared with whatever else runs on the machine: before each
timed call the benchmark counts the threads of other processes that are
running (state R in ``/proc``, the engine's own processes not counted: vLLM's
idle engine spins), records it per call and prints it next to the timing
(``--quiet-wait S`` first waits up to S seconds for none).

Reported: tokens/s per side, constrained / unconstrained and mixed /
unconstrained per engine (targets >= 0.9x and >= 0.97x), the share of
constrained outputs that parse as JSON and validate against their schema
(``jsonschema``; target 100%), finish reasons, whether the timed rounds gave
the same tokens, and how many constrained outputs are token for token the same
as vLLM's.

    python benchmarks/structured_outputs.py [--repeats 3] [--skip-vllm]
        [--ours-model gguf|hf] [--requests 32] [--quiet-wait S]
        [--json benchmarks/results/structured_outputs.json]

Left out: regex, choice, EBNF and ``json_object`` constraints; schemas that take
long to compile (here each compiles once, in the warm-up); sampling other than
greedy; speculative decoding with constraints; tool calls; the online servers
(``response_format``); constraints on prompts the prefix cache has not seen;
larger batches than 32, and models other than this one; GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vs_vllm  # noqa: E402  (benchmarks/vs_vllm.py; only the standard library at its top)
from vs_vllm import install, log, print_table  # noqa: E402

MAX_TOKENS = 128
DTYPE = "fp32"
SIDES = ["unconstrained", "constrained", "mixed"]
ENGINES = ["ours", "vllm"]
TARGETS = {"constrained": 0.9, "mixed": 0.97}  # tokens/s over the unconstrained side's

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32},
    },
    "required": ["name", "age", "email"],
}
PRODUCT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"},
    },
    "required": ["name", "price", "in_stock"],
}
SCHEMAS = {"city": CITY, "person": PERSON, "product": PRODUCT}
COUNTRIES = "France Japan Italy Spain Germany Canada Egypt Brazil India Kenya Peru".split()
PEOPLE = (
    "a teacher,a doctor,a pilot,a painter,a chef,a farmer,a nurse,an engineer,a student,"
    "a singer,a baker"
).split(",")
PRODUCTS = (
    "a laptop,a coffee mug,a bicycle,a pair of shoes,a desk lamp,a phone,a backpack,a guitar,"
    "a watch,a kettle"
).split(",")
QUESTIONS = (
    [
        (f"Give me the capital of {c} as JSON with the keys city and country.", "city")
        for c in COUNTRIES
    ]
    + [
        (f"Make up {p}: answer as JSON with the keys name, age and email.", "person")
        for p in PEOPLE
    ]
    + [
        (
            f"Describe {p} for sale in a shop as JSON with the keys name, price and in_stock.",
            "product",
        )
        for p in PRODUCTS
    ]
)


# ---- the worker: this file run by an engine's venv, spawned by vs_vllm.Worker ----------------


def sampling_params(params_class, constraint_class, requests: list[dict]) -> list:
    """Greedy, each request's length and EOS rule, and its schema if it has one (either
    engine's ``SamplingParams`` and ``StructuredOutputsParams``: they take the same names)."""
    return [
        params_class(
            temperature=0.0,
            max_tokens=r["max_tokens"],
            ignore_eos=r["ignore_eos"],
            structured_outputs=constraint_class(json=r["schema"]) if r["schema"] else None,
        )
        for r in requests
    ]


def worker_sides():
    """The engines' worker classes, built on ``peers/worker.py``'s (imported only in a worker:
    each needs its own venv)."""
    import worker  # benchmarks/peers/worker.py (on sys.path through vs_vllm)

    class Ours(worker.OursSide):
        def render(self, conversations: list) -> list[list[int]]:
            from compile_runtime.engine.chat import chat_prompt_ids

            return [chat_prompt_ids(c, self.llm.tokenizer) for c in conversations]

        def run(self, requests: list[dict]) -> tuple[list, float]:
            from compile_runtime.core.sampling_params import StructuredOutputsParams

            params = sampling_params(self.cr.SamplingParams, StructuredOutputsParams, requests)
            start = time.perf_counter()
            outputs = self.llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
            return outputs, time.perf_counter() - start

    class VLLM(worker.VLLMSide):
        def __init__(self, model: str, precision: str, options: dict):
            backend = {"structured_outputs_config": {"backend": "xgrammar"}}
            super().__init__(model, precision, {**backend, **options})
            self.info["structured_outputs_backend"] = "xgrammar"

        def run(self, requests: list[dict]) -> tuple[list, float]:
            from vllm.sampling_params import StructuredOutputsParams

            params = sampling_params(self.SamplingParams, StructuredOutputsParams, requests)
            prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
            start = time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            return outputs, time.perf_counter() - start

    return {"ours": Ours, "vllm": VLLM}


def worker_main() -> None:
    """JSON lines as ``peers/worker.py`` speaks them, with these operations:

    {"op": "render", "conversations": [...]}  -> {"prompts": [[token ids], ...]}  (ours)
    {"op": "run", "requests": [{"prompt", "max_tokens", "ignore_eos", "schema"}, ...]}
        -> {"outputs": [{"token_ids", "text", "finish_reason"}, ...], "seconds": ...}
    {"op": "quit"}
    """
    import worker  # benchmarks/peers/worker.py (on sys.path through vs_vllm)

    def make_side(args):
        precision = args.precision.split("-")[0]  # "fp32-structured": its own log file
        return worker_sides()[args.side](args.model, precision, json.loads(args.options))

    def answer(side, msg: dict) -> dict:
        if msg["op"] == "render":
            return {"prompts": side.render(msg["conversations"])}
        outputs, seconds = side.run(msg["requests"])
        fields = ("token_ids", "text", "finish_reason")
        replies = [{k: getattr(o.outputs[0], k) for k in fields} for o in outputs]
        for r in replies:
            r["token_ids"] = list(r["token_ids"])
        return {"outputs": replies, "seconds": seconds}

    worker.serve(make_side, answer)


# ---- the benchmark ----------------------------------------------------------------------------


def ask(worker: vs_vllm.Worker, msg: dict) -> dict:
    assert worker.proc.stdin is not None
    worker.proc.stdin.write(json.dumps(msg) + "\n")
    worker.proc.stdin.flush()
    reply = worker._read(vs_vllm.RUN_TIMEOUT_S)
    if "error" in reply:
        raise vs_vllm.WorkerError(f"{worker.name}: {reply['error']}\n{worker.tail()}")
    return reply


def is_constrained(side: str, i: int) -> bool:
    return side == "constrained" or (side == "mixed" and i % 2 == 0)


def side_requests(
    side: str, prompts: list[list[int]], schemas: list[dict], lengths: list[int] | None
) -> list[dict]:
    """One call's requests: constrained (to the grammar's end), free (``ignore_eos``, the
    constrained lengths), or mixed (even requests constrained, odd ones free)."""
    out = []
    for i, (prompt, schema) in enumerate(zip(prompts, schemas, strict=True)):
        if is_constrained(side, i):
            out.append(
                {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": False, "schema": schema}
            )
        else:
            assert lengths is not None
            out.append(
                {"prompt": prompt, "max_tokens": lengths[i], "ignore_eos": True, "schema": None}
            )
    return out


def validates(text: str | None, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def others_busy_cores(mine: set[int], samples: int = 5, interval_s: float = 0.002) -> int:
    """Threads of other processes running now (the fewest over a few samples): every task in
    state R outside ``mine`` (the engine's process tree: vLLM's idle engine spins) and this
    process."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        running = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) in mine:
                continue
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        running += f.read().rsplit(")", 1)[1].split()[0] == "R"
                except (OSError, IndexError):
                    continue
        counts.append(running)
    return min(counts)


def wait_for_quiet(seconds: float, mine: set[int]) -> int:
    """Cores other processes keep busy, after waiting up to ``seconds`` for none to be."""
    busy = others_busy_cores(mine)
    waited = 0.0
    while busy and waited < seconds:
        time.sleep(1.0)
        waited += 1.0
        busy = others_busy_cores(mine)
    return busy


def run_engine(
    engine: str, prompts: list[list[int]] | None, args: argparse.Namespace
) -> tuple[dict, list[list[int]] | None]:
    """Start the engine's worker, warm each side up, then the timed rounds; the engine's
    results and the prompts (rendered by ours when not given)."""
    model = vs_vllm.model_for(engine, DTYPE, args.ours_model)
    res: dict = {"model": model, "sides": {s: {"rounds": []} for s in SIDES}, "warmup_s": {}}
    schemas = [SCHEMAS[name] for _, name in QUESTIONS[: args.requests]]
    log(f"starting {engine} (MemAvailable {vs_vllm.mem_available_gib():.1f} GiB)")
    try:
        options = (
            {"num_threads": args.ours_threads} if engine == "ours" and args.ours_threads else {}
        )
        w = vs_vllm.Worker(engine, f"{DTYPE}-structured", model, options)
    except vs_vllm.WorkerError as e:
        res["error"] = str(e)
        log(f"{engine} FAILED TO START:\n{e}")
        return res, prompts
    res.update(startup_s=round(w.startup_s, 2), info=w.info)
    log(f"{engine} ready in {w.startup_s:.1f} s")
    try:
        if prompts is None:
            conversations = [[{"role": "user", "content": q}] for q, _ in QUESTIONS]
            prompts = ask(w, {"op": "render", "conversations": conversations})["prompts"]
            prompts = prompts[: args.requests]
        lengths: list[int] | None = None

        def call(side: str) -> tuple[list[dict], float]:
            reply = ask(
                w, {"op": "run", "requests": side_requests(side, prompts, schemas, lengths)}
            )
            return reply["outputs"], reply["seconds"]

        for side in ["constrained", "unconstrained", "mixed"]:  # the lengths come first
            begin = time.perf_counter()
            outputs, _ = call(side)
            res["warmup_s"][side] = round(time.perf_counter() - begin, 2)
            if side == "constrained":
                lengths = [len(o["token_ids"]) for o in outputs]
                res["lengths"] = lengths
        mine = {os.getpid(), *vs_vllm.process_tree(w.proc.pid)}
        for r in range(args.repeats):
            order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
            for side in order:
                time.sleep(vs_vllm.SETTLE_S)
                busy = wait_for_quiet(args.quiet_wait, mine)
                outputs, seconds = call(side)
                tokens = sum(len(o["token_ids"]) for o in outputs)
                res["sides"][side]["rounds"].append(
                    {
                        "seconds": seconds,
                        "output_tokens": tokens,
                        "others_busy": busy,
                        "outputs": outputs,
                    }
                )
                log(
                    f"{engine} round {r} {side:13s} {seconds:7.3f} s {tokens / seconds:8.1f} tok/s"
                    + (f"  ({busy} core(s) busy with other work)" if busy else "")
                )
    except vs_vllm.WorkerError as e:
        res["error"] = str(e)
        log(f"{engine} FAILED:\n{e}")
    finally:
        res["peak_rss_gib"] = w.peak_rss_gib()
        w.close()
    return res, prompts


def summarize(res: dict, schemas: list[dict]) -> dict:
    """Best tokens/s per side, the ratios, validity, finish reasons, determinism, checks."""
    out: dict = {}
    for side, data in res["sides"].items():
        rounds = data["rounds"]
        if not rounds:
            continue
        per_round = [r["output_tokens"] / r["seconds"] for r in rounds]
        first = rounds[0]["outputs"]
        constrained = [i for i in range(len(first)) if is_constrained(side, i)]
        valid = sum(
            validates(r["outputs"][i]["text"], schemas[i]) for r in rounds for i in constrained
        )
        out[side] = {
            "tokens_per_s": round(max(per_round), 1),
            "round_tokens_per_s": [round(x, 1) for x in per_round],
            "round_seconds": [round(r["seconds"], 3) for r in rounds],
            "output_tokens": rounds[0]["output_tokens"],
            "others_busy_cores_per_round": [r["others_busy"] for r in rounds],
            "constrained_requests": len(constrained),
            "valid": valid,
            "validated": len(constrained) * len(rounds),
            "finish_reasons": dict(
                Counter(o["finish_reason"] for r in rounds for o in r["outputs"])
            ),
            "rounds_identical": all(
                [o["token_ids"] for o in r["outputs"]] == [o["token_ids"] for o in first]
                for r in rounds
            ),
        }
    free = out.get("unconstrained", {}).get("tokens_per_s")
    for side in ("constrained", "mixed"):
        if side in out and free:
            out[side]["over_unconstrained"] = round(out[side]["tokens_per_s"] / free, 3)
            rounds = out[side]["round_tokens_per_s"], out["unconstrained"]["round_tokens_per_s"]
            pairs = zip(*rounds, strict=False)  # a failed round leaves a side one short
            out[side]["round_over_unconstrained"] = [round(a / b, 3) for a, b in pairs]
    if {"mixed", "unconstrained", "constrained"} <= set(out):

        def tokens(side: str) -> list[list[int]]:
            return [o["token_ids"] for o in res["sides"][side]["rounds"][0]["outputs"]]

        mixed, alone, cons = tokens("mixed"), tokens("unconstrained"), tokens("constrained")
        odd, even = range(1, len(mixed), 2), range(0, len(mixed), 2)
        m = out["mixed"]
        m["free_same_as_all_free_batch"] = sum(mixed[i] == alone[i] for i in odd)
        m["constrained_same_as_all_constrained"] = sum(mixed[i] == cons[i] for i in even)
        m["free_requests"] = len(odd)
    return out


def agreement(results: dict) -> dict | None:
    """Constrained outputs of ours equal to vLLM's: token ids and text (first timed round)."""
    try:
        ours = results["ours"]["sides"]["constrained"]["rounds"][0]["outputs"]
        theirs = results["vllm"]["sides"]["constrained"]["rounds"][0]["outputs"]
    except (KeyError, IndexError):
        return None
    a = vs_vllm.compare([[o["token_ids"] for o in ours]], [[o["token_ids"] for o in theirs]])
    a["texts_matching"] = sum(x["text"] == y["text"] for x, y in zip(ours, theirs, strict=True))
    return a


def report(results: dict, summaries: dict, args: argparse.Namespace) -> dict:
    def spread(ratios: list[float] | None) -> str | None:
        """Each round's side over the same round's unconstrained call: lowest..highest."""
        return f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else None

    def pct(v: int, n: int) -> str:
        return f"{v}/{n} ({100 * v / n:.0f}%)" if n else "-"

    rows = []
    for engine, summary in summaries.items():
        for side in SIDES:
            s = summary.get(side)
            if not s:
                continue
            ratio = s.get("over_unconstrained")
            rows.append(
                [
                    engine,
                    side,
                    s["output_tokens"],
                    s["tokens_per_s"],
                    "1.00" if side == "unconstrained" else (f"{ratio:.3f}" if ratio else None),
                    spread(s.get("round_over_unconstrained")),
                    pct(s["valid"], s["validated"]) if s["constrained_requests"] else None,
                    ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items())),
                    "yes" if s["rounds_identical"] else "NO",
                ]
            )
    print(
        f"### tokens/s, best of {args.repeats} (output tokens, EOS included, / wall time of "
        "one generate call)\n"
    )
    print_table(
        [
            "engine",
            "side",
            "output tokens",
            "tokens/s",
            "/ unconstrained",
            "round by round",
            "valid (all rounds)",
            "finish reasons (all rounds)",
            "rounds identical",
        ],
        rows,
    )
    if {"ours", "vllm"} <= set(summaries):
        ours, theirs = summaries["ours"], summaries["vllm"]
        ours_over = [
            f"{side} {ours[side]['tokens_per_s'] / theirs[side]['tokens_per_s']:.2f}x"
            for side in SIDES
            if side in ours and side in theirs
        ]
        print("ours / vllm tokens/s: " + ", ".join(ours_over) + "\n")

    checks = []
    targets: dict = {}
    for engine, summary in summaries.items():
        for side, target in TARGETS.items():
            ratio = summary.get(side, {}).get("over_unconstrained")
            if ratio is not None:
                met = ratio >= target
                targets[f"{engine} {side} / unconstrained >= {target}"] = met
                checks.append(
                    [
                        engine,
                        f"{side} / unconstrained >= {target}x",
                        f"{ratio:.3f}",
                        "met" if met else "MISSED",
                    ]
                )
        c = summary.get("constrained")
        if c:
            met = c["valid"] == c["validated"]
            targets[f"{engine} 100% valid"] = met
            checks.append(
                [
                    engine,
                    "constrained outputs valid: 100%",
                    pct(c["valid"], c["validated"]),
                    "met" if met else "MISSED",
                ]
            )
        m = summary.get("mixed", {})
        if "free_same_as_all_free_batch" in m:
            n = m["free_requests"]
            free_same = m["free_same_as_all_free_batch"]
            cons_same = m["constrained_same_as_all_constrained"]
            checks.append(
                [
                    engine,
                    "mixed: free requests' tokens = the all-free batch's",
                    f"{free_same}/{n}",
                    "met" if free_same == n else "MISSED",
                ]
            )
            checks.append(
                [
                    engine,
                    "mixed: constrained requests' tokens = the constrained batch's",
                    f"{cons_same}/{m['constrained_requests']}",
                    "",
                ]
            )
    a = agreement(results)
    if a:
        checks.append(
            [
                "ours vs vllm",
                "constrained outputs token for token the same",
                vs_vllm.agreement_text(a),
                f"texts equal {a['texts_matching']}/{a['requests']}",
            ]
        )
    print("### targets and checks\n")
    print_table(["engine", "check", "value", ""], checks)

    startup = [
        [
            e,
            r.get("startup_s"),
            *(r.get("warmup_s", {}).get(s) for s in SIDES),
            r.get("peak_rss_gib"),
            "FAILED" if r.get("error") else "ok",
        ]
        for e, r in results.items()
    ]
    print(
        "### start-up and warm-up (not in tokens/s; the first constrained call compiles grammars)\n"
    )
    print_table(
        ["engine", "start-up s", *(f"warm-up {s} s" for s in SIDES), "peak RSS GiB", "status"],
        startup,
    )
    for e, r in results.items():
        if r.get("error"):
            print(f"ERROR {e}:\n{r['error']}\n")
    return {"targets": targets, "agreement_vs_vllm": a}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds, best kept")
    parser.add_argument("--skip-vllm", action="store_true", help="ours only")
    parser.add_argument(
        "--ours-model",
        choices=["gguf", "hf"],
        default="gguf",
        help="our side loads the project's Q4_1 GGUF file (default) or the HF directory",
    )
    parser.add_argument(
        "--ours-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="our engine's CPU threads (default: every core, as vLLM is bound to; 0: the "
        "engine's own choice at start-up, which counts cores busy with other work then)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=len(QUESTIONS),
        help=f"the first N of the {len(QUESTIONS)} requests (a smaller run to try it out)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each timed call, wait up to this many seconds for other processes to "
        "leave the cores idle (default 0: time at once, and record how busy they were)",
    )
    parser.add_argument(
        "--json",
        "--out",
        dest="json",
        default=os.path.join(HERE, "results", "structured_outputs.json"),
    )
    args = parser.parse_args()
    if not 2 <= args.requests <= len(QUESTIONS):
        parser.error(f"--requests: 2..{len(QUESTIONS)}")
    return args


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    engines = ["ours"] if args.skip_vllm else ENGINES
    install.setup(["hf"] + ([] if args.skip_vllm else ["vllm"]))
    # vs_vllm.Worker spawns this file (its worker_main) in each engine's venv.
    vs_vllm.WORKER = os.path.abspath(__file__)
    load_before = os.getloadavg()
    results: dict = {}
    prompts = None
    for engine in engines:  # ours first: it renders the prompts every engine gets
        results[engine], prompts = run_engine(engine, prompts, args)
        if prompts is None:
            break
    wall_s = time.perf_counter() - began
    schemas = [SCHEMAS[name] for _, name in QUESTIONS[: args.requests]]
    summaries = {e: summarize(r, schemas) for e, r in results.items()}

    print(f"\n## structured_outputs: SmolLM2-135M-Instruct, {os.cpu_count()} CPU cores\n")
    names = Counter(name for _, name in QUESTIONS[: args.requests])
    print(
        f"{args.requests} chat requests, JSON schemas "
        + ", ".join(f"{k} x {v}" for k, v in names.items())
        + f"; greedy; constrained max_tokens {MAX_TOKENS}; unconstrained: ignore_eos, the "
        "constrained output lengths; mixed: even requests constrained, odd free\n"
    )
    checks = report(results, summaries, args)
    print(
        f"wall time of the whole run: {wall_s:.0f} s; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n"
    )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "model": "SmolLM2-135M-Instruct",
                "dtype": DTYPE,
                "cpu_count": os.cpu_count(),
                "args": vars(args),
                "schemas": SCHEMAS,
                "questions": QUESTIONS[: args.requests],
                "prompt_lengths": [len(p) for p in prompts or []],
                "summary": summaries,
                **checks,
                "engines": {
                    e: {k: v for k, v in r.items() if k != "sides"} for e, r in results.items()
                },
                "outputs": {
                    e: {s: d["rounds"][0]["outputs"] for s, d in r["sides"].items() if d["rounds"]}
                    for e, r in results.items()
                },
                "wall_s": round(wall_s, 1),
                "load_average_before_after": [load_before[0], os.getloadavg()[0]],
            },
            f,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    if "--side" in sys.argv[1:]:  # spawned by vs_vllm.Worker in an engine's venv
        worker_main()
    else:
        main()
