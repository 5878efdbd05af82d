"""Engine-side request state.

A `Request` is the scheduler's record of one generation: its tokens, how many of them have KV in
the cache (`num_computed_tokens`), its status and its stable per-request state row. The scheduler
mutates it; the runner only reads it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from serving.types import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request. WAITING/PREEMPTED sit in the waiting queue, RUNNING in the batch;
    the FINISHED_* states are final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the engine step that ran it failed (vLLM's finish reason "error")

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* states."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """Finish reason: "stop", "length", "abort", "error", or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation request.

    request_id: unique string id.
    prompt_token_ids: the prompt (non-empty; checked by the scheduler).
    sampling_params: sampling and stopping controls.
    arrival_time: `time.monotonic()` seconds at creation unless given.
    output_token_ids: generated tokens so far (use `append_output_token_ids` to extend).
    status: see `RequestStatus`.
    num_computed_tokens: leading tokens of `all_token_ids` whose KV is in the cache.
    num_cached_tokens: prompt tokens served from the prefix cache (0 without prefix caching).
    state_row: stable row of this request in device-side per-request state arrays (HiSparse hot
        state, ...), assigned by the scheduler while the request runs, None otherwise.
    num_preemptions: times this request was preempted (its KV dropped and recomputed).
    block_hashes: chained prefix hashes of its full hash units (filled by the prefix cache).
    num_published_units: leading hash units already offered to the prefix cache.
    first_token_time / last_token_time: `time.monotonic()` of its first and latest generated
        token (None before the first), for the latency metrics.
    spec_token_ids: draft tokens proposed by the previous step (MTP speculative decoding) for the
        next step to verify; not part of `all_token_ids` until accepted.
    do_remote_decode: a prefill engine keeps this request's KV for a decode engine when it
        finishes (`serving/pd/producer.py`); `kv_transfer_params_out` is then what its response says.
    remote_kv: on a decode engine, the KV pulled from the prefill engine (`serving.pd.consumer.
        RemoteKV`) until admission lands it in the request's pages.
    num_output_placeholders: asynchronous scheduling (`serving/async_scheduling.py`): tokens
        being sampled by steps in flight, not yet in `output_token_ids`. A step scheduled now
        feeds the first of them from the device; `num_computed_tokens` already counts the
        positions those steps write, so it may exceed `num_tokens` by this many.
    num_draft_placeholders / max_accepted_in_flight: asynchronous scheduling under MTP speculation:
        the drafts the step in flight proposes for this request (its next step verifies them, fed
        on the device; `spec_token_ids` is then empty) and the most of its verified drafts that step
        may accept (so it emits 1 … 1 + this many tokens, and the next step's rows sit that many
        positions further at most). `num_computed_tokens` counts none of them until read back.
    penalty_state: the request's penalties and logit bias as a sparse list kept up to date with its
        output (`serving.penalties.PenaltyState`), created by the first step that samples it; None
        otherwise.
    prompt_logprobs_buf / prompt_logprobs_sent: a request with `SamplingParams.prompt_logprobs`: its
        prompt logprobs computed so far (`serving.prompt_logprobs.PromptLogprobs`, None before the
        first step that computes some) and whether its first output carried them.

    A step may schedule any number of new tokens for a request (a prefill chunk, one decode
    token, or a decode token plus draft tokens for speculative verification).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    state_row: int | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_units: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    do_remote_decode: bool = False
    kv_transfer_params_out: dict | None = None
    remote_kv: object | None = None
    dp_rank: int | None = None  # the data-parallel replica chosen for it before it was queued
    num_output_placeholders: int = 0
    num_draft_placeholders: int = 0
    max_accepted_in_flight: int = 0
    penalty_state: object | None = None
    prompt_logprobs_buf: object | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """len(all_token_ids)."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """len(prompt_token_ids)."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids)."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the status is a FINISHED_* state."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort", or None while unfinished."""
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated tokens to both `output_token_ids` and `all_token_ids`."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
