"""How the scheduler gets device pages for its requests: the residency policy over the one pool.

The scheduler (`serving/scheduler.py`) decides *which* requests run and how many tokens each gets;
a `KVPolicy` decides how their KV is held. `DeviceResidentPolicy`, the baseline of docs/design.md §6, keeps
every page of a running request on the device: admission allocates pages for all of a request's
known tokens at once, a running request allocates as it grows, and when the pool runs out the
scheduler preempts (recompute). Hybrid HiSparse (`serving/hisparse/`) is another policy over the
same pool and tables: it releases clean pages whose copy lives in a host pool instead of
preempting, and leases hot-buffer pages.

The scheduler calls, per step: `begin_step` once; for each running request `cap_new_tokens` then
`allocate` (0 → the scheduler preempts the most recently started request and retries); for
each waiting request `admit` (0 → admission stops); `end_step` with the built step. After the
step ran, `after_update` once; `free` whenever a request leaves the running set (finished,
aborted or preempted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from serving.kv_cache import KVCacheManager

if TYPE_CHECKING:
    from serving.prefix_cache import PrefixHit
    from serving.request import Request
    from serving.scheduler_output import SchedulerOutput


class DeviceResidentPolicy:
    """Every page of a running request stays on the device (docs/design.md §6 baseline).

    Args:
      kv: the block tables over the shared pool.
    """

    name = "device_resident"
    # Waiting requests the scheduler may admit past a head that does not fit (continuations with a
    # prefix-cache hit of at least half their tokens; `serving/scheduler.py`); 0 = strict FCFS.
    admission_lookahead = 0

    def __init__(self, kv: KVCacheManager):
        self.kv = kv

    def token_capacity(self) -> int | None:
        """Most tokens one request's KV can reach under this policy, or None for "whatever the
        device pool holds" (the scheduler computes that)."""
        return None

    def capacity_note(self) -> str:
        """What bounds `token_capacity` and which setting would raise it, for the error a prompt
        that does not fit gets ("" when the device pool alone is the bound)."""
        return ""

    # ------------------------------------------------------------------ scheduling hooks
    def begin_step(self, running: list["Request"], waiting: Iterable["Request"] = ()) -> None:
        """Called once before a step is built, with the running and the waiting requests."""

    def cap_new_tokens(self, req: "Request", num_new: int) -> int:
        """The most of `num_new` tokens `req` may compute this step (≥ 1 when num_new ≥ 1)."""
        return num_new

    def allocate(self, req: "Request", num_new: int, scheduled: Iterable["Request"], lookahead: int = 0) -> int:
        """Pages for a running request's next `num_new` tokens (query rows) and `lookahead`
        positions past them. Returns the rows granted (≤ num_new, pages allocated for them plus
        `lookahead`; 0 when the pool cannot hold them, nothing changed). `scheduled`: the
        requests already in this step. `lookahead`: asynchronous scheduling under MTP — the
        step in flight may accept up to that many drafts, which moves this step's rows as many
        positions further on the device (`serving.spec_decode.feed`); the rows, not the
        lookahead, are what a policy sizes per-row resources (HiSparse's hot lease) by."""
        return num_new if self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new + lookahead) else 0

    def admit(self, req: "Request", hit: "PrefixHit | None", num_new: int, scheduled: Iterable["Request"]) -> int:
        """Pages for a waiting request about to compute `num_new` tokens from `hit.num_tokens`
        (0 without a hit). The baseline allocates all of its known tokens at once (docs/design.md §6.1:
        room for the request fully resident), so a long prompt prefilled in chunks never runs out
        half-way. Returns the tokens it may compute this step (0: not admitted, nothing changed)."""
        ok = self.kv.allocate_slots(req.request_id, req.num_tokens, hit and hit.blocks, hit and hit.copy_from,
                                    hit and hit.loads)
        return num_new if ok else 0

    def admit_remote(self, req: "Request", num_new: int, scheduled: Iterable["Request"]) -> tuple[int, dict]:
        """Pages for a waiting request whose KV was pulled from a prefill engine (P/D,
        `serving/pd/consumer.py`), about to compute its last `num_new` tokens. Returns (tokens it
        may compute this step, 0: not admitted; MLA page index → host block for pages that land
        in host memory instead of device pages: none here, every page lands on the device)."""
        return self.admit(req, None, num_new, scheduled), {}

    def end_step(self, out: "SchedulerOutput") -> None:
        """Called with the built step (before it runs)."""

    def after_update(self, out: "SchedulerOutput") -> None:
        """Called after the step's results were applied (requests finished in it already freed)."""

    def free(self, req: "Request", preempted: bool = False) -> None:
        """Release everything the request holds (it finished, was aborted or preempted)."""
        self.kv.free(req.request_id)

    # ------------------------------------------------------------------ checks
    def external_refs(self) -> dict[int, int]:
        """Device pages held outside request tables (block → references), e.g. hot leases."""
        return {}

    def audit(self) -> list[str]:
        """Invariant violations of the policy's own state (the tables are checked by
        `KVCacheManager.audit` with `external_refs`)."""
        return []
