"""What the model runner reports about a step: its sizes and times (`StepStats`, `ModelRunner.last`)
and a dispatched step not read back yet (`InFlightStep`, asynchronous scheduling)."""

from __future__ import annotations

from dataclasses import dataclass

from serving.scheduler_output import SchedulerOutput


@dataclass
class StepStats:
    """One step's sizes and times: tokens scheduled and its bucket; host_prepare_s: building the
    inputs (seconds); device_s: from dispatch until the sampled tokens were on the host (with
    asynchronous scheduling: the time spent waiting for them)."""
    num_tokens: int = 0
    padded_tokens: int = 0
    host_prepare_s: float = 0.0
    device_s: float = 0.0


@dataclass
class InFlightStep:
    """A dispatched step whose outputs were not read yet (`ModelRunner.dispatch` → `finish`).

    scheds: its `SchedulerOutput`s, one per DP replica (one for an engine without
    `--data-parallel-size`; `sched` is the first). out: the sampler's outputs, on the device
    (`out[0]`: the sampled token per request row, int32 [dp · B], replica-major). stats:
    HiSparse's (stats_Z5, first_drop_S) on the device, or None. rows: request id → its row of `out`
    (sampling requests only: what the next step feeds from the device for a request with an
    output placeholder; ids are unique across replicas). num_tokens / padded_tokens: the step's
    tokens and bucket (all replicas). prepare_s: host seconds to build its inputs; dispatched: the
    `time.perf_counter()` of its dispatch. policy_rows: Hybrid HiSparse's query rows per request
    of the step, one dict per replica (`HiSparsePolicy.step_rows`, set by the engine), or None.
    deferred: a step dispatched without its sampler (`ModelRunner.sample_deferred`): (its logits
    on the device, its `StepInputs.extra`); `out` is None until then. prompt_logprobs: the step's
    (`serving.prompt_logprobs.PromptLogprobRows`, their outputs on the device) or None.
    num_verified: asynchronous MTP, request id → the drafts its fed rows really verify (the device
    cuts them at the limits after the accepted count of the step before,
    `ScheduledRequest.spec_limit`), filled when that step is read back; None before.
    """
    scheds: list
    out: tuple | None
    stats: tuple | None
    want_lp: bool
    rows: dict
    num_tokens: int
    padded_tokens: int
    prepare_s: float
    dispatched: float
    policy_rows: list | None = None
    deferred: tuple | None = None
    prompt_logprobs: tuple | None = None
    num_verified: dict | None = None

    @property
    def sched(self) -> SchedulerOutput:
        """The step's `SchedulerOutput` (replica 0's under data parallelism)."""
        return self.scheds[0]
