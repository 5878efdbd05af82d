"""How many drafts a step verifies: the static k, or adaptive drafting.

Rule (documented in docs/spec_decode.md):
* `disable_by_batch_size` N: when more than N requests run, the step verifies no drafts (a large
  decode batch is compute-bound; rejected drafts then cost more than they save). The MTP layer
  still runs its first step over the step's rows, so its KV stays complete and drafting resumes
  at once when the batch shrinks.
* `adaptive`: the controller keeps, per draft position j = 1…k, a running estimate α_j of the
  probability that draft j is accepted given that drafts 1…j−1 were (an exponentially weighted
  mean with weight `EWMA_WEIGHT` per step that verified position j). A step verifies the largest
  n ≤ k with α_1·…·α_n ≥ `adaptive_min_acceptance` (the chance that draft n is reached and
  accepted), but always at least 1 so that acceptance keeps being measured. A position that is
  not verified drifts back towards 1 (`RECOVERY` per step), so a later rise of acceptance is
  noticed and longer drafts are tried again.
"""

from __future__ import annotations

from serving.spec_decode.config import SpeculativeConfig

EWMA_WEIGHT = 0.1
RECOVERY = 0.02


class DraftController:
    """Drafts per step for MTP speculation (see the module docstring).

    Args:
      config: the parsed `--speculative-config`.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k = config.num_speculative_tokens
        self.alpha = [1.0] * self.k  # per-position conditional acceptance estimates

    def num_drafts(self, num_running: int) -> int:
        """Drafts each decoding request may verify in the next step (0 … k)."""
        c = self.config
        if c.disable_by_batch_size is not None and num_running > c.disable_by_batch_size:
            return 0
        if not c.adaptive:
            return self.k
        n, prod = 0, 1.0
        for a in self.alpha:
            prod *= a
            if prod < c.adaptive_min_acceptance:
                break
            n += 1
        return max(1, n)

    def observe(self, verified: list[tuple[int, int]]) -> None:
        """Update the estimates from one step's `(drafts verified, drafts accepted)` per request."""
        if not self.config.adaptive:
            return
        for j in range(self.k):
            reached = [(n, a) for n, a in verified if n > j and a >= j]
            if reached:
                rate = sum(a > j for _, a in reached) / len(reached)
                self.alpha[j] += EWMA_WEIGHT * (rate - self.alpha[j])
            else:
                self.alpha[j] += RECOVERY * (1.0 - self.alpha[j])
