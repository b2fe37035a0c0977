"""The model's tokenizer and the token ids that end a turn, read from its directory."""

from __future__ import annotations

import contextlib
import os

from compile_runtime.models.loader import ModelFileError, read_json_object

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str, hf_config):
    """The directory's tokenizer (given its config, so it is not read again), or None."""
    if not any(
        os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    files = [os.path.join(model_dir, f) for f in _TOKENIZER_FILES]
    for path in files:
        if os.path.isfile(path):
            read_json_object(path)
    try:
        return AutoTokenizer.from_pretrained(model_dir, config=hf_config)
    except (ImportError, OSError):
        raise
    except Exception as e:  # a damaged file's fields: errors of every kind from the parsers
        detail = " ".join(str(e).split())[:300]
        raise ModelFileError(
            f"the tokenizer in {' and '.join(p for p in files if os.path.isfile(p))} cannot be "
            f"read: {detail} ({type(e).__name__}); restore the files from the model's source"
        ) from None


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """Every id that ends a turn: ``config.json``'s and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list: Llama 3 Instruct lists ``<|eot_id|>`` there), else
    the tokenizer's EOS."""
    from transformers import GenerationConfig

    found: list[int] = []
    sources = [("config.json", getattr(hf_config, "eos_token_id", None))]
    generation = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation):  # damaged: an error, not EOS ids silently dropped
        read_json_object(generation)
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json
        sources.append(
            ("generation_config.json", GenerationConfig.from_pretrained(model_dir).eos_token_id)
        )
    for file, eos in sources:
        for i in eos if isinstance(eos, list | tuple) else [eos]:
            if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0):
                raise ModelFileError(
                    f"{os.path.join(model_dir, file)}: eos_token_id {eos!r} is not a token id "
                    "or a list of them; fix the field"
                )
            if i is not None and i not in found:
                found.append(i)
    if not found and tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    return tuple(found)
