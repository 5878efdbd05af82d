"""`CopyQueue`: device → host copies queued after a step and taken in flight for the next one.

Shared by the two host tiers (HiSparse's host pool, `serving/hisparse/host_pool.py`, and the
offloading connector's store, `serving/offload/store.py`): copies are queued once the pages they
read are final, taken (`take`) while the next step is built — they run in their own program before
it — and finished (`finish`) once that step ran, when the owner files or releases them. At most one
batch is in flight at a time.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

Job = TypeVar("Job")


class CopyQueue(Generic[Job]):
    """`queue` (waiting copies, FIFO) and `in_flight` (the batch taken for the current step)."""

    def __init__(self) -> None:
        self.queue: deque[Job] = deque()
        self.in_flight: list[Job] = []

    def take(self, max_jobs: int) -> list[Job]:
        """Move up to `max_jobs` queued copies in flight. Raises RuntimeError when the previous
        batch was not finished."""
        if self.in_flight:
            raise RuntimeError("the previous step's copies were not completed")
        n = min(max_jobs, len(self.queue))
        self.in_flight = [self.queue.popleft() for _ in range(n)]
        return list(self.in_flight)

    def finish(self) -> list[Job]:
        """The in-flight copies ran (their step finished): returns them and empties `in_flight`."""
        done, self.in_flight = self.in_flight, []
        return done
