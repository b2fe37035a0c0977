"""Draft tokens by n-gram lookup in a request's own tokens (prompt lookup decoding).

For each request, the last n tokens are searched for earlier in its prompt and
output, n from ``max_n`` down to ``min_n`` (the longest n with a match wins); the
tokens that followed the chosen occurrence, up to k, are the draft. The chosen one
is the most recent occurrence followed by k known tokens; when every occurrence is
closer than that to the end (text repeating with a period shorter than k, a model
looping on one token), the earliest, which is followed by the most. The most recent
occurrence alone drafts one token a step on a run of one repeated token; the earliest
alone drafts from an old version of a revised text and has drafts rejected; this rule
takes the better of the two on both, and all three are the same where the text occurs
once (``benchmarks/spec_decode.py``, the README's table of rules). Text that repeats
itself (code, quoted passages, lists, a model looping) gives drafts the model
accepts; text that does not gives no match and so no draft: a request without a
match is scheduled for one token as usual, so speculation costs nothing but the
lookup where it cannot help.

The lookup is vectorised over the batch and costs one comparison of the
token array per n: a match of the last n tokens ending at position j is a
match of the last n - 1 tokens ending at j and the n-th last token at
j - n + 1, so the masks are built up from n = 1 and the search stops as soon
as no row has a match left (usually at n = 2 for text that does not repeat).
"""

from __future__ import annotations

import numpy as np


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
        rows = np.arange(num_rows)
        columns = np.arange(width)[None, :]
        # A match may end at j only if a known token follows it (which also rules out the
        # suffix itself): j <= length - 2; k known tokens follow it when j <= length - 1 - k.
        match = columns <= (lengths - 2)[:, None]
        complete = columns <= (lengths - 1 - self.k)[:, None]
        end = np.full(num_rows, -1, dtype=np.int64)  # the best match's last position
        for n in range(1, self.max_n + 1):
            # match[r, j]: tokens[r, j - n + 1 : j + 1] equal the row's last n tokens.
            nth_last = tokens[rows, np.maximum(lengths - n, 0)]
            match[:, n - 1 :] &= tokens[:, : width - n + 1] == nth_last[:, None]
            match[:, : n - 1] = False
            found = match.any(axis=1)
            if not found.any():
                break
            if n >= self.min_n:  # a longer match overrides a shorter one
                full = match & complete
                latest_full = width - 1 - np.argmax(full[:, ::-1], axis=1)
                earliest = np.argmax(match, axis=1)
                best = np.where(full.any(axis=1), latest_full, earliest)
                end[found] = best[found]
        for row in np.nonzero(end >= 0)[0].tolist():
            begin = int(end[row]) + 1
            stop = min(begin + self.k, int(lengths[row]))
            drafts[row] = token_ids[row, begin:stop].tolist()
        return drafts
