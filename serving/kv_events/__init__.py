"""KV cache events for prefix-aware routers (`--kv-events-config`, vLLM's format; docs/kv_events.md).

Each data-parallel replica's prefix cache reports which prefix units are available on the device
("GPU") and in host memory ("CPU": the Hybrid HiSparse host pool, the offloading connector's
store); after every engine step the changes go out as one `EventBatch` per replica on a ZMQ PUB
socket, with a replay socket for missed batches. vllm-router's `kv_aware` policy consumes them
(it finds the sockets and the block size itself through `GET /kv_event_sources` and
`GET /get_server_info`, `serving/api/discovery.py`; or give it `--kv-event-source
URL=tcp://HOST:PORT[,PORT+1…]`, `--kv-event-block-size` = the block size logged at start-up).
"""

from __future__ import annotations

import logging
import time

import zmq

from serving.kv_events.config import (
    KVEventsConfig,
    KVEventsConfigError,
    binds,
    check_replica_ports,
    discovery_sources,
    offset_endpoint_port,
)
from serving.kv_events.publisher import END_SEQ, ZmqEventPublisher
from serving.kv_events.tracker import KVEventTracker
from serving.kv_events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

logger = logging.getLogger(__name__)

__all__ = [
    "END_SEQ", "MEDIUM_CPU", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch",
    "KVEventBatch", "KVEventTracker", "KVEvents", "KVEventsConfig", "KVEventsConfigError", "ZmqEventPublisher",
    "build_kv_events", "decode_batch", "encode_batch", "offset_endpoint_port",
]


class KVEvents:
    """The engine's event side: one (tracker, publisher) per data-parallel replica, or one in all
    with `merge_data_parallel` (`serving/kv_events/merge.py`).

    `publish_step()` after every engine step sends each replica's changes (nothing when none);
    `close()` sends what is queued and closes the sockets. With `publisher: "null"` the trackers
    run and nothing is sent (`publishers` is empty)."""

    def __init__(self, config: KVEventsConfig, trackers: list[KVEventTracker]):
        self.config = config
        self.trackers = trackers
        self.publishers: list[ZmqEventPublisher] = []
        if config.publisher == "zmq":
            check_replica_ports(config, len(trackers))
        try:
            if config.publisher == "zmq":
                for rank in range(len(trackers)):
                    self.publishers.append(ZmqEventPublisher(config, rank))
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--kv-events-config: cannot open the event sockets of replica {len(self.publishers)} "
                             f"({offset_endpoint_port(config.endpoint, len(self.publishers))}): {e}") from e
        self.block_size = trackers[0].block_size
        # A router that saw an earlier process on these endpoints forgets what it announced (the
        # clear repeats until the replica announces something: a reconnecting router hears it).
        for pub in self.publishers:
            pub.announce_cleared()
        if config.publisher == "zmq" and not binds(config.endpoint):
            logger.warning("KV events: %s is connected to, not bound (vLLM's rule: only an address with '*' or '::' "
                           "is bound; use tcp://*:PORT to listen on every interface), so something must listen "
                           "there, and a router cannot discover it at GET /kv_event_sources", config.endpoint)
        logger.info("KV events: block size %d tokens (vllm-router --policy kv_aware reads it and the event sockets "
                    "from GET /get_server_info and /kv_event_sources; set by hand: --kv-event-block-size %d)",
                    self.block_size, self.block_size)

    def discovery_sources(self) -> dict[str, dict]:
        """`GET /kv_event_sources`' body: each replica's endpoints, keyed by rank (`discovery_sources`)."""
        return discovery_sources(self.config, len(self.trackers))

    def publish_step(self) -> None:
        for rank, tracker in enumerate(self.trackers):
            events = tracker.take_events()
            if events and self.publishers:
                self.publishers[rank].publish(EventBatch(ts=time.time(), events=events))

    @property
    def num_published(self) -> int:
        """Batches sent, over replicas."""
        return sum(p.num_published for p in self.publishers)

    @property
    def num_dropped(self) -> int:
        """Batches dropped (queue full or publisher closed), over replicas."""
        return sum(p.num_dropped for p in self.publishers)

    @property
    def num_blocks_stored(self) -> int:
        return sum(t.num_stored for t in self.trackers)

    @property
    def num_blocks_removed(self) -> int:
        return sum(t.num_removed for t in self.trackers)

    def close(self) -> None:
        for pub in self.publishers:
            pub.close()


def build_kv_events(raw_config, prefix_caches) -> KVEvents | None:
    """`--kv-events-config` (dict, JSON string or None) over the replicas' prefix caches (index =
    data-parallel rank). None when events are off. Raises KVEventsConfigError for a bad config,
    ValueError when a replica has no prefix cache (the flag needs --enable-prefix-caching) or when
    an endpoint cannot be bound (the port is taken; the message names the endpoint)."""
    config = KVEventsConfig.from_dict(raw_config)
    if config is None:
        return None
    if any(c is None for c in prefix_caches):
        raise ValueError("--kv-events-config needs --enable-prefix-caching (events report the prefix cache)")
    trackers = [c.track_events() for c in prefix_caches]
    if config.merge_data_parallel and len(trackers) > 1:
        from serving.kv_events.merge import merged_tracker

        trackers = [merged_tracker([c.coverage for c in prefix_caches])]
        logger.info("KV events: the %d data-parallel replicas publish one stream (merge_data_parallel): the union "
                    "of their prefix caches, as rank 0", len(prefix_caches))
    return KVEvents(config, trackers)
