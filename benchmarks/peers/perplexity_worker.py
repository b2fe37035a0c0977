"""One side of ``benchmarks/perplexity.py``, in its own process and virtualenv.

``worker.py``'s protocol and sides (``ours``, ``llamacpp``), with one more request:

    {"op": "nll", "windows": [[token ids], ...]}
        -> {"nll": [[-log p(ids[i] | ids[:i]) for i in 1..len-1], ...], "seconds": ...}
    {"op": "run", "requests": [[prompt_token_ids, max_tokens], ...]}   (greedy, as worker.py)

Each window is scored on its own, from an empty context: position 0 has no score.

* ``ours``: one ``generate`` call over all windows with ``SamplingParams(prompt_logprobs=0,
  max_tokens=1)``; each prompt position's chosen-token logprob is the engine's own
  (log-softmax in float32 of the model's logits over the full vocabulary).
* ``llamacpp``: ``Llama(logits_all=True)``; per window ``reset()``, ``eval(ids)``, then the
  logits of every position (``scores``) in float64: log-softmax over the full vocabulary.

    <venv>/bin/python benchmarks/peers/perplexity_worker.py --side ours|llamacpp
        --precision fp32|bf16|q8_0|q4_1 --model FILE.gguf [--options JSON]
"""

from __future__ import annotations

import json
import time

import worker  # benchmarks/peers/worker.py (this file's directory is on sys.path)


def nll_from_logits(logits, targets) -> list[float]:
    """``-log_softmax(logits[i])[targets[i]]`` per row, in float64 (numpy)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=-1))
    return (lse - x[np.arange(len(targets)), np.asarray(targets)]).tolist()


def nll_llamacpp(side: worker.LlamaCppSide, windows: list[list[int]]) -> list[list[float]]:
    out = []
    for ids in windows:
        side.llm.reset()  # no KV from the previous window
        side.llm.eval(ids)
        out.append(nll_from_logits(side.llm.scores[: len(ids) - 1], ids[1:]))
    return out


def nll_ours(side: worker.OursSide, windows: list[list[int]]) -> list[list[float]]:
    params = side.cr.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = side.llm.generate(windows, params, use_tqdm=False)
    out = []
    for ids, o in zip(windows, outputs, strict=True):
        entries = o.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        out.append([-float(chosen) for chosen, _top in entries[1:]])
    return out


NLL = {"ours": nll_ours, "llamacpp": nll_llamacpp}


def main() -> None:
    sides: dict[int, str] = {}

    def make_side(args):
        side = worker.SIDES[args.side](args.model, args.precision, json.loads(args.options))
        sides[id(side)] = args.side
        return side

    def answer(side, msg: dict) -> dict:
        if msg["op"] == "run":
            return worker._answer_run(side, msg)
        if msg["op"] != "nll":
            raise ValueError(f"unknown op {msg['op']!r}")
        start = time.perf_counter()
        nll = NLL[sides[id(side)]](side, [list(map(int, w)) for w in msg["windows"]])
        return {"nll": nll, "seconds": time.perf_counter() - start}

    worker.serve(make_side, answer)


if __name__ == "__main__":
    main()
