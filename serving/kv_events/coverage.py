"""Which media hold each prefix-cache unit, kept beside the prefix cache for KV events.

A unit (a `unit`-token slice of a prompt, named by its chained hash) can be a prefix hit from:

* the device ("GPU") when, in every KV cache group, a published page covers it. A page covers its
  slot's units from the slot start up to the furthest unit it is published under (a lookup finds
  the page by that key and uses all rows before it, even units whose keys another page holds);
* host memory ("CPU") when, in every group, a device page covers it or a host copy does — the
  Hybrid HiSparse host tier's block of the host group (one unit per block), or a page of the
  offloading connector's store (a filed page covers all of its units) — and at least one group
  has it in host memory.

This is the rule `PrefixCache.lookup` applies unit by unit, so a router that rebuilds these sets
from the events computes the same hit as the engine (tests/serving/test_kv_events.py checks it).
"""

from __future__ import annotations

from serving.kv_events.tracker import KVEventTracker


def _inc(d: dict, k) -> None:
    d[k] = d.get(k, 0) + 1


def _dec(d: dict, k) -> None:
    n = d[k] - 1
    if n:
        d[k] = n
    else:
        del d[k]


class UnitCoverage:
    """Counts per (group, unit key) of what covers the unit; owns the event tracker.

    Args:
      unit: tokens per unit. groups: every KV cache group's name. host_group: the group the
      HiSparse host tier holds, or None. offload_groups: the groups the offloading connector
      manages (empty without it).
    """

    def __init__(self, unit: int, groups, host_group: str | None = None, offload_groups=()):
        self.unit = unit
        self.groups = tuple(groups)
        self.host_group = host_group
        self.offload_groups = frozenset(offload_groups)
        self.tracker = KVEventTracker(unit, self.tiers_of, self.knows)
        self._device: dict[tuple[str, bytes], int] = {}  # (group, key) -> published pages covering it
        self._pages: dict[int, tuple[str, list[bytes]]] = {}  # device page -> (group, keys it covers)
        self._host: set[bytes] = set()  # units filed in the HiSparse host tier
        self._offload: dict[tuple[str, bytes], int] = {}  # (group, key) -> filed offloaded pages covering it
        self._offload_pages: dict[tuple[str, bytes], list[bytes]] = {}  # queued or filed: (group, last key) -> units
        self._offload_refs: dict[bytes, int] = {}  # unit -> recorded offloaded pages naming it

    # ------------------------------------------------------------------ device pages
    def extend(self, group: str, block: int, hashes: list[bytes], first: int, last: int, token_ids) -> None:
        """Device page `block` of `group` (its slot starts at unit `first`) is now published up to
        unit `last`: it covers units `first..last` of the request whose unit hashes are `hashes`
        and tokens `token_ids`."""
        _, covered = self._pages.setdefault(block, (group, []))
        for u in range(first + len(covered), last + 1):
            key = hashes[u]
            covered.append(key)
            _inc(self._device, (group, key))
            self.tracker.note_unit(key, hashes[u - 1] if u else None,
                                   token_ids[u * self.unit : (u + 1) * self.unit])
            self.tracker.touch(key)

    def drop(self, block: int) -> None:
        """Device page `block` is no longer published."""
        entry = self._pages.pop(block, None)
        if entry is None:
            return
        group, covered = entry
        for key in covered:
            _dec(self._device, (group, key))
            self.tracker.touch(key)

    # ------------------------------------------------------------------ HiSparse host tier
    def host_filed(self, key: bytes) -> None:
        self._host.add(key)
        self.tracker.touch(key)

    def host_dropped(self, key: bytes) -> None:
        self._host.discard(key)
        self.tracker.touch(key)

    # ------------------------------------------------------------------ offloading connector
    def offload_queued(self, group: str, last_key: bytes, units: list[bytes]) -> None:
        """A store of the page whose units are `units` (keyed by the last one) was queued."""
        self._offload_pages[(group, last_key)] = list(units)
        for u in units:
            _inc(self._offload_refs, u)

    def on_offload_filed(self, group: str, key: bytes) -> None:
        """`OffloadStore` listener: the page of `(group, key)` is filed."""
        for u in self._offload_pages.get((group, key), ()):
            _inc(self._offload, (group, u))
            self.tracker.touch(u)

    def on_offload_dropped(self, group: str, key: bytes) -> None:
        """`OffloadStore` listener: the host block filed under `(group, key)` was handed out."""
        for u in self._offload_pages.pop((group, key), ()):
            _dec(self._offload, (group, u))
            _dec(self._offload_refs, u)
            self.tracker.touch(u)

    # ------------------------------------------------------------------ queries
    def tiers_of(self, key: bytes) -> frozenset:
        """The media a lookup could take unit `key` from now (module docstring)."""
        dev = [(g, key) in self._device for g in self.groups]
        host = [(g == self.host_group and key in self._host) or (g, key) in self._offload for g in self.groups]
        media = set()
        if all(dev):
            media.add("GPU")
        if any(host) and all(d or h for d, h in zip(dev, host)):
            media.add("CPU")
        return frozenset(media)

    def knows(self, key: bytes) -> bool:
        """True while anything still names the unit (its tokens are kept until not)."""
        return (any((g, key) in self._device for g in self.groups) or key in self._host
                or key in self._offload_refs)
