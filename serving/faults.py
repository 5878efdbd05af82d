"""Engine step faults: what the engine does when a step raises, and the test hook that makes one.

A step can fail in two ways (docs/design.md §7, vLLM's `EngineDeadError` semantics):

* **recoverable**: the exception left the device state (KV arena, HiSparse hot state and host
  pool) intact — e.g. a bug while building the batch on the host. The requests of that step
  finish with finish reason "error" (the server answers 500, or ends the stream with an error
  event), their pages are freed, and the engine keeps serving the others.
* **fatal**: the device state is gone — a step that donated the arena failed on the device. The
  engine raises `EngineDeadError`; the server's `/health` answers 503 and the process exits
  non-zero so that a supervisor restarts it.

`FaultInjection` is the test hook (`ModelRunner.faults`): armed from a test, or for a server
process from `$GLM53_FAULT_INJECTION` (`"<kind>@<n>"`, kind `step_error`, `device_lost` or `stall`, n
the 1-based index of the step that fails, counting `ModelRunner.execute` calls from start-up;
compilation runs none). It is never armed otherwise. `stall` fails nothing: the engine thread
sleeps `STALL_SECONDS` before that step, as it waits on a step program compiled on first use (for
the shutdown tests: a server must exit without waiting for such a step, `serving/run.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_ENV = "GLM53_FAULT_INJECTION"
KINDS = ("step_error", "device_lost", "stall")
STALL_SECONDS = 120.0


class EngineDeadError(RuntimeError):
    """The engine cannot continue: its device state was lost. The server reports 503 and exits."""


class InjectedFault(RuntimeError):
    """The exception `FaultInjection` raises inside a step."""


@dataclass
class FaultInjection:
    """Make the `at_step`-th call of `ModelRunner.execute` (1-based, counted from arming) fail.

    kind: "step_error" raises before the step is dispatched (device state intact: recoverable);
        "device_lost" deletes the step's donated buffers first, as a step that failed on the
        device after donation leaves them, then raises (fatal). "stall" sleeps `STALL_SECONDS`
        and then runs the step.
    count: how many consecutive steps fail from `at_step` on.

    Raises ValueError for an unknown kind or at_step < 1.
    """

    kind: str
    at_step: int = 1
    count: int = 1
    calls: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.at_step < 1 or self.count < 1:
            raise ValueError("at_step and count must be >= 1")

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        """`$GLM53_FAULT_INJECTION` = "<kind>@<n>" (or "<kind>"), or None when unset/empty."""
        spec = os.environ.get(FAULT_ENV, "").strip()
        if not spec:
            return None
        kind, _, n = spec.partition("@")
        return cls(kind, int(n) if n else 1)

    def fire(self) -> str | None:
        """Count one step; the kind when this step must fail, else None."""
        self.calls += 1
        if self.at_step <= self.calls < self.at_step + self.count:
            return self.kind
        return None
