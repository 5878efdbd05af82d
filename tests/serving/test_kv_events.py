"""KV cache events (serving/kv_events/, `--kv-events-config`).

The event stream is decoded by a subscriber written from vLLM's schema (tests/helpers/kv_event_view.py),
which rebuilds the stored blocks per medium from their tokens and parent links the way a router
does. After a randomized workload step by step (shared prefixes, evictions to the HiSparse host
tier, host-tier reuse, aborts; on the model-free scheduler harness) the hit the rebuilt view gives
every prompt equals `PrefixCache.lookup`'s, and the published media equal the cache's own per-unit
rule. The publisher's live and replay sockets, the config's errors, and the engine and CLI wiring
are checked on their own; the offload tier is checked in tests/serving/test_offload.py and a real
vllm-router in tests/serving/test_kv_events_router.py.
"""

from __future__ import annotations

import random
import time

import pytest
import zmq

from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.kv_events import (
    END_SEQ,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    KVEventsConfigError,
    ZmqEventPublisher,
    encode_batch,
    offset_endpoint_port,
)
from serving.kv_events.config import check_replica_ports, discovery_sources
from serving.request import Request
from serving.types import SamplingParams
from sharding.distributed import free_port_pair
from tests.helpers.kv_event_view import RouterView, decode
from tests.serving.hisparse_harness import HiSparseEngine
from tests.serving.test_scheduler import prompt


def _drain(tracker, view) -> None:
    events = tracker.take_events()
    if events:
        view.apply(decode(encode_batch(EventBatch(ts=time.time(), events=events))))


def _check(e, view, tracker, prompts) -> None:
    pc = e.prefix_cache
    assert view.media() == tracker.published()
    cov = pc.coverage
    for key, media in tracker.published().items():
        assert cov.tiers_of(key) == media
    for i, p in enumerate(prompts):
        want = pc.lookup(Request(f"probe{i}", list(p), SamplingParams())).num_tokens
        assert view.hit_tokens(p) == want, (i, len(p))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rebuilt_view_gives_the_engine_hit_on_every_tier(seed):
    rng = random.Random(seed)
    e = HiSparseEngine(num_blocks=rng.choice([40, 60]), host_blocks=rng.choice([40, 200]), max_num_seqs=4,
                       prefix_caching=True, max_num_batched_tokens=16)
    tracker = e.prefix_cache.track_events()
    assert tracker.block_size == 4
    view = RouterView()
    heads = [prompt(100 * seed + h, rng.randint(12, 40)) for h in range(3)]
    prompts, aborted, n = [], set(), 0
    for wave in range(4):
        for _ in range(rng.randint(2, 5)):
            p = rng.choice(heads) + prompt(1000 * seed + n, rng.randint(1, 30))
            prompts.append(p)
            e.add(f"r{n}", p, max_tokens=rng.randint(2, 12), ignore_eos=True)
            n += 1
        step = 0
        while e.sched.has_unfinished_requests():
            e.step()
            step += 1
            if rng.random() < 0.05:
                live = list(e.sched.running) + list(e.sched.waiting)
                victim = rng.choice(live).request_id
                e.sched.abort(victim)
                aborted.add(victim)
            _drain(tracker, view)
            if step % 5 == 0:
                _check(e, view, tracker, prompts + heads)
        e.flush()
        _drain(tracker, view)
        _check(e, view, tracker, prompts + heads + [p + [5] for p in prompts])
    e.check_against_reference(skip=aborted)
    media = set().union(*view.media().values()) if view.blocks else set()
    assert "GPU" in media
    assert e.prefix_cache.host_hits > 0 or "CPU" in media  # the host tier took part
    assert tracker.num_removed > 0  # evictions were reported


def test_host_tier_units_are_announced_on_the_cpu_medium():
    e = HiSparseEngine(num_blocks=60, max_num_seqs=3, prefix_caching=True)
    tracker = e.prefix_cache.track_events()
    view = RouterView()
    base = prompt(20, 80)
    e.add("a", base, max_tokens=3, ignore_eos=True)
    e.run()
    _drain(tracker, view)
    assert view.hit_tokens(base + [1], media=("GPU",)) == 80
    e.add("filler", prompt(21, 150), max_tokens=2, ignore_eos=True)
    e.run()
    _drain(tracker, view)
    # a's MLA pages went to the host pool; its indexer pages are still on the device for some units.
    gpu, cpu = view.hit_tokens(base + [1], media=("GPU",)), view.hit_tokens(base + [1], media=("CPU",))
    want = e.prefix_cache.lookup(Request("p", base + [1], SamplingParams())).num_tokens
    assert cpu > gpu and view.hit_tokens(base + [1]) == want > 0
    _check(e, view, tracker, [base, base + [1]])


