"""Masking logits rows with a grammar's token bitmask (structured outputs, runner side).

Bit ``t % 32`` of word ``t // 32`` says whether token ``t`` may come next; a disallowed
token's logit becomes -inf before any sampling, so every way of choosing a token (greedy,
sampling, penalties, draft verification) sees only allowed tokens. numpy and torch only:
workers need no grammar library.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, row_of: dict[str, int], bitmasks: dict[str, np.ndarray]
) -> None:
    """Mask, in place, the rows starting at ``row_of[req_id]`` with that request's bitmask."""
    rows, masks = [], []
    for req_id, mask in bitmasks.items():
        if req_id in row_of:
            start = row_of[req_id]
            rows.extend(range(start, start + mask.shape[0]))
            masks.append(mask)
    if not rows:
        return
    vocab = logits.shape[-1]
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, low bit first.
    bits = np.unpackbits(np.concatenate(masks).view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab].astype(bool)).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = torch.where(allowed, logits[index], float("-inf"))
