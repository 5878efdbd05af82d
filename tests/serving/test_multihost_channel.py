"""The multi-host step channel and codec in one process over loopback (no JAX processes):
step inputs survive encoding with dtypes, shapes and classes; the follower gets the steps in
order and rejects a skipped sequence number or a corrupted payload; silence, a FATAL notice, a
closed connection and a different engine are each detected; the CLI refuses what does not span
processes yet, naming the flag."""

from __future__ import annotations

import time

import numpy as np
import pytest

from glm53.batch import ForwardBatch
from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.multihost import codec
from serving.multihost.channel import (
    ChannelError,
    FollowerChannel,
    LeaderChannel,
    PeerLostError,
    StartRefused,
)
from serving.spec_decode.inputs import SpecBatch
from serving.step_inputs import WANT_LOGPROBS, StepInputs
from sharding.distributed import free_port_pair


def step_inputs(T=8, B=3, k=2) -> StepInputs:
    rng = np.random.default_rng(0)
    batch = ForwardBatch(rng.integers(0, 500, T).astype(np.int32), np.arange(T, dtype=np.int32),
                         np.full(T, B - 1, np.int32), {"mla": np.full(T, -1, np.int32), "indexer": np.arange(T, dtype=np.int32)},
                         {"mla": rng.integers(0, 9, (B, 4)).astype(np.int32), "indexer": np.zeros((B, 1), np.int32)},
                         np.zeros(B, np.int32))
    extra = (rng.random(B).astype(np.float32), np.ones(B, np.float32), rng.integers(-1, 50, B).astype(np.int32),
             rng.random(B).astype(np.float32), rng.integers(0, 2**32, B, dtype=np.uint32), np.zeros(B, np.int32),
             np.bool_(True), np.full(6, -1, np.int32), np.full(6, -1, np.int32))
    spec = SpecBatch(np.zeros(B, np.int32), np.zeros((B, k), np.int32), np.zeros(B, np.int32), np.ones(B, bool),
                     np.zeros(T, np.int32), np.int32(2))
    # the penalties' seven arrays (serving.penalties.step_penalties), the bool one included
    pen = (rng.integers(-1, 500, (B, 64)).astype(np.int32), rng.integers(0, 3, (B, 64)).astype(np.int32),
           rng.random((B, 64)) < 0.5, rng.random((B, 64)).astype(np.float32), np.zeros(B, np.float32),
           np.full(B, 0.5, np.float32), np.ones(B, np.float32))
    # the prompt-logprob rows (serving.prompt_logprobs.step_rows): rows, targets and the real rows' count
    plp = (rng.integers(0, T, T).astype(np.int32), rng.integers(0, 500, T).astype(np.int32), np.int32(5))
    return StepInputs(batch, extra, spec, penalties=pen, prompt_rows=plp)


def assert_same(a, b):
    if isinstance(a, np.ndarray | np.generic):
        b = np.asarray(b)
        assert np.asarray(a).dtype == b.dtype and np.asarray(a).shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for f in a.__dataclass_fields__:
            assert_same(getattr(a, f), getattr(b, f))
    else:
        assert a == b


def test_step_inputs_round_trip_with_dtypes_shapes_and_classes():
    x = step_inputs()
    y = codec.decode(codec.encode(x))
    assert_same(x, y)
    assert y.extra[WANT_LOGPROBS].shape == () and y.extra[WANT_LOGPROBS].dtype == np.bool_  # a scalar stays a scalar
    with pytest.raises(TypeError, match="cannot send a set"):
        codec.encode(StepInputs(x.batch, ({1, 2},)))


def test_offload_transfer_lists_of_every_replica_round_trip():
    """The connector's per-replica store and load lists travel as `(replica, a, b)` rows
    (`serving.runner_transfers`): through the codec a follower gets back each replica's own list,
    an empty replica included."""
    from serving.runner_transfers import _tagged, untag

    stores = [[(3, 1), (4, 2)], [], [(7, 5)]]
    loads = [[], [(9, 8)], [(2, 6), (1, 3)]]
    msg = codec.decode(codec.encode((_tagged(stores), _tagged(loads), np.bool_(False))))
    assert untag(msg[0], 3) == stores and untag(msg[1], 3) == loads
    assert untag(_tagged([[], []]), 2) == [[], []]


@pytest.fixture
def pair():
    port = free_port_pair()
    lost = []
    leader = LeaderChannel(f"127.0.0.1:{port}", 1, peer_timeout_s=1.5, heartbeat_s=0.2, on_lost=lost.append)
    follower = FollowerChannel(f"127.0.0.1:{port}", 1, peer_timeout_s=1.5, heartbeat_s=0.2)
    yield leader, follower, lost
    leader.stop()
    follower.close()


