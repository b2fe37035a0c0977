"""The copier of benchmarks/spec_decode.py, built from a tiny model directory: a workload
that surely drafts, for the speculative-decoding tests.

Every layer's ``o_proj`` and ``down_proj`` are scaled by 0.01 (the residual stream stays
the current token's embedding) and ``lm_head.weight[f[t]] = embed_tokens.weight[t]``, so
the greedy next token is ``f[t]``: ``f`` is one random cycle through the ids 3.. (ids
0-2 map to themselves). A prompt holding a stretch of ``f``'s orbit and ending with its
first tokens is continued by copying that stretch, so prompt lookup drafts k tokens
every step and every one is accepted.
"""

from __future__ import annotations

import json
import os
import random

import torch

FIRST = 3  # ids below map to themselves


def copier_map(vocab: int, seed: int = 0) -> list[int]:
    order = list(range(FIRST, vocab))
    random.Random(seed).shuffle(order)
    f = list(range(vocab))
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        f[a] = b
    return f


def make_copier_dir(base_dir: str, path: str) -> tuple[str, list[int]]:
    """The copier of the model at ``base_dir``, written to ``path`` (once), and its ``f``."""
    from transformers import AutoModelForCausalLM

    map_file = os.path.join(path, "copier_map.json")
    if not os.path.exists(map_file):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        assert not model.config.tie_word_embeddings
        f = copier_map(model.config.vocab_size)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.01)
                layer.mlp.down_proj.weight.mul_(0.01)
            embed = model.get_input_embeddings().weight
            model.get_output_embeddings().weight[torch.tensor(f)] = embed
        model.save_pretrained(path, safe_serialization=True)
        for name in os.listdir(base_dir):  # the tokenizer files
            if name.startswith(("tokenizer", "special_tokens")):
                with open(os.path.join(base_dir, name), "rb") as src:
                    data = src.read()
                with open(os.path.join(path, name), "wb") as dst:
                    dst.write(data)
        with open(map_file, "w") as fh:
            json.dump(f, fh)
    with open(map_file) as fh:
        return path, json.load(fh)


def orbit(f: list[int], start: int, n: int) -> list[int]:
    out = [start]
    while len(out) < n:
        out.append(f[out[-1]])
    return out


def copy_prompt(f: list[int], span: int = 40, cue: int = 4, seed: int = 0) -> list[int]:
    """Random tokens, a ``span``-token stretch of the orbit, random tokens, then the stretch's
    first ``cue`` tokens: the copier's output is the rest of the stretch and beyond."""
    rng = random.Random(seed)
    stretch = orbit(f, rng.randrange(FIRST, len(f)), span)
    noise = [rng.randrange(FIRST, len(f)) for _ in range(8)]
    return noise + stretch + noise[:3] + stretch[:cue]
