"""The model's tokenizer and the token ids that end a turn, read from its directory."""

from __future__ import annotations

import contextlib
import os


def load_tokenizer(model_dir: str, hf_config):
    """The directory's tokenizer (given its config, so it is not read again), or None."""
    if not any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, config=hf_config)


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """Every id that ends a turn: ``config.json``'s and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list: Llama 3 Instruct lists ``<|eot_id|>`` there), else
    the tokenizer's EOS."""
    from transformers import GenerationConfig

    found: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for eos in sources:
        for i in eos if isinstance(eos, list | tuple) else [eos]:
            if i is not None and int(i) not in found:
                found.append(int(i))
    if not found and tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    return tuple(found)
