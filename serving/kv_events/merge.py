"""One event stream for all data-parallel replicas of a server (`--kv-events-config`
`"merge_data_parallel": true`).

vLLM publishes each data-parallel rank on a socket of its own, and a router credits rank r's
units to rank r only when it pins requests to ranks (vllm-router's `--intra-node-data-parallel-size
N`, which sends `X-data-parallel-rank`); without it, the units of ranks 1… count for nothing
(docs/kv_events.md). This server places a request on the replica whose prefix cache holds the
longest prefix of it (serving/dp_engine.py), so the server as a whole can be described as one
cache: a unit is available on a medium when any replica has it there.

`merged_tracker` gives every replica's `UnitCoverage` one shared `KVEventTracker` whose media are
the union of the replicas' (`tiers_of`) and that keeps a unit's tokens while any replica names it
(`knows`): each replica marks what it changes, and one flush publishes the union's changes — a
unit is stored when the first replica gets it and removed when the last one loses it. So after
every flush the published media are, for every unit, the union of the replicas' own rule.

A router then sees a chain of units where each unit is on some replica: when a chain's units are
spread over replicas (one evicted the first units that another still holds) it credits more than
one replica can serve; within one replica the units of a chain go together, as a request's pages do.
"""

from __future__ import annotations

from serving.kv_events.coverage import UnitCoverage
from serving.kv_events.tracker import KVEventTracker


def merged_tracker(coverages: list[UnitCoverage]) -> KVEventTracker:
    """One tracker over the replicas' coverages (installed as each one's `tracker`). Call before
    any page is published (the engine's start-up): what a replica reported to its own tracker
    before is not carried over."""
    units = {c.unit for c in coverages}
    if len(units) != 1:
        raise ValueError(f"the replicas' prefix caches hash different units {sorted(units)}: one stream cannot "
                         "describe them")

    def tiers_of(key: bytes) -> frozenset:
        return frozenset().union(*(c.tiers_of(key) for c in coverages))

    def knows(key: bytes) -> bool:
        return any(c.knows(key) for c in coverages)

    shared = KVEventTracker(units.pop(), tiers_of, knows)
    for c in coverages:
        c.tracker = shared
    return shared