def handshake(leader, follower, fingerprint=None):
    follower.hello(fingerprint or {"num_blocks": 24})
    leader.wait_for_followers({"num_blocks": 24}, timeout_s=10)
    follower.await_start(5)  # the leader's START: every fingerprint agreed


def test_steps_arrive_in_order_and_stop_ends_the_follower(pair):
    leader, follower, lost = pair
    handshake(leader, follower)
    payloads = [codec.encode(step_inputs(T=t)) for t in (4, 8, 16)]
    for p in payloads:
        leader.send_step(p)
    for p in payloads:
        kind, body = follower.recv()
        assert kind == "step" and body == p
    time.sleep(0.5)  # idle: the leader's PINGs keep the follower's recv from timing out
    leader.stop()
    assert follower.recv() == ("stop", None)
    assert lost == []  # a follower that exits after STOP is not a lost one


def test_a_corrupt_payload_and_a_skipped_step_are_errors(pair, monkeypatch):
    leader, follower, _ = pair
    handshake(leader, follower)
    leader._corrupt_at = 2
    leader.send_step(b"first")
    leader.send_step(b"second")
    assert follower.recv() == ("step", b"first")
    with pytest.raises(ChannelError, match="CRC32"):
        follower.recv()
    leader.seq += 1  # a step that never left (the follower still expects the corrupted one, 2)
    leader.send_step(b"fourth")
    with pytest.raises(ChannelError, match="step message 4 arrived when 2 was expected"):
        follower.recv()


def test_a_silent_leader_is_lost_for_the_follower():
    port = free_port_pair()
    follower = FollowerChannel(f"127.0.0.1:{port}", 1, peer_timeout_s=0.5)
    try:
        with pytest.raises(PeerLostError, match="no message from the leader"):
            follower.recv()
    finally:
        follower.close()


def test_a_fatal_notice_a_closed_connection_and_silence_each_lose_the_follower():
    for how in ("fatal", "close", "silence"):
        port = free_port_pair()
        lost = []
        leader = LeaderChannel(f"127.0.0.1:{port}", 1, peer_timeout_s=1.0, heartbeat_s=0.2, on_lost=lost.append)
        follower = FollowerChannel(f"127.0.0.1:{port}", 1, heartbeat_s=0.2)
        handshake(leader, follower)
        t0 = time.monotonic()
        if how == "fatal":
            follower.fatal("ChannelError: step message 3 failed its CRC32 check")
        elif how == "close":
            follower.close()
        else:
            follower._closed.set()  # the heartbeat thread stops, the connection stays open (a frozen process)
        while not lost and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert len(lost) == 1, how
        assert {"fatal": "process 1 stopped: ChannelError", "close": "process 1: its connection closed",
                "silence": "process 1 sent no heartbeat"}[how] in lost[0]
        with pytest.raises(PeerLostError):
            leader.send_step(b"x")
        leader.stop()
        follower.close()


def test_a_follower_with_another_engine_is_refused_by_name(pair):
    leader, follower, _ = pair
    follower.hello({"num_blocks": 30})
    with pytest.raises(RuntimeError, match="num_blocks: leader 24, process 1 30") as err:
        leader.wait_for_followers({"num_blocks": 24}, timeout_s=10)
    # The leader's exit tells the refused follower why (it waits for that answer before it
    # compiles; without it, it outlived the leader until JAX's coordination client aborted it).
    leader.stop(abort_reason=f"the leader failed to start: {err.value}")
    with pytest.raises(StartRefused, match="num_blocks: leader 24, process 1 30"):
        follower.await_start(5)


def test_a_follower_failing_during_start_up_stops_the_handshake(pair):
    leader, follower, _ = pair
    follower.fatal("could not build its engine: ValueError: no room")
    with pytest.raises(RuntimeError, match="process 1 failed during start-up: could not build its engine"):
        leader.wait_for_followers({"num_blocks": 24}, timeout_s=10)


def test_a_missing_follower_times_out_naming_it():
    port = free_port_pair()
    leader = LeaderChannel(f"127.0.0.1:{port}", 2)
    try:
        with pytest.raises(RuntimeError, match=r"process\(es\) \[1, 2\] did not join"):
            leader.wait_for_followers({}, timeout_s=1)
    finally:
        leader.stop()


