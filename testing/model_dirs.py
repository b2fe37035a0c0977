"""Build tiny Hugging Face model directories locally (no downloads).

A transformers config, random weights from a fixed seed saved with
safetensors, and a small byte-level BPE tokenizer trained on a built-in
text: everything a model directory from a hub would have, at toy size.
Tests, examples and benchmarks use these; transformers' own implementation
on the same directory is the ground truth.
"""

from __future__ import annotations

import os
from typing import Any

import torch

CORPUS = (
    "the quick brown fox jumps over the lazy dog. a compiler turns a model into code. "
    "inference runtimes batch requests, page the kv cache and capture graphs. "
    "once upon a time there was a tiny language model that learned to count: one two three "
    "four five six seven eight nine ten. hello world, hello runtime, hello compiler. "
)

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    # Sliding window on alternate layers, small enough that the test prompts exceed it;
    # attention and final logit soft caps at transformers' defaults (50, 30).
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8},
}


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small config of the given architecture (``llama``, ``mistral``, ``qwen2``, ``qwen3``,
    ``gemma2``, or any other transformers knows, with its defaults)."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(ARCH_DEFAULTS.get(arch, {}))
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on ``CORPUS`` with at most ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def make_model_dir(
    path: str,
    arch: str = "llama",
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> str:
    """Write a tiny model directory at ``path`` and return it (skips if already complete)."""
    from transformers import AutoModelForCausalLM

    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path
    os.makedirs(path, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so greedy choices are decisive
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    if with_tokenizer:
        build_tokenizer(config.vocab_size).save_pretrained(path)
    open(marker, "w").close()
    return path
