"""`StepInputs`: one engine step's host inputs (`serving.runner.ModelRunner.run_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass

from glm53.batch import ForwardBatch

# Positions in `StepInputs.extra`: the sampler's arrays (temperature … steps, then want_logprobs),
# then the page copies.
NUM_SAMPLING = 7
STEPS, WANT_LOGPROBS, COPY_SRC, COPY_DST = 5, 6, 7, 8


@dataclass
class StepInputs:
    """One step's host inputs, all numpy: what `ModelRunner.prepare` builds and what a multi-host
    leader sends its followers (`serving.multihost`).

    batch: the `ForwardBatch` (its `hot` is None for the plain program). extra: (temperature
    float32 [B], top_p float32 [B], top_k int32 [B], min_p float32 [B], seeds uint32 [B], steps
    int32 [B], want_logprobs bool, copy_src int32 [C], copy_dst int32 [C]) as `prepare` returns
    them (the first `NUM_SAMPLING` are the sampler's; `WANT_LOGPROBS`, `COPY_SRC`, `COPY_DST` index
    the rest). spec: the
    `serving.spec_decode.inputs.SpecBatch` under MTP speculation, else None. bitmask: structured
    outputs' allowed-token masks, int32 [B, W] (or [B, k + 1, W] under MTP speculation), or None
    when no row of the step is constrained. feed_src: asynchronous scheduling's placeholder rows,
    int32 [T] in the placed token order: row i's input id is the previous step's sampled token
    of request row feed_src[i] where ≥ 0 (`ModelRunner._feed`), taken on the device by every
    process from its own copy of that step's outputs; None when no row is fed. penalties: the
    sampled rows' penalties and logit biases (`serving.penalties.step_penalties`: seven arrays),
    or None when no row uses any (or the step's sampler is deferred). prompt_rows: the step's
    prompt-logprob rows (rows_P int32 [P], targets_P int32 [P], count int32: `serving.prompt_logprobs.
    PromptLogprobRows.arrays`) or None. spec_feed: asynchronous scheduling under MTP speculation,
    the rows taken from the previous step's outputs (`serving.spec_decode.feed.spec_feed_plan`'s
    six int32 arrays, replicas stacked: token rows' source and draft index in the placed order, MTP
    inputs' and request rows' sources and limits in the host's), applied on the device by every process
    (`ModelRunner._spec_inputs`); None when no row is fed (`feed_src` is then always None).
    """

    batch: ForwardBatch
    extra: tuple
    spec: object = None
    bitmask: object = None
    feed_src: object = None
    penalties: object = None
    prompt_rows: object = None
    spec_feed: object = None
