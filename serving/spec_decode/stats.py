"""Acceptance counters of MTP speculation (vLLM's spec-decode metrics).

* `num_drafts`: verifications (one per request per step that verified ≥ 1 draft).
* `num_draft_tokens`: drafts verified. `num_accepted_tokens`: drafts accepted.
* `accepted_per_pos[j]`: drafts accepted at position j (0-based): non-increasing in j, summing to
  `num_accepted_tokens` (a draft is accepted only after all before it).
* Mean acceptance length = 1 + accepted / drafts (tokens a verifying request gains per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters over some span (one step, or since start-up); see the module docstring."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One request's verification: `num_draft` drafts, the first `num_accepted` accepted."""
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        """Accumulate another span's counters."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, v in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[j] += v

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (1.0 before any verification)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position_rates(self) -> list[float]:
        """Accepted at position j / verifications (P(draft j accepted) per verification)."""
        return [v / self.num_drafts if self.num_drafts else 0.0 for v in self.accepted_per_pos]
