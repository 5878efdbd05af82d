"""What bounds one request under Hybrid HiSparse, in words a user can act on: the largest prompt
the engine admits, whether the device pool (fully resident), the device pages of the indexer keys
next to the prefill lease and the in-flight window, or the host pool binds it, and the setting that
would admit more (docs/hisparse.md, the refusal at `add_request` and the start-up warning).

`AdmissionBoundMixin` holds these methods; `HiSparsePolicy` (serving/hisparse/residency.py)
provides `kv`, `group`, `tpp`, `host` and `max_pages`.
"""

from __future__ import annotations

import math


class AdmissionBoundMixin:
    """One request's capacity under HiSparse and the messages naming its bound (module docstring);
    mixed into `HiSparsePolicy`."""

    def token_capacity(self) -> int:
        """Most tokens one request can hold: fully resident on the device (all groups fit the
        pool), or under HiSparse: its sealed MLA pages fit the host pool while its other groups'
        pages (the indexer keys), a largest lease and a window of four MLA pages fit the device."""
        resident, offloaded, host_bound = self._capacities()
        return max(resident, min(offloaded, host_bound))

    def _capacities(self) -> tuple[int, int, int]:
        """(tokens fully resident, tokens whose other groups' pages fit next to the largest lease
        and a 4-page window, tokens the host pool holds): `token_capacity`'s three bounds."""
        usable = self.kv.pool.num_usable_blocks

        def largest(groups, budget, hi):  # largest L whose pages of `groups` fit `budget`
            lo = 0
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if sum(math.ceil(mid / g.tokens_per_page) for g in groups) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        resident = largest(self.kv.groups, usable, usable * max(g.tokens_per_page for g in self.kv.groups))
        host_bound = (self.host.num_usable + 2) * self.tpp
        others = [g for g in self.kv.groups if g.name != self.group]
        offloaded = largest(others, usable - self.max_pages - 4, host_bound)
        return resident, offloaded, host_bound

    def capacity_note(self) -> str:
        """Names HiSparse's bound on one request: the device pages its indexer keys (and other
        groups) need next to the prefill lease and the in-flight window, or the host pool (the
        text the scheduler appends to its refusal)."""
        cap, why, fix = self.admission_bound()
        return f"; the largest prompt this engine admits is {cap} tokens: {why}; it needs {fix}"

    def admission_note(self, max_model_len: int) -> str | None:
        """The start-up warning when HiSparse bounds one request below `max_model_len` (its bound,
        the largest prompt, the longest request, the setting to change); None when a request may
        reach `max_model_len` tokens. The scheduler finishes a request with "length" at `cap` + 1
        tokens and the engine refuses a prompt + `max_tokens` beyond that."""
        cap, why, fix = self.admission_bound()
        if cap + 1 >= max_model_len:
            return None
        return (f"HiSparse: prompts longer than {cap} tokens will be refused and a request's prompt and output "
                f"together are limited to {cap + 1} tokens (the context length the server reports and checks) "
                f"although --max-model-len is {max_model_len}: {why}; admitting them needs {fix}")

    def admission_bound(self) -> tuple[int, str, str]:
        """(the largest prompt in tokens one request may have, what bounds it, what would admit
        more): fully resident on the device, the device pages of the other groups next to the
        prefill lease and the in-flight window, or the host pool."""
        resident, offloaded, host_bound = self._capacities()
        usable = self.kv.pool.num_usable_blocks
        others = [g for g in self.kv.groups if g.name != self.group]
        per = ", ".join(f"{g.name}: 1 page per {g.tokens_per_page} tokens" for g in others)
        cap = max(resident, min(offloaded, host_bound))
        if resident >= min(offloaded, host_bound):
            why = "it fits only fully resident on the device"
            fix = "a larger pool (--num-gpu-blocks-override / --gpu-memory-utilization)"
        elif offloaded < host_bound:
            why = (f"under Hybrid HiSparse its {per} must stay on the device next to the prefill lease "
                   f"(hisparse_config.prefill_buffer_size: {self.max_pages} pages) and the in-flight window "
                   f"(4 pages), {self.max_pages + 4} of the {usable} pages")
            fix = ("a larger pool (--num-gpu-blocks-override / --gpu-memory-utilization) or a smaller "
                   "hisparse_config.prefill_buffer_size")
        else:
            why = (f"its MLA pages must fit the host pool (hisparse_config.host_pool_gib: "
                   f"{self.host.num_usable} blocks of {self.tpp} tokens)")
            fix = "a larger hisparse_config.host_pool_gib"
        return cap, why, fix
