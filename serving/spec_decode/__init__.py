"""MTP speculative decoding (docs/design.md §3.6, §6): the checkpoint's MTP layer drafts k tokens per
request inside the jitted step, the next step verifies them as k + 1 decode rows, and rejected
drafts' KV is rolled back by not counting it (their slots are written again).

    python -m serving.run --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'

* `config.py`    — `--speculative-config` keys and checks.
* `adaptive.py`  — drafts per step: static k, `disable_by_batch_size`, adaptive drafting.
* `rejection.py` — on-device verification: greedy prefix match, and the rejection rule that
                   keeps the target distribution for temperature > 0.
* `inputs.py`    — the per-step `SpecBatch` the runner passes to its step.
* `feed.py`      — asynchronous scheduling: the next step's rows taken from the step in flight
                   and moved by its accepted count on the device (docs/async_scheduling.md).
* `stats.py`     — acceptance counters (vLLM's `vllm:spec_decode_*` metrics).

The drafting maths is the model's (`glm53/mtp.py`); the scheduler schedules the drafts
(`ScheduledRequest.num_spec_tokens`) and keeps the accepted tokens (`update_from_output`).
"""

from serving.spec_decode.adaptive import DraftController
from serving.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, SpeculativeConfigError
from serving.spec_decode.stats import SpecDecodingStats

__all__ = ["DraftController", "MAX_SPECULATIVE_TOKENS", "SpecDecodingStats", "SpeculativeConfig",
           "SpeculativeConfigError"]
