"""Speculative decoding by n-gram prompt lookup, k = 0 vs k draft tokens, one run.

Prompt lookup drafts the tokens that followed the last n-gram (2 to 4 tokens) where it
occurred earlier in the request; it pays off when the model copies from its prompt, as
trained models do when editing code, answering from retrieved text or rewriting a text
they were given. The random-weight ~33M Llama of ``llama_33m.py`` does not copy (nor
loop): on it prompt lookup never finds a continuation and no draft is ever proposed.
So every side here runs a **copier** built from it locally (``--copier-dir``, built
once, a ``.complete`` marker): the same weights and shapes, with

* every layer's ``o_proj`` and ``down_proj`` weights scaled by 0.01: each layer still
  runs every matmul at full cost, but adds 100x less to the residual stream, which
  stays dominated by the current token's embedding;
* the output head set so the greedy next token is a fixed function of the current one:
  ``f`` is a random permutation of the token ids 3.. (``random.Random(0)``, one single
  cycle, so an orbit never closes within a request; ids 0-2 map to themselves) and
  ``lm_head.weight[f[t]] = embed_tokens.weight[t]``, so the logits of the final hidden
  state peak at ``f[t]`` (``tie_word_embeddings`` is False, the final norm's weight is
  1 as built, nothing else needed adjusting).

``f`` is saved with the weights (``copier_map.json``). Each run first checks with
transformers greedy ``generate`` that 64 new tokens of a few random prompts follow
``t -> f[t]`` and prints the count (when built: 64 of 64 on each of 3 prompts; the
``f[t]`` logit was 15-19 against 6-8 for the runner-up, and at temperature 1 the next
token is ``f[t]`` with probability about 0.99). Its outputs are the orbits ``t, f[t],
f[f[t]], ...``: a prompt that holds a stretch of an orbit and ends with its first tokens
is continued by copying that stretch, which is what prompt lookup exploits in trained
models. Workloads (``--prompt-len`` (200) token ids per prompt,
``--max-tokens`` (128) new tokens per request, EOS ignored):

* ``copy`` (greedy): random tokens around one 160-token orbit span (4/5 of the prompt)
  and, at the end, the span's first 4 tokens again, as when a model is asked to rewrite
  a text it was given: the output reproduces the span and prompt lookup drafts it;
* ``partial`` (greedy): 4 orbit spans of 32 tokens from far-apart points of the cycle,
  random tokens between, ending with the first 4 tokens of one of them: the output
  replays the other 28 tokens of that span, then leaves the prompt's text (its orbit
  goes on elsewhere), so drafts stop after one rejection: a middle case;
* ``loop`` (greedy): random tokens ending with id 1, which ``f`` maps to itself: the
  output is that one token over and over, as a model stuck in a loop (or text of one
  repeated token: spaces, rules of ``=``) gives; every earlier stretch of the run is a
  match, and how many drafts a match gives depends on where in the run it is;
* ``revised`` (greedy): an old version of a 64-token orbit span (every 16th token
  replaced by a random one) and, later, the span itself, ending with the span's first
  4 tokens, as when a text was edited and the model copies the latest version: the
  old version matches too, and its drafts are rejected at its replaced tokens;
* ``random`` (greedy): uniformly random tokens: the output's orbit is not in the prompt,
  so no match and no draft: what speculation costs when it cannot help;
* ``random_sampled``: the same kind of prompts at temperature 1 (``seed=i`` for the
  i-th request of a row): about 1 token in 100 leaves the orbit, drafts (if any) are
  rare; it times the sampled verification path.

Rows: batch 1 (``--requests-b1`` (4) requests, one per ``generate`` call, one after
the other) and batch 8 (8 requests in one call). Sides, every one on the same requests
and the same copier model:

* ``k=0``: ``cr.LLM`` (inductor) without speculation;
* ``k=2``, ``k=4`` (``--ks``): the same with ``speculative_config={"method": "ngram",
  "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``;
* ``floor``: the copier's matmuls alone for one decode step of the row's batch (a
  ``[batch, hidden]`` activation through every weight, ``vs_transformers.Floor``), as
  tokens/s: the bound on decoding one token per step. Speculation can beat it: a
  verifying step emits up to 1 + k tokens per request from one read of the weights.

Per row and side: output tokens/s (over the wall time of the ``generate`` calls), speed
up over ``k=0``, drafting steps (request-steps that verified at least one draft), draft
acceptance rate, mean accepted length (tokens a verifying step gives a request: 1 +
accepted drafts), steps, median decode step in ms, the share of output tokens that
follow ``f``, and for the greedy workloads how many requests' tokens are identical to
``k=0`` (over all rounds; every mismatch is printed). Sampled tokens may differ from
``k=0`` by design (verifying drafts draws from the request's random stream
differently), so that is ``n/a``. Every side is warmed up first (a prefill past one
chunk, a short request, and greedy and sampled copies whose drafts are accepted, then
rejected where the copied span ends; batched, then alone), so compilation and first
use are not timed.
Each round runs every side on every row; each side keeps its fastest round. The
summary checks copy b1 best k / k=0 >= 1.5 and random, random_sampled b1 slowest
k / k=0 >= 0.95, and shows partial, loop and revised b1 best k / k=0 for information.

    python benchmarks/spec_decode.py [--ks 0 2 4] [--batches 1 8] [--repeats 2]
        [--max-tokens 128] [--out benchmarks/results/spec_decode.json]

Left out: trained models (how often and how long a real model copies decides what
speculation gives; the copier copies exactly whenever its prompt holds the orbit),
prefix caching (off on every side, so every round computes the same prompts from
scratch), draft models and other methods than n-gram, top-k/top-p sampling,
tokenization (prompts are token ids), requests arriving over time, GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import repo_root  # noqa: F401  (testing/ on the path)
import torch
from llama_33m import MODEL
from vs_transformers import Floor, print_table

import compile_runtime as cr
from testing.model_dirs import make_model_dir

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=1024,
    enable_prefix_caching=False,  # every round computes the same prompts from scratch
    kv_cache_bytes=256 * 2**20,  # every request of a row at once: no preemption
)
WORKLOADS = ("copy", "partial", "loop", "revised", "random", "random_sampled")
GREEDY = {w: w != "random_sampled" for w in WORKLOADS}
# Summary checks at batch 1: (which k > 0 side, target on its speedup over k=0).
TARGETS = {
    "copy": ("best", 1.5),
    "partial": ("best", None),  # for information
    "loop": ("best", None),
    "revised": ("best", None),
    "random": ("slowest", 0.95),
    "random_sampled": ("slowest", 0.95),
}
COPIER_SCALE = 0.01  # on o_proj and down_proj: the layers barely touch the residual
COPIER_SEED = 0
FIRST = 3  # token ids below are special (pad, bos, eos): outside f's cycle
CUE = 4  # the span tokens that end a copy prompt
PARTIAL_SPANS, PARTIAL_SPAN_LEN = 4, 32
LOOP_TOKEN = 1  # f maps it to itself
REVISED_SPAN_LEN, REVISED_EVERY = 64, 16
LEFT_OUT = [
    "trained models (the copier copies exactly whenever its prompt holds the orbit)",
    "prefix caching (off on every side)",
    "draft models and methods other than n-gram",
    "top-k / top-p sampling",
    "tokenization (prompts are token ids)",
    "requests arriving over time (a row's requests are queued at once)",
    "GPUs (CPU only)",
]


@dataclass
class Request:
    prompt: list[int]
    params: cr.SamplingParams


@dataclass
class Run:
    """One side on one row: every generate call of the row together."""

    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def decode_ms(self) -> float | None:
        steps = self.decode_step_seconds
        return 1000 * statistics.median(steps) if steps else None


# -- the copier -----------------------------------------------------------------------


def copier_map(vocab: int) -> list[int]:
    """``f``: one random cycle through the ids FIRST..vocab-1; the special ids map to
    themselves (no prompt holds them)."""
    order = list(range(FIRST, vocab))
    random.Random(COPIER_SEED).shuffle(order)
    f = list(range(vocab))
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        f[a] = b
    return f


def build_copier(base_dir: str, path: str) -> tuple[str, list[int]]:
    """The copier directory at ``path`` (built from ``base_dir`` unless already complete)
    and its map ``f``."""
    from transformers import AutoModelForCausalLM

    marker = os.path.join(path, ".complete")
    map_file = os.path.join(path, "copier_map.json")
    if not os.path.exists(marker):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model.config.tie_word_embeddings = False
        f = copier_map(model.config.vocab_size)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(COPIER_SCALE)
                layer.mlp.down_proj.weight.mul_(COPIER_SCALE)
            embed = model.get_input_embeddings().weight
            head = model.get_output_embeddings().weight
            assert head.data_ptr() != embed.data_ptr(), "lm_head must not be tied"
            head[torch.tensor(f)] = embed  # lm_head.weight[f[t]] = embed_tokens.weight[t]
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        with open(map_file, "w") as fh:
            json.dump(f, fh)
        open(marker, "w").close()
    with open(map_file) as fh:
        f = json.load(fh)
    with open(os.path.join(path, "config.json")) as fh:
        assert not json.load(fh).get("tie_word_embeddings"), "copier lm_head must not be tied"
    return path, f


def follows(f: list[int], last_prompt_token: int, out: list[int]) -> tuple[int, int]:
    """How many tokens of ``out`` are ``f`` of the token before them, of how many."""
    prev = [last_prompt_token, *out[:-1]]
    return sum(f[a] == b for a, b in zip(prev, out, strict=True)), len(out)


def check_copier(path: str, f: list[int], prompts: int = 3, new: int = 64) -> dict:
    """transformers greedy ``generate`` on random prompts: do the outputs follow ``f``?"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random("copier-check")
    counts = []
    with torch.inference_mode():
        for _ in range(prompts):
            prompt = tokens(rng, 200)
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            counts.append(follows(f, prompt[-1], out)[0])
    share = sum(counts) / (prompts * new)
    result = {"tokens_following_f": counts, "of": new, "share": round(share, 4)}
    print(f"copier check (transformers greedy): {counts} of {new} new tokens follow f")
    if share < 0.95:
        print("WARNING: the copier does not follow f: copy workloads will not copy")
    return result


