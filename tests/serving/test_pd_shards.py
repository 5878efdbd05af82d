"""The leader's side of the per-process P/D path (serving/pd/shards.py) without engines: a
follower's pull report (success, error, silence) as the leader's pull thread sees it, rows of a
pull the leader gave up on not kept, and landing plans crossing the step channel's codec."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serving.multihost import codec
from serving.pd.shards import LandingPlan, ProcessKV, ShardRouter


class _Endpoint:
    """`TransferEndpoint.pull_rows` whose bytes arrive when `gate` is set."""

    def __init__(self, gate=None):
        self.gate, self.address = gate, "127.0.0.1:1"

    def pull_rows(self, address, uuid, shapes):
        if self.gate is not None:
            self.gate.wait(5)
        return [np.full(s, uuid, np.uint32) for s in shapes]


def _router(sent, endpoint=None):
    local = ProcessKV(None, None, 1, 1, 8, endpoint or _Endpoint())
    return ShardRouter(local, {0: 0, 1: 1}, {1: "10.0.0.2:7"}, lambda op, msg: sent.append((op, msg)))


def _msg(key="r#1", chunk=0):
    return {"key": key, "chunk": chunk, "address": "a", "uuid": 3, "shapes": [[2, 4]], "groups": ["mla"],
            "request_id": "r"}


def test_a_followers_report_ends_the_leaders_wait_with_its_outcome():
    sent = []
    router = _router(sent)
    assert router.address(1) == "10.0.0.2:7" and router.address(0) == "127.0.0.1:1"

    def report(error):
        threading.Timer(0.05, router.on_event, [{"op": "pd_pulled", "key": "r#1", "chunk": 0, "error": error}]).start()

    report(None)
    router.pull(1, _msg(), timeout_s=5)  # returns once process 1 reported the rows
    assert sent[-1][0] == "pd_pull" and sent[-1][1]["process"] == 1 and sent[-1][1]["uuid"] == 3
    report("ValueError: bytes differ")
    with pytest.raises(RuntimeError, match="process 1's pull failed: ValueError: bytes differ"):
        router.pull(1, _msg(), timeout_s=5)
    with pytest.raises(TimeoutError, match="process 1 did not pull chunk 0"):
        router.pull(1, _msg(), timeout_s=0.2)
    router.on_event({"op": "pd_pulled", "key": "r#1", "chunk": 0, "error": None})  # too late: ignored


def test_the_leaders_own_pulls_keep_rows_until_dropped_and_a_dropped_pull_keeps_nothing():
    sent = []
    gate = threading.Event()
    router = _router(sent, _Endpoint(gate))
    gate.set()
    router.pull(0, _msg("a#1", 0), timeout_s=5)
    router.pull(0, {**_msg("a#1", 1), "uuid": 4}, timeout_s=5)
    rows = router.local.rows("a#1")["mla"]  # both chunks, in chunk order
    np.testing.assert_array_equal(rows, np.concatenate([np.full((2, 4), 3), np.full((2, 4), 4)]))
    router.drop([("a#1", 0), ("b#2", 1)])
    assert router.local.pulled == {} and sent == [("pd_drop", {"keys": [["b#2", 1]]})]

    gate.clear()  # a pull still waiting for its bytes when the leader gives up on it
    slot = threading.Thread(target=lambda: router.pull(0, _msg("c#3", 0), timeout_s=5))
    slot.start()
    router.drop([("c#3", 0)])
    gate.set()
    slot.join(5)
    assert router.local.pulled == {}
    router.drop([("d#4", 0)])  # a failed request's key, never pulled here: nothing is remembered
    assert router.local._dropped == set() and router.local._pulling == set()


def test_landing_plans_cross_the_step_channel_unchanged():
    plans = [LandingPlan("r#1", 1, "mla", 2, 3, 128, 300, [(0, 17), (2, 5)]),
             LandingPlan("q#2", 0, "indexer", 0, 1, 0, 40, [])]
    body = codec.decode(codec.encode(("pd_land", {"plans": [p.encode() for p in plans], "owners": {"0": 0, "1": 1}})))
    assert body[0] == "pd_land"
    assert [LandingPlan.decode(d) for d in body[1]["plans"]] == plans
