"""Draft tokens by n-gram lookup in a request's own tokens (prompt lookup decoding).

For each request, the last n tokens are searched for earlier in its prompt and
output, n from ``max_n`` down to ``min_n``; at the most recent earlier
occurrence, the (up to k) tokens that followed it are the draft. Text that
repeats itself (code, quoted passages, lists, a model looping) gives drafts the
model accepts; text that does not gives no match and so no draft: a request
without a match is scheduled for one token as usual, so speculation costs
nothing but the lookup where it cannot help.

The lookup is vectorised over the batch: one comparison of every window of
every row against that row's suffix per n, on the persistent token array.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts per row of ``token_ids[i, :num_tokens[i]]`` (an empty list: no match)."""
        num_rows = len(num_tokens)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if num_rows == 0:
            return drafts
        lengths = num_tokens.astype(np.int64)
        width = int(lengths.max())
        tokens = token_ids[:, :width]
        start = np.full(num_rows, -1, dtype=np.int64)  # where the draft starts, per row
        for n in range(self.max_n, self.min_n - 1, -1):
            todo = np.nonzero((start < 0) & (lengths > n))[0]
            if not todo.size or width <= n:
                continue
            rows = tokens[todo]
            suffix = rows[np.arange(len(todo))[:, None], lengths[todo, None] - n + np.arange(n)]
            # windows[r, i] = rows[r, i : i + n]; a match needs a known token after it (which
            # also rules out the suffix itself).
            windows = sliding_window_view(rows, n, axis=1)
            match = (windows == suffix[:, None, :]).all(axis=2)
            positions = np.arange(match.shape[1])
            match &= positions[None, :] <= (lengths[todo] - n - 1)[:, None]
            found = match.any(axis=1)
            last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)
            start[todo[found]] = last[found] + n
        for row in np.nonzero(start >= 0)[0].tolist():
            begin = int(start[row])
            end = min(begin + self.k, int(lengths[row]))
            drafts[row] = token_ids[row, begin:end].tolist()
        return drafts
