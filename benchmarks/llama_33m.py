"""The Llama-shaped model (~33M parameters) and prompts shared by the generation benchmarks."""

from __future__ import annotations

MODEL = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=1024,
)


def prompts(n: int, length: int, vocab: int = MODEL["vocab_size"]) -> list[list[int]]:
    """``n`` deterministic prompts of about ``length`` tokens, lengths varying by request."""
    return [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(length + i % 5)] for i in range(n)]