def test_consecutive_units_of_a_prompt_go_out_as_one_event():
    e = HiSparseEngine(num_blocks=60, max_num_seqs=1, prefix_caching=True, max_num_batched_tokens=64)
    tracker = e.prefix_cache.track_events()
    e.add("a", prompt(7, 41), max_tokens=1, ignore_eos=True)
    e.step()
    events = tracker.take_events()
    assert [type(ev) for ev in events] == [BlockStored]
    ev = events[0]
    assert ev.parent_block_hash is None and len(ev.block_hashes) == 10 and ev.medium == "GPU"
    assert ev.token_ids == prompt(7, 41)[:40] and ev.block_size == 4
    assert tracker.take_events() == []


@pytest.mark.parametrize("seed", [0, 1])
def test_merged_replicas_publish_the_union_of_their_caches(seed):
    """`merge_data_parallel` (serving/kv_events/merge.py): two replicas (model-free scheduler
    harnesses with their own prefix caches and host tiers) share one tracker. After every flush
    the rebuilt view's media are, for every unit, the union of the two caches' own rule; a prompt
    is credited at least what the replica holding more of it would serve, and exactly that for a
    conversation kept on one replica (as the DP engine's placement keeps one); two of the four
    shared heads go to either replica."""
    from serving.kv_events.merge import merged_tracker

    rng = random.Random(seed)
    reps = [HiSparseEngine(num_blocks=rng.choice([40, 60]), host_blocks=rng.choice([40, 200]), max_num_seqs=4,
                           prefix_caching=True, max_num_batched_tokens=16) for _ in range(2)]
    for e in reps:
        e.prefix_cache.track_events()
    tracker = merged_tracker([e.prefix_cache.coverage for e in reps])
    view = RouterView()
    heads = [prompt(300 + 10 * seed + h, rng.randint(12, 40)) for h in range(4)]
    prompts, n = [], 0
    for _wave in range(3):
        for _ in range(rng.randint(3, 6)):
            h = rng.randrange(4)
            p = heads[h] + prompt(2000 * (seed + 1) + n, rng.randint(1, 30))
            prompts.append(p)
            r = h if h < 2 else rng.randrange(2)  # heads 0 and 1 stay on their replica; 2 and 3 go to either
            reps[r].add(f"r{n}", p, max_tokens=rng.randint(2, 8), ignore_eos=True)
            n += 1
        while any(e.sched.has_unfinished_requests() for e in reps):
            for e in reps:
                if e.sched.has_unfinished_requests():
                    e.step()
            _drain(tracker, view)
            assert view.media() == tracker.published()
            for key, media in tracker.published().items():
                assert media == reps[0].prefix_cache.coverage.tiers_of(key) | reps[1].prefix_cache.coverage.tiers_of(key)
        for e in reps:
            e.flush()
        _drain(tracker, view)
        for p in prompts + heads:
            best = max(e.prefix_cache.lookup(Request("probe", list(p), SamplingParams())).num_tokens for e in reps)
            got = view.hit_tokens(p)
            # exact for a conversation one replica holds; a chain spread over both may be credited more
            assert got == best if p[:len(heads[0])] == heads[0] or p[:len(heads[1])] == heads[1] else got >= best
    assert view.hit_tokens(heads[0] + [1]) > 0 and view.hit_tokens(heads[1] + [1]) > 0  # both replicas' units count


def test_a_merged_unit_keeps_its_tokens_while_any_replica_names_it():
    """A unit one replica dropped, while another still names it without covering it yet (a page
    in one of its groups only), is announced again with its tokens when that one covers it."""
    from serving.kv_events.merge import merged_tracker

    class Coverage:  # a replica's media and names for one unit, set by hand
        unit = 4

        def __init__(self):
            self.media, self.named = frozenset(), False

        def tiers_of(self, key):
            return self.media

        def knows(self, key):
            return self.named

    b, a = Coverage(), Coverage()
    shared = merged_tracker([b, a])
    key, tokens = b"k" * 8, [1, 2, 3, 4]
    b.media, b.named = frozenset({"GPU"}), True
    shared.note_unit(key, None, tokens)
    shared.touch(key)
    assert [type(e).__name__ for e in shared.take_events()] == ["BlockStored"]
    a.named = True  # replica a names it (a partly covering page)
    b.media, b.named = frozenset(), False
    shared.touch(key)
    assert [type(e).__name__ for e in shared.take_events()] == ["BlockRemoved"]
    a.media = frozenset({"GPU"})
    shared.touch(key)
    (stored,) = shared.take_events()
    assert stored.block_hashes == [key] and stored.token_ids == tokens