@pytest.mark.parametrize("argv, flag", [
    (["--headless"], "--headless runs a follower"),
    (["--num-processes", "2", "--coordinator-address", "h:1", "--headless"], "--headless is for --process-id > 0"),
    (["--num-processes", "2", "--coordinator-address", "h:1", "--peer-timeout", "0"], "--peer-timeout"),
])
def test_the_cli_refuses_bad_multi_process_flags(argv, flag):
    args = make_arg_parser().parse_args(argv)
    with pytest.raises(ArgumentError, match=flag):
        validate_args(args)


def test_the_channel_address_defaults_to_the_coordinator_port_plus_one():
    args = make_arg_parser().parse_args(["--num-processes", "2", "--process-id", "1", "--headless",
                                         "--coordinator-address", "10.0.0.1:1234"])
    validate_args(args)
    assert args.multihost.address == "10.0.0.1:1235" and not args.multihost.is_leader
    args = make_arg_parser().parse_args(["--num-processes", "2", "--coordinator-address", "10.0.0.1:1234",
                                         "--master-addr", "10.0.0.9", "--master-port", "4000"])
    validate_args(args)
    assert args.multihost.address == "10.0.0.9:4000" and args.multihost.is_leader


def test_a_leader_lands_pd_pages_in_step_messages_of_bounded_size():
    """P/D landing in a multi-process engine: the leader sends the pulled pages to the followers
    in the step channel, so its page writes are cut to pieces of at most
    `max_step_message_bytes` of pages (a power of two of at least 8 rows); one process keeps
    `max_pages_per_program`."""
    from types import SimpleNamespace

    from serving.arena_pages import ArenaPageIO

    def per_call(page_bytes, leader=True):
        io = ArenaPageIO()
        io.kv_arena = SimpleNamespace(shape=(1024, page_bytes // 4))
        io.step_sink = (lambda op, inputs: None) if leader else None
        return io._pages_per_call()

    glm_page = 3_320_000  # about a GLM-5.3 fp8 page of every group's rows
    assert per_call(glm_page) == 16 and 16 * glm_page <= ArenaPageIO.max_step_message_bytes < 32 * glm_page
    assert per_call(glm_page, leader=False) == ArenaPageIO.max_pages_per_program
    assert per_call(4096) == ArenaPageIO.max_pages_per_program  # small pages: the usual bound
    assert per_call(100 << 20) == 8  # never fewer than the smallest page program


def test_per_process_page_reads_and_sharded_landings_equal_the_replicated_programs():
    """The direct P/D path's page I/O on a (dp 2, dcp 2, tp 2) mesh of 8 simulated devices:
    `read_local_pages` (each row block gathered on a device that holds it) returns what the
    collective `read_pages` returns, and `write_owned_pages` (page data sharded like the arena's
    row blocks, scattered inside each shard) leaves the arena `write_pages` leaves, every TP copy
    included; `replica_owner` names this process for every replica."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from serving.arena_pages import ArenaPageIO

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "dcp", "tp"))
    B, W = 16, 24
    rng = np.random.default_rng(0)
    start = rng.integers(0, 2**32, (4 * B, W), dtype=np.uint32)
    sharding = NamedSharding(mesh, PartitionSpec(("dp", "dcp"), None))

    def io():
        x = ArenaPageIO()
        x.kv_arena, x.num_blocks, x.step_sink = jax.device_put(start, sharding), B, None
        x._put = np.asarray
        return x

    a, b = io(), io()
    assert a.replica_owner(0, 2) == a.replica_owner(1, 2) == jax.process_index()
    rows = np.asarray([3, 17, 18, 40, 63, 1, 33], np.int32)
    np.testing.assert_array_equal(a.read_local_pages(rows), a.read_pages(rows))
    np.testing.assert_array_equal(a.read_local_pages(rows), start[rows])

    writes = {0: [2, 5], 1: [0, 9, 15], 3: [7]}  # row block → block-local rows (block 2 gets none)
    data = {s: rng.integers(0, 2**32, (len(r), W), dtype=np.uint32) for s, r in writes.items()}
    a.write_owned_pages({s: (np.asarray(r, np.int32), data[s]) for s, r in writes.items()}, count=3)
    g_rows = np.concatenate([s * B + np.asarray(r) for s, r in writes.items()]).astype(np.int32)
    b.write_pages(g_rows, np.concatenate([data[s] for s in writes]))
    want = start.copy()
    want[g_rows] = np.concatenate([data[s] for s in writes])
    for x in (a, b):
        for shard in x.kv_arena.addressable_shards:  # every device's copy, TP replicas included
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
