"""Which prefix-cache units are available on which medium, and the events that tell a router.

The prefix cache (serving/prefix_cache.py) marks a unit hash dirty whenever an index that can
make it a hit changes: a device page published or evicted in any group, a Hybrid HiSparse host
block filed or reused, an offloaded page filed or dropped. `take_events` then compares, for every
dirty unit, the media the cache reports now (`tiers_of`) with the media last published, and turns
the difference into `BlockStored` / `BlockRemoved` events (stores first, consecutive units of one
chain merged into one event). So the published state is, after every flush, exactly what
`tiers_of` says for every unit — the rule a router's view is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from serving.kv_events.wire import BlockRemoved, BlockStored


class KVEventTracker:
    """Per prefix cache (per data-parallel replica).

    Args:
      block_size: tokens per unit (the prefix cache's hash unit; vllm-router's `--kv-event-block-size`).
      tiers_of: `key -> frozenset of media` ("GPU", "CPU") where the unit is available now.
      known: `key -> bool`, whether any index still names the unit (its tokens are kept until not).
    """

    def __init__(self, block_size: int, tiers_of: Callable[[bytes], frozenset], known: Callable[[bytes], bool]):
        self.block_size = block_size
        self._tiers_of = tiers_of
        self._known = known
        # unit -> (parent, its tokens as int32 bytes: 256 B per 64-token unit, kept while known)
        self._meta: dict[bytes, tuple[bytes | None, bytes]] = {}
        self._dirty: dict[bytes, None] = {}
        self._state: dict[bytes, frozenset] = {}
        self.num_stored = 0  # units stored, over all media (events count units, not messages)
        self.num_removed = 0

    def note_unit(self, key: bytes, parent: bytes | None, token_ids) -> None:
        """Remember a unit's parent hash (None for a prompt's first unit) and its tokens."""
        if key not in self._meta:
            self._meta[key] = (parent, np.asarray(token_ids, dtype=np.int32).tobytes())

    def touch(self, key: bytes) -> None:
        """An index naming `key` changed."""
        self._dirty[key] = None

    def take_events(self) -> list:
        """The events since the last call (see the module docstring); [] when nothing changed."""
        if not self._dirty:
            return []
        stored: list[tuple[str, bytes]] = []
        removed: dict[str, list[bytes]] = {}
        for key in self._dirty:
            now = self._tiers_of(key) if key in self._meta else frozenset()
            before = self._state.get(key, frozenset())
            for m in sorted(now - before):
                stored.append((m, key))
            for m in sorted(before - now):
                removed.setdefault(m, []).append(key)
            if now:
                self._state[key] = now
            else:
                self._state.pop(key, None)
                if not self._known(key):
                    self._meta.pop(key, None)
        self._dirty.clear()
        events: list = []
        for medium, key in stored:
            parent, raw = self._meta[key]
            tokens = np.frombuffer(raw, dtype=np.int32).tolist()
            last = events[-1] if events else None
            if (isinstance(last, BlockStored) and last.medium == medium and last.block_hashes[-1] == parent):
                last.block_hashes.append(key)
                last.token_ids.extend(tokens)
            else:
                events.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=list(tokens),
                                          block_size=self.block_size, lora_id=None, medium=medium, lora_name=None))
            self.num_stored += 1
        for medium, keys in removed.items():
            events.append(BlockRemoved(block_hashes=keys, medium=medium))
            self.num_removed += len(keys)
        return events

    def published(self) -> dict[bytes, frozenset]:
        """Media per unit as the events published so far tell it (a copy)."""
        return dict(self._state)

    def clear(self) -> None:
        """Forget the published state (after an `AllBlocksCleared`); every known unit is dirty again."""
        self._state.clear()
        self._dirty.update(dict.fromkeys(self._meta))

    @property
    def num_tracked(self) -> int:
        """Units whose tokens are kept."""
        return len(self._meta)