# -- workloads ------------------------------------------------------------------------


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST, MODEL["vocab_size"]) for _ in range(n)]


def orbit(f: list[int], t: int, n: int) -> list[int]:
    out = [t]
    while len(out) < n:
        out.append(f[out[-1]])
    return out


def split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` cut into ``parts`` random non-negative lengths."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def span_prompt(rng: random.Random, f: list[int], length: int, spans: int, span_len: int):
    """Random tokens around ``spans`` orbit spans of ``span_len`` tokens (starts spread
    evenly round f's cycle from a random point, so no span runs into another), ending with
    the first CUE tokens of one of them."""
    cycle = orbit(f, FIRST, len(f) - FIRST)
    base = rng.randrange(len(cycle))
    starts = [cycle[(base + i * len(cycle) // spans) % len(cycle)] for i in range(spans)]
    rng.shuffle(starts)
    pieces = [orbit(f, s, span_len) for s in starts]
    gaps = split(rng, length - spans * span_len - CUE, spans + 1)
    prompt = tokens(rng, gaps[0])
    for piece, gap in zip(pieces, gaps[1:], strict=True):
        prompt += piece + tokens(rng, gap)
    return prompt + rng.choice(pieces)[:CUE]


def revised_prompt(rng: random.Random, f: list[int], length: int) -> list[int]:
    """Random tokens around an old version of an orbit span (every REVISED_EVERY-th token
    replaced) and, after it, the span, ending with the span's first CUE tokens."""
    span = orbit(f, rng.randrange(FIRST, len(f)), REVISED_SPAN_LEN)
    old = [
        rng.randrange(FIRST, len(f)) if i and i % REVISED_EVERY == 0 else t
        for i, t in enumerate(span)
    ]
    gaps = split(rng, length - 2 * REVISED_SPAN_LEN - CUE, 3)
    return (
        tokens(rng, gaps[0]) + old + tokens(rng, gaps[1]) + span + tokens(rng, gaps[2]) + span[:CUE]
    )


def make_prompt(workload: str, rng: random.Random, f: list[int], length: int) -> list[int]:
    if workload == "copy":
        return span_prompt(rng, f, length, 1, max(2 * CUE, length * 4 // 5))
    if workload == "partial":
        return span_prompt(rng, f, length, PARTIAL_SPANS, PARTIAL_SPAN_LEN)
    if workload == "loop":
        return tokens(rng, length - 1) + [LOOP_TOKEN]
    if workload == "revised":
        return revised_prompt(rng, f, length)
    return tokens(rng, length)


def make_requests(workload: str, n: int, f: list[int], args) -> list[Request]:
    """The row's requests: the same every round (a string seed is stable across runs)."""
    rng = random.Random(f"{workload}-{n}")
    out = []
    for i in range(n):
        prompt = make_prompt(workload, rng, f, args.prompt_len)
        if GREEDY[workload]:
            params = cr.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        else:
            params = cr.SamplingParams(
                temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True
            )
        out.append(Request(prompt, params))
    return out


def warmup_requests(f: list[int]) -> list[Request]:
    """A 300-token copy prompt (a prefill past one chunk) copied greedily past the end of
    its 32-token span (drafts accepted, then one rejected), a short random prompt, and a
    short copy sampled at temperature 1 (drafts accepted and rejected, sampled)."""
    rng = random.Random("warm-up")
    greedy = cr.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = cr.SamplingParams(seed=0, max_tokens=40, ignore_eos=True)
    return [
        Request(span_prompt(rng, f, 300, 1, PARTIAL_SPAN_LEN), greedy),
        Request(tokens(rng, 40), cr.SamplingParams(temperature=0, max_tokens=8)),
        Request(span_prompt(rng, f, 60, 1, PARTIAL_SPAN_LEN), sampled),
    ]


def calls(requests: list[Request], batch: int) -> list[list[Request]]:
    """Batch 1: one request per generate call; otherwise every request in one call."""
    return [[r] for r in requests] if batch == 1 else [requests]


class Side:
    def __init__(self, k: int, model_dir: str, cache_dir: str, args):
        self.k = k
        self.name = f"k={k}"
        spec = None
        if k:
            spec = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max,
            }
        self.llm = cr.LLM(
            model_dir,
            {"backend": "inductor", "cache_dir": cache_dir},
            device="cpu",
            speculative_config=spec,
            **ENGINE,
        )

    def run(self, groups: list[list[Request]]) -> Run:
        run = Run()
        for group in groups:
            start = time.perf_counter()
            outputs = self.llm.generate(
                [r.prompt for r in group], [r.params for r in group], use_tqdm=False
            )
            run.seconds += time.perf_counter() - start
            stats = self.llm.last_stats
            run.tokens += [list(o.outputs[0].token_ids) for o in outputs]
            run.steps += stats.steps
            run.decode_step_seconds += stats.decode_step_seconds
            sd = stats.spec_decode
            run.num_drafts += sd.num_drafts
            run.num_draft_tokens += sd.num_draft_tokens
            run.num_accepted_tokens += sd.num_accepted_tokens
        return run


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def rnd(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 2, 4], help="draft tokens per side")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests-b1", type=int, default=4, help="requests run one by one at b1")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    tmp = tempfile.gettempdir()
    p.add_argument(
        "--model-dir",
        default=os.path.join(tmp, "cr_llama_33m"),
        help="the random-weight 33M Llama the copier is built from",
    )
    p.add_argument("--copier-dir", default=os.path.join(tmp, "cr_llama_33m_copier"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = p.parse_args()
    if 0 not in args.ks:
        p.error("--ks needs 0: the side every other is compared with")
    args.ks = sorted(set(args.ks))
    return args


def main() -> None:
    args = parse_args()
    base_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    model_dir, f = build_copier(base_dir, args.copier_dir)
    copier = check_copier(model_dir, f)
    threads = torch.get_num_threads()
    rows = [
        (w, b, make_requests(w, args.requests_b1 if b == 1 else b, f, args))
        for w in args.workloads
        for b in args.batches
    ]
    prompts = {(w, b): [r.prompt for r in requests] for w, b, requests in rows}
    best: dict[tuple[str, int], dict[str, Run]] = {(w, b): {} for w, b, _ in rows}
    matching: dict[tuple[str, int], dict[str, list[int]]] = {(w, b): {} for w, b, _ in rows}
    mismatches: list[dict] = []
    floor_tps: dict[int, float] = {}
    warmup: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        sides = [Side(k, model_dir, cache_dir, args) for k in args.ks]
        floor = Floor(model_dir)
        warm = warmup_requests(f)
        for side in sides:  # compile every shape before timing
            torch.set_num_threads(threads)  # compiled kernels bake in the count
            start = time.perf_counter()
            run = side.run([warm, warm[:1], warm[1:2]])
            warmup[side.name] = {
                "seconds": round(time.perf_counter() - start, 1),
                "num_drafts": run.num_drafts,
                "num_accepted_tokens": run.num_accepted_tokens,
            }
            print(f"warm-up {side.name}: {warmup[side.name]}")
        for round_ in range(args.repeats):
            for workload, batch, requests in rows:
                groups = calls(requests, batch)
                runs = {}
                for side in sides:
                    torch.set_num_threads(threads)
                    runs[side.name] = run = side.run(groups)
                    kept = best[(workload, batch)].get(side.name)
                    if kept is None or run.seconds < kept.seconds:
                        best[(workload, batch)][side.name] = run
                if not GREEDY[workload]:
                    continue
                ref = runs["k=0"].tokens
                for name, run in runs.items():
                    if name == "k=0":
                        continue
                    count = matching[(workload, batch)].setdefault(name, [0, 0])
                    for i, (a, b) in enumerate(zip(run.tokens, ref, strict=True)):
                        count[1] += 1
                        if a == b:
                            count[0] += 1
                            continue
                        at = first_difference(a, b)
                        m = {
                            "workload": workload,
                            "batch": batch,
                            "side": name,
                            "round": round_,
                            "request": i,
                            "first_difference_at": at,
                            "tokens": a[at : at + 8],
                            "k0_tokens": b[at : at + 8],
                            "lengths": [len(a), len(b)],
                        }
                        mismatches.append(m)
                        print(f"MISMATCH vs k=0: {m}")
            for batch in args.batches:
                torch.set_num_threads(threads)
                floor_tps[batch] = max(floor_tps.get(batch, 0.0), floor.tokens_per_s(batch))
        for side in sides:
            side.llm.shutdown()

    results: dict[str, dict] = {}
    for workload, batch, _ in rows:
        runs = best[(workload, batch)]
        base = runs["k=0"].tokens_per_s
        row = {}
        for name, run in runs.items():
            match = matching[(workload, batch)].get(name)
            pairs = prompts[(workload, batch)], run.tokens
            hits = [follows(f, p[-1], t) for p, t in zip(*pairs, strict=True)]
            row[name] = {
                "tokens_per_s": round(run.tokens_per_s, 1),
                "speedup_vs_k0": round(run.tokens_per_s / base, 3),
                "seconds": round(run.seconds, 3),
                "output_tokens": run.output_tokens,
                "steps": run.steps,
                "decode_step_ms_p50": rnd(run.decode_ms, 2),
                "num_drafts": run.num_drafts,
                "num_draft_tokens": run.num_draft_tokens,
                "num_accepted_tokens": run.num_accepted_tokens,
                "acceptance_rate": rnd(run.acceptance_rate, 3),
                "mean_accepted_length": rnd(run.mean_accepted_length, 2),
                "follows_f": round(sum(h for h, _ in hits) / sum(n for _, n in hits), 3),
                "requests_matching_k0": (
                    "ref" if name == "k=0" else f"{match[0]}/{match[1]}" if match else "n/a"
                ),
            }
        row["floor"] = {
            "tokens_per_s": round(floor_tps[batch], 1),
            "speedup_vs_k0": round(floor_tps[batch] / base, 3),
        }
        results.setdefault(workload, {})[f"b{batch}"] = row

    summary = []
    for workload, (which, target) in TARGETS.items():
        row = results.get(workload, {}).get("b1")
        speedups = {
            n: v["speedup_vs_k0"] for n, v in (row or {}).items() if n not in ("k=0", "floor")
        }
        if not speedups:
            continue
        side = (max if which == "best" else min)(speedups, key=speedups.__getitem__)
        value = speedups[side]
        summary.append(
            {
                "check": f"{workload} b1 {which} k / k=0",
                "side": side,
                "value": value,
                "target": "information" if target is None else f">= {target}",
                "met": None if target is None else value >= target,
            }
        )

    headers = ["batch", "side", "tok/s", "vs k=0", "drafting steps", "accept rate"]
    headers += ["mean accepted len", "steps", "decode step ms p50", "follow f", "match k=0"]
    for workload, by_batch in results.items():
        kind = "greedy" if GREEDY[workload] else "temperature 1, seed=i"
        print(
            f"### {workload} ({kind}): {args.prompt_len}-token prompts, "
            f"{args.max_tokens} new tokens each, copier model (tokens/s; floor: matmuls alone)\n"
        )
        table = []
        for label, row in by_batch.items():
            for name, r in row.items():
                table.append(
                    [
                        label,
                        name,
                        r["tokens_per_s"],
                        r["speedup_vs_k0"],
                        r.get("num_drafts"),
                        r.get("acceptance_rate"),
                        r.get("mean_accepted_length"),
                        r.get("steps"),
                        r.get("decode_step_ms_p50"),
                        r.get("follows_f"),
                        r.get("requests_matching_k0"),
                    ]
                )
        print_table(headers, table)
    print("### targets\n")
    if summary:
        print_table(
            ["check", "side", "value", "target", "met"],
            [[s["check"], s["side"], s["value"], s["target"], s["met"]] for s in summary],
        )
    else:
        print("none checked: they need batch 1 and a side with k > 0\n")
    if mismatches:
        print(f"{len(mismatches)} greedy request(s) differ from k=0 (printed above)\n")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(
            {
                "model": MODEL,
                "copier": {
                    "dir": model_dir,
                    "built_from": base_dir,
                    "o_proj_down_proj_scale": COPIER_SCALE,
                    "map_seed": COPIER_SEED,
                    "transformers_check": copier,
                },
                "torch": torch.__version__,
                "cpu_count": os.cpu_count(),
                "threads": threads,
                "args": vars(args),
                "engine": ENGINE,
                "warmup": warmup,
                "results": results,
                "summary": summary,
                "mismatches": mismatches,
                "left_out": LEFT_OUT,
            },
            fh,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
