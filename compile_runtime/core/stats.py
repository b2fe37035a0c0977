"""What the engine core counts: prompt tokens found in the prefix cache, and how well
speculative decoding's drafts fare (proposed, accepted, per verifying step)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step gives a request: 1 (always) + its accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
        )


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache when requests were admitted, and found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def since(self, earlier: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries - earlier.queries, self.hits - earlier.hits)
