"""What one scheduler step hands to the runner: `SchedulerOutput`, the scheduled requests
(`ScheduledRequest`) and the page copies and loads that must run before the forward pass.

A module of its own (vLLM keeps it in `core/sched/output.py` for the same reason) so the KV
policies (`serving/kv_policy.py`, `serving/hisparse/`) and the runner can name these types without
importing the scheduler, which imports the policies: the dependency runs one way,
scheduler → kv_policy → scheduler_output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    request: the request (its `state_row` is set while it runs).
    num_new_tokens: query rows this step (positions start_pos .. start_pos + num_new_tokens - 1).
    start_pos: position of the first new token (= num_computed_tokens when scheduled).
    sample: True when the chunk reaches the end of the request's known tokens, so the runner
        samples a token from its last row; False for a prefill chunk that is not the last.
    first_chunk: True when the request was admitted from the waiting queue this step (new, or
        resumed after preemption): its state row may have had another owner before, so the
        runner must (re)initialise the device-side per-request state at `request.state_row`.
    num_spec_tokens: draft tokens verified this step (MTP speculative decoding): the last
        `num_spec_tokens` of the `num_new_tokens` rows are the request's `spec_token_ids`, which
        are not yet part of its tokens. 0 otherwise.
    spec_limit: asynchronous scheduling under MTP, for a request whose rows are all fed from the
        step in flight (`serving.spec_decode.feed`): the drafts the length limit and `max_tokens`
        leave room for if that step accepts none; the device verifies min(num_spec_tokens,
        spec_limit − accepted) of them, what a synchronous step would. None otherwise.
    """

    request: Request
    num_new_tokens: int
    start_pos: int
    sample: bool = False
    first_chunk: bool = False
    num_spec_tokens: int = 0
    spec_limit: int | None = None

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed this step, drafts last (valid until `update_from_output`)."""
        n = self.num_new_tokens - self.num_spec_tokens
        toks = self.request.all_token_ids[self.start_pos : self.start_pos + n]
        return toks + self.request.spec_token_ids[: self.num_spec_tokens] if self.num_spec_tokens else toks

    @property
    def positions(self) -> np.ndarray:
        """int32 positions start_pos .. start_pos + num_new_tokens - 1."""
        return np.arange(self.start_pos, self.start_pos + self.num_new_tokens, dtype=np.int32)


@dataclass
class SchedulerOutput:
    """One step: the scheduled requests in batch order (running ones first, then newly admitted
    ones), their total token count, the ids preempted while building the step, the ids that
    finished or were aborted since the previous step (the runner drops their cached state), and
    the whole-page copies `(source block, destination block)` that must run on the device before
    the step's forward pass (copy-on-write of prefix-cache pages a hit covers only in part), and
    the offloading connector's loads `(host block, destination block)` that must run before it
    too (pages of a prefix hit that come back from host memory). With MTP speculation,
    `num_draft_steps` is how many drafts per request the step proposes for the next one.
    `grammar_bitmask`: structured outputs' packed allowed-token masks of the step's sampled
    positions, int32 `[max_num_seqs + 1, k + 1, W]` in batch order (all ones for rows without a
    constraint), set by the engine after scheduling (`serving.structured_outputs`); None when no
    scheduled request is constrained. `not_marked_in_flight`: asynchronous scheduling's requests
    whose chunk `Scheduler.mark_in_flight` did not count (their chunk may come back shorter),
    applied by `update_from_output` as without asynchronous scheduling."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    page_loads: list[tuple[int, int]] = field(default_factory=list)
    num_draft_steps: int = 0
    grammar_bitmask: np.ndarray | None = None
    not_marked_in_flight: frozenset = frozenset()

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens verified in this step (all requests)."""
        return sum(sr.num_spec_tokens for sr in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when no tokens are scheduled."""
        return not self.scheduled
