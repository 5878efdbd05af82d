"""`--speculative-config` (vLLM's flag): MTP speculative decoding settings.

    python -m serving.run --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'

Keys:
* `method`: "mtp" (the checkpoint's multi-token-prediction layer drafts; docs/design.md §3.6). vLLM's
  aliases for the same drafter ("deepseek_mtp", "glm4_moe_mtp") are accepted.
* `num_speculative_tokens`: k, drafted tokens per request per step, 1…5 (GLM-5.2+ recipes use up
  to 5). The target verifies k + 1 rows per decoding request in one step.
* `adaptive`: false (default) or true — lower the drafts per step when recent acceptance is low
  (`serving.spec_decode.adaptive`).
* `adaptive_min_acceptance`: with `adaptive`, draft position j is kept while the running estimate
  of P(drafts 1…j all accepted) is at least this (default 0.3).
* `disable_by_batch_size`: no drafts in a step when more than this many requests run (vLLM's
  `speculative_disable_by_batch_size`; default none). Large decode batches are compute-bound,
  where verifying rejected drafts costs more than it saves.

Unknown keys or values fail at start-up naming the key (`SpeculativeConfigError`).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 5
METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp")


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` key or value that cannot be served (the message names the key)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Parsed `--speculative-config` (see the module docstring for the keys)."""

    num_speculative_tokens: int
    method: str = "mtp"
    adaptive: bool = False
    adaptive_min_acceptance: float = 0.3
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        """The config of a `--speculative-config` dict; None for None (the flag absent).

        Raises SpeculativeConfigError naming the key: {} (no drafter named), a separate draft
        `model`, unknown keys, a method other than MTP, k missing or outside 1…5, a threshold
        outside (0, 1], a batch size < 1."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        if not d:
            raise SpeculativeConfigError('--speculative-config {} names no drafter: give {"method": "mtp", '
                                         '"num_speculative_tokens": k}, or drop the flag')
        if "model" in d:
            raise SpeculativeConfigError("--speculative-config: this engine drafts with the checkpoint's own MTP "
                                         "layer; a separate draft `model` is not supported (drop the key)")
        known = {"method", "num_speculative_tokens", "adaptive", "adaptive_min_acceptance", "disable_by_batch_size"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = d.get("method", "mtp")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config method {method!r} is not supported; this engine "
                                         f"drafts with the checkpoint's MTP layer: method \"mtp\"")
        if "num_speculative_tokens" not in d:
            raise SpeculativeConfigError("--speculative-config num_speculative_tokens is required (1…5)")
        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"--speculative-config num_speculative_tokens must be an integer in "
                                         f"1…{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        adaptive = d.get("adaptive", False)
        if not isinstance(adaptive, bool):
            raise SpeculativeConfigError(f"--speculative-config adaptive must be true or false, got {adaptive!r}")
        amin = d.get("adaptive_min_acceptance", 0.3)
        if isinstance(amin, bool) or not isinstance(amin, (int, float)) or not 0.0 < amin <= 1.0:
            raise SpeculativeConfigError(f"--speculative-config adaptive_min_acceptance must be in (0, 1], "
                                         f"got {amin!r}")
        dbs = d.get("disable_by_batch_size")
        if dbs is not None and (isinstance(dbs, bool) or not isinstance(dbs, int) or dbs < 1):
            raise SpeculativeConfigError(f"--speculative-config disable_by_batch_size must be an integer >= 1, "
                                         f"got {dbs!r}")
        return cls(num_speculative_tokens=k, method="mtp", adaptive=adaptive, adaptive_min_acceptance=float(amin),
                   disable_by_batch_size=dbs)
