"""Masking logits rows with a grammar's token bitmask (structured outputs, runner side).

Bit ``t % 32`` of word ``t // 32`` says whether token ``t`` may come next; a disallowed
token's logit becomes -inf before any sampling, so every way of choosing a token (greedy,
sampling, penalties, draft verification) sees only allowed tokens. Plain torch: workers
need no grammar library.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(
    logits: torch.Tensor, row_of: dict[str, int], bitmasks: dict[str, np.ndarray]
) -> None:
    """Mask, in place, the rows starting at ``row_of[req_id]`` with that request's bitmask."""
    if not bitmasks:
        return
    rows, masks = [], []
    for req_id, mask in bitmasks.items():
        if req_id in row_of:
            start = row_of[req_id]
            rows.extend(range(start, start + mask.shape[0]))
            masks.append(mask)
    if not rows:
        return
    words = torch.from_numpy(np.concatenate(masks)).to(logits.device)
    allowed = ((words[:, :, None] >> _BITS.to(logits.device)) & 1).bool().flatten(1)
    index = torch.tensor(rows, device=logits.device)
    vocab = logits.shape[-1]
    block = logits[index]
    block.masked_fill_(~allowed[:, :vocab], float("-inf"))
    logits[index] = block