def test_a_merged_server_is_one_source_at_rank_0():
    from serving.kv_events import build_kv_events

    reps = [HiSparseEngine(num_blocks=40, max_num_seqs=2, prefix_caching=True) for _ in range(2)]
    port = _free_port()
    events = build_kv_events({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                              "merge_data_parallel": True}, [e.prefix_cache for e in reps])
    try:
        assert len(events.trackers) == 1 and len(events.publishers) == 1
        assert list(events.discovery_sources()) == ["0"]
        assert reps[0].prefix_cache.coverage.tracker is reps[1].prefix_cache.coverage.tracker is events.trackers[0]
    finally:
        events.close()
    with pytest.raises(KVEventsConfigError, match="merge_data_parallel must be true or false"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "merge_data_parallel": "yes"})


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_publisher_sends_live_batches_and_replays_from_a_sequence_number():
    port, rport = _free_port(), _free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",  # "*": bound, as in vLLM
                         replay_endpoint=f"tcp://127.0.0.1:{rport}", buffer_steps=4, topic="kv")
    pub = ZmqEventPublisher(cfg, data_parallel_rank=0)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the subscription reaches the PUB socket
    try:
        for i in range(6):
            ev = BlockStored(block_hashes=[bytes([i]) * 16], parent_block_hash=None, token_ids=[i] * 4, block_size=4,
                             lora_id=None, medium="GPU", lora_name=None)
            assert pub.publish(EventBatch(ts=float(i), events=[ev]))
        assert pub.flush()
        live = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while len(live) < 6 and poller.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), decode(payload)))
        assert [s for s, _ in live] == list(range(6))
        assert [b.ts for _, b in live] == [float(i) for i in range(6)]
        assert all(b.data_parallel_rank == 0 for _, b in live)
        assert pub.num_published == 6 and pub.num_dropped == 0

        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{rport}")
        req.send_multipart((b"", (3).to_bytes(8, "big")))
        got = []
        while req.poll(2000):
            frames = req.recv_multipart()
            assert frames[0] == b""
            if frames[1] == END_SEQ:
                break
            got.append((int.from_bytes(frames[1], "big"), decode(frames[2]).ts))
        assert got == [(3, 3.0), (4, 4.0), (5, 5.0)]
        req.send_multipart((b"", (0).to_bytes(8, "big")))  # only the last buffer_steps batches are kept
        first = req.recv_multipart()
        assert int.from_bytes(first[1], "big") == 2
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()


def test_a_router_that_subscribes_late_still_hears_the_start_up_clear():
    """A restarted server binds its endpoint long before a router's SUB socket reconnects, and a
    PUB socket drops what it sends before the subscription arrives: the start-up
    `AllBlocksCleared` repeats until the replica announces something, so a late subscriber
    still hears it (vllm-router then forgets the previous process's blocks before routing by
    them); once a block is announced, no clear follows it."""
    port = free_port_pair()  # replica 1 binds the port + 1
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", replay_endpoint=None, topic="kv")
    pub = ZmqEventPublisher(cfg, data_parallel_rank=1)
    pub.announce_cleared(every_s=0.2)
    time.sleep(0.5)  # the first clears go out to nobody
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint.replace("*", "127.0.0.1"))  # replica 1: the port + 1
    try:
        assert sub.poll(3000), "no clear reached the late subscriber"
        _, seq, payload = sub.recv_multipart()
        batch = decode(payload)
        assert [e["type"] for e in batch.events] == ["AllBlocksCleared"] and batch.data_parallel_rank == 1
        assert int.from_bytes(seq, "big") >= 1  # not the first one: that went out before the subscription
        ev = BlockStored(block_hashes=[b"x" * 16], parent_block_hash=None, token_ids=[1] * 4, block_size=4,
                         lora_id=None, medium="GPU", lora_name=None)
        assert pub.publish(EventBatch(ts=1.0, events=[ev])) and pub.flush()
        kinds = []
        while sub.poll(600):  # three clear periods
            kinds.append([e["type"] for e in decode(sub.recv_multipart()[2]).events])
        assert kinds and kinds[-1] == ["BlockStored"], kinds  # (clears queued before it may precede it)
    finally:
        sub.close(linger=0)
        pub.close()


def test_publisher_drops_and_counts_when_its_queue_is_full():
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-drop-test", max_queue_size=1)
    pub = ZmqEventPublisher(cfg)
    pub.close()
    assert not pub.publish(EventBatch(ts=0.0, events=[]))
    assert pub.num_dropped == 1


