"""Automatic prefix caching, off vs on, side by side with transformers, one run.

The ~33M-parameter Llama of ``llama_33m.py`` (random weights, built locally),
greedy, EOS ignored, on two workloads:

* ``shared``: a system prompt of ``--system`` (512) tokens shared by ``--requests`` (64)
  requests, each with its own ``--suffix`` (32)-token question, ``--max-tokens`` (16)
  new tokens each;
* ``distinct``: the mixed workload of ``vs_transformers.py`` (prompts of 8-200 tokens,
  8-128 output tokens), nothing shared: what caching costs when it cannot help.

Sides, every one on the same requests in each round:

* ``ours_off`` / ``ours_on``: ``cr.LLM`` (PIECEWISE, inductor) with
  ``enable_prefix_caching=False`` / the default (on);
* ``hf_reuse`` (shared workload only): transformers' prompt-reuse recipe: run the
  system prompt once into a ``DynamicCache``, then per batch of 8 requests copy it,
  repeat it over the batch and ``generate`` from it;
* ``floor``: the model's matmuls alone over the prefill tokens ``ours_on`` computes
  (a ``[256, hidden]`` activation through every weight), in seconds: the hardware's
  bound on prefill with the cache.

Every round uses fresh prompt tokens (the same lengths), so each side meets each
prefix for the first time: the cache gains only within a round, never from the
previous one. Per side: prefill tokens computed (tokens run through the model minus
one per decode), the ratio on/off, time to first token (from the call's start; every
request is queued at once) p50 and p90, output tokens/s, and whether the greedy
tokens match ``ours_off``. Each side keeps its fastest round.

    python benchmarks/prefix_cache.py [--repeats 2] [--out benchmarks/results/prefix_cache.json]

Left out: tokenization (prompts are token ids), requests arriving over time (all are
queued at once, so the first requests of a step cannot hit blocks computed in that
same step), prefixes evicted by memory pressure (the KV cache holds every request),
GPUs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import repo_root  # noqa: F401  (testing/ on the path)
import torch
import transformers
from llama_33m import MODEL
from transformers import AutoModelForCausalLM, DynamicCache
from vs_transformers import Floor, print_table

import compile_runtime as cr
from testing.model_dirs import make_model_dir

HF_BATCH = 8
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024)
LEFT_OUT = [
    "tokenization (prompts are token ids)",
    "requests arriving over time (all queued at once)",
    "eviction under memory pressure (the KV cache holds every request)",
    "GPUs (CPU only)",
]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    prefill_tokens: int | None = None
    ttft: list[float] | None = None
    hit_rate: float | None = None
    matching: int | None = None  # requests whose tokens equal ours_off's in the same round


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]


def shared_workload(args, round_: int) -> tuple[list[int], list[Request]]:
    rng = random.Random(1000 + round_)
    system = tokens(rng, args.system)
    return system, [
        Request(system + tokens(rng, args.suffix), args.max_tokens) for _ in range(args.requests)
    ]


def distinct_workload(args, round_: int) -> list[Request]:
    lengths = random.Random(0)  # the lengths of vs_transformers' mixed workload
    rng = random.Random(2000 + round_)
    out = []
    for _ in range(args.requests):
        prompt_len, out_len = lengths.randint(8, 200), lengths.randint(8, 128)
        out.append(Request(tokens(rng, prompt_len), out_len))
    return out


class Ours:
    def __init__(self, name: str, model_dir: str, caching: bool, cache_dir: str):
        self.name = name
        self.llm = cr.LLM(
            model_dir,
            {"backend": "inductor", "cache_dir": cache_dir},
            device="cpu",
            enable_prefix_caching=caching,
            kv_cache_bytes=512 * 2**20,  # every request at once: no preemption, no eviction
            **ENGINE,
        )

    def run(self, requests: list[Request]) -> Run:
        params = [
            cr.SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            for r in requests
        ]
        start = time.perf_counter()
        outputs = self.llm.generate([r.prompt for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = self.llm.last_stats
        decodes = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
        return Run(
            [o.outputs[0].token_ids for o in outputs],
            seconds,
            prefill_tokens=stats.scheduled_tokens - decodes,
            ttft=[o.first_token_seconds for o in outputs],
            hit_rate=stats.prefix_cache.hit_rate,
        )


class HFReuse:
    """transformers' documented prompt reuse: the shared prefix's cache computed once."""

    name = "hf_reuse"

    def __init__(self, model_dir: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def run(self, system: list[int], requests: list[Request]) -> Run:
        start = time.perf_counter()
        prefix = DynamicCache(config=self.model.config)
        self.model(torch.tensor([system]), cache=prefix)
        out_tokens, ttft = [], []
        for i in range(0, len(requests), HF_BATCH):
            group = requests[i : i + HF_BATCH]
            cache = copy.deepcopy(prefix)
            cache.batch_repeat_interleave(len(group))
            ids = torch.tensor([r.prompt for r in group])  # equal lengths: no padding
            out = self.model.generate(
                ids,
                cache=cache,
                max_new_tokens=group[0].max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            done = time.perf_counter() - start
            out_tokens += out[:, ids.shape[1] :].tolist()
            ttft += [done] * len(group)  # generate returns the batch's tokens at its end
        return Run(out_tokens, time.perf_counter() - start, ttft=ttft)


def summarize(requests: list[Request], runs: dict[str, Run]) -> dict:
    useful = sum(r.max_tokens for r in requests)
    out = {}
    for name, run in runs.items():
        out[name] = {
            "seconds": round(run.seconds, 3),
            "tokens_per_s": round(useful / run.seconds, 1),
            "prefill_tokens": run.prefill_tokens,
            "ttft_p50_s": run.ttft and round(statistics.median(run.ttft), 3),
            "ttft_p90_s": run.ttft and round(statistics.quantiles(run.ttft, n=10)[-1], 3),
            "hit_rate": run.hit_rate if run.hit_rate is None else round(run.hit_rate, 3),
            "requests_matching_ours_off": run.matching,
        }
    return out


def keep_fastest(best: dict[str, Run], runs: dict[str, Run]) -> None:
    """Keep each side's faster round; tokens are compared with ours_off of the same round
    (every round has its own prompts)."""
    reference = runs["ours_off"].tokens
    for name, run in runs.items():
        run.matching = sum(a == b for a, b in zip(run.tokens, reference, strict=True))
        if name not in best or run.seconds < best[name].seconds:
            best[name] = run


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--suffix", type=int, default=32, help="each request's own tokens")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "cr_llama_33m"))
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "prefix_cache.json")
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model_dir = make_model_dir(args.model_dir, arch="llama", with_tokenizer=False, **MODEL)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as cache_dir:
        sides = [
            Ours("ours_off", model_dir, False, cache_dir),
            Ours("ours_on", model_dir, True, cache_dir),
        ]
        hf = None if args.no_hf else HFReuse(model_dir)
        floor = Floor(model_dir)
        warm = [Request(tokens(random.Random(7), n), 4) for n in (600, 40, 9)]
        for side in sides:  # compile every shape before timing
            side.run(warm)
        shared: dict[str, Run] = {}
        distinct: dict[str, Run] = {}
        floor_tps = 0.0
        for round_ in range(args.repeats):
            system, requests = shared_workload(args, round_)
            runs = {}
            for side in sides:
                torch.set_num_threads(threads)
                runs[side.name] = side.run(requests)
            if hf is not None:
                torch.set_num_threads(threads)
                runs[hf.name] = hf.run(system, requests)
            keep_fastest(shared, runs)
            mixed = distinct_workload(args, round_)
            runs = {}
            for side in sides:
                torch.set_num_threads(threads)
                runs[side.name] = side.run(mixed)
            keep_fastest(distinct, runs)
            floor_tps = max(floor_tps, floor.tokens_per_s(256, steps=3))
        for side in sides:
            side.llm.shutdown()

    _, requests = shared_workload(args, 0)
    results = {
        "shared": summarize(requests, shared),
        "distinct": summarize(distinct_workload(args, 0), distinct),
    }
    on_prefill = shared["ours_on"].prefill_tokens
    results["shared"]["floor"] = {"seconds": round(on_prefill / floor_tps, 3)}
    ratios = {
        "prefill_tokens_on_over_off": round(on_prefill / shared["ours_off"].prefill_tokens, 3),
        "ttft_p50_on_over_off": round(
            results["shared"]["ours_on"]["ttft_p50_s"]
            / results["shared"]["ours_off"]["ttft_p50_s"],
            3,
        ),
        "shared_throughput_on_over_off": round(
            shared["ours_off"].seconds / shared["ours_on"].seconds, 3
        ),
        "distinct_throughput_on_over_off": round(
            distinct["ours_off"].seconds / distinct["ours_on"].seconds, 3
        ),
    }

    headers = ["side", "prefill tokens", "TTFT p50 s", "TTFT p90 s", "tok/s", "seconds"]
    headers += ["hit rate", "match ours_off"]
    for name, rows in results.items():
        title = (
            f"{args.requests} requests sharing a {args.system}-token system prompt "
            f"+ {args.suffix} own tokens, {args.max_tokens} new tokens each"
            if name == "shared"
            else f"{args.requests} mixed requests (8-200 prompt, 8-128 new tokens), nothing shared"
        )
        print(f"### {name}: {title}\n")
        print_table(
            headers,
            [
                [
                    side,
                    r.get("prefill_tokens"),
                    r.get("ttft_p50_s"),
                    r.get("ttft_p90_s"),
                    r.get("tokens_per_s"),
                    r["seconds"],
                    r.get("hit_rate"),
                    r.get("requests_matching_ours_off"),
                ]
                for side, r in rows.items()
            ],
        )
    print_table(["ratio", "value"], list(ratios.items()))

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
                "engine": ENGINE,
                "results": results,
                "ratios": ratios,
                "left_out": LEFT_OUT,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