def test_config_keys_and_errors():
    assert KVEventsConfig.from_dict(None) is None
    assert KVEventsConfig.from_dict('{"enable_kv_cache_events": false}') is None
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5558"})
    assert (cfg.publisher, cfg.endpoint, cfg.buffer_steps, cfg.topic) == ("zmq", "tcp://*:5557", 10_000, "")
    for raw, match in [('{"enable_kv_cache_events": true, "endpoit": "tcp://*:1"}', "unknown key 'endpoit'"),
                       ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be"),
                       ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be a positive"),
                       ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be"),
                       ('{"enable_kv_cache_events": 1}', "true or false"), ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(KVEventsConfigError, match=match):
            KVEventsConfig.from_dict(raw)
    # Under DP 2, 5557 / 5558 would be replica 1's endpoint and replica 0's replay port.
    with pytest.raises(KVEventsConfigError, match="replay_endpoint port at least 2 away"):
        check_replica_ports(cfg, 2)
    check_replica_ports(cfg, 1)
    check_replica_ports(KVEventsConfig.from_dict({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5559"}), 2)
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"
    assert offset_endpoint_port(None, 3) is None


def test_discovery_lists_each_replicas_sockets_in_the_routers_shape():
    # vllm-router 0.1.17 subscribes to a discovered rank only when its entry says publisher "zmq",
    # enable_kv_cache_events true, encoding "msgpack" and schema_version 1 (probed against the
    # binary, docs/kv_events.md "Discovery"); replica r's ports are the configured ones + r.
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://*:6001",
                                    "replay_endpoint": "tcp://[::]:6011", "topic": "kv", "hwm": 7})
    got = discovery_sources(cfg, 2)
    assert list(got) == ["0", "1"]
    for rank, (pub, replay) in enumerate([("tcp://*:6001", "tcp://*:6011"), ("tcp://*:6002", "tcp://*:6012")]):
        assert got[str(rank)] == {"endpoint": pub, "replay_endpoint": replay, "topic": "kv", "hwm": 7,
                                  "buffer_steps": 10_000, "publisher": "zmq", "enable_kv_cache_events": True,
                                  "encoding": "msgpack", "schema_version": 1}
    one = discovery_sources(KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kv.ipc",
                                           replay_endpoint="inproc://replay"), 1)
    assert (one["0"]["endpoint"], one["0"]["replay_endpoint"]) == ("ipc:///tmp/kv.ipc", None)
    # the replay socket is always bound (a ROUTER), so 0.0.0.0 there is every interface
    one = discovery_sources(KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="tcp://0.0.0.0:5600"), 1)
    assert one["0"]["replay_endpoint"] == "tcp://*:5600"
    # Only what the server binds: an address it connects to (vLLM's rule: no '*' or '::' in it,
    # so 0.0.0.0 too) or an inproc one is nothing a router can subscribe to; nor a "null" publisher.
    for endpoint, publisher in [("tcp://0.0.0.0:5557", "zmq"), ("tcp://10.1.2.3:5557", "zmq"),
                                ("inproc://kv", "zmq"), ("tcp://*:5557", "null")]:
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, publisher=publisher)
        assert discovery_sources(cfg, 2) == {}, endpoint


@pytest.mark.parametrize("host", ["*", "[::]"])
def test_a_discovered_socket_is_one_a_subscriber_hears(host):
    # What discovery lists is bound: a subscriber connecting where a router would (`*` read as the
    # worker's host, here loopback) hears the start-up clear; `[::]` binds (IPv6 and IPv4) too.
    port = _free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://{host}:{port}", topic="kv")
    pub = ZmqEventPublisher(cfg)
    pub.announce_cleared(every_s=0.1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(discovery_sources(cfg, 1)["0"]["endpoint"].replace("*", "127.0.0.1"))
    try:
        assert sub.poll(3000), "nothing reached the subscriber"
        assert [e["type"] for e in decode(sub.recv_multipart()[2]).events] == ["AllBlocksCleared"]
    finally:
        sub.close(linger=0)
        pub.close()


def test_cli_checks_the_flag_at_start_up():
    flag = '{"enable_kv_cache_events": true}'
    with pytest.raises(ArgumentError, match="needs --enable-prefix-caching"):
        validate_args(make_arg_parser().parse_args(["--kv-events-config", flag]))
    with pytest.raises(ArgumentError, match="unknown key 'x'"):
        validate_args(make_arg_parser().parse_args(["--kv-events-config", '{"x": 1}', "--enable-prefix-caching"]))
    args = make_arg_parser().parse_args(["--kv-events-config", flag, "--enable-prefix-caching"])
    validate_args(args)
    assert args.kv_events_config == {"enable_kv_cache_events": True}


def test_a_taken_port_is_a_clear_start_up_error():
    from serving.kv_events import KVEvents, KVEventTracker

    port = _free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = KVEvents(cfg, [KVEventTracker(64, lambda k: frozenset(), lambda k: False)])
    try:
        with pytest.raises(ValueError, match=rf"replica 0 \(tcp://\*:{port}\)"):
            KVEvents(cfg, [KVEventTracker(64, lambda k: frozenset(), lambda k: False)])
    finally:
        first.close()
