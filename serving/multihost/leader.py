"""Process 0 of a multi-process engine: the step channel's sending end, attached to the engine.

    channel = open_leader_channel(config, on_lost)     # before the engine is built
    engine = build_engine(..., before_compile=lambda e: handshake(e, channel, config))
    attach_leader(engine, channel)                      # the followers said HELLO before compiling

`attach_leader` sets the runner's `step_sink`: each device program's host inputs — `("step",
StepInputs)`, `("stores", (src, dst, wait))` for HiSparse's write-through copies, `("offload",
(stores, loads, wait))` for the offloading connector's transfers (`(replica, a, b)` rows), `("read_pages", rows)` and
`("write_pages", (rows, data))` for P/D's staging and landing (`serving/arena_pages.py`), and
`("profile", (action, dir, perfetto))` for a trace's start and stop (`serving/profiling.py`) — are encoded
(`serving.multihost.codec`) and sent before the program is dispatched. `on_lost(reason)` runs on the
channel's monitor thread when a follower is lost (the server turns it into a dead engine).
"""

from __future__ import annotations

import logging

from serving.multihost import MultiHostConfig, codec, engine_fingerprint
from serving.multihost.channel import LeaderChannel

logger = logging.getLogger(__name__)


def open_leader_channel(config: MultiHostConfig, on_lost=None) -> LeaderChannel:
    """Bind the step channel at `config.address` (raises ValueError when the ports are taken)."""
    return LeaderChannel(config.address, config.num_processes - 1, config.peer_timeout_s, on_lost=on_lost)


def handshake(engine, channel: LeaderChannel, config: MultiHostConfig) -> None:
    """Before the first collective (`build_engine(..., before_compile=...)`): wait for every
    follower's HELLO with the same engine fingerprint, within `config.join_timeout_s`. Raises
    RuntimeError naming a missing, different or failed follower."""
    channel.wait_for_followers(engine_fingerprint(engine), config.join_timeout_s)


def attach_leader(engine, channel: LeaderChannel) -> None:
    """After the handshake and the compile: send every device program of `engine` (its runner's
    `step_sink(op, inputs)`) to the followers from now on."""
    engine.runner.step_sink = lambda op, inputs: channel.send_step(codec.encode((op, inputs)))
    local = getattr(engine, "pd_process", None)
    pd = getattr(engine, "pd", None)
    router = None
    if local is not None and pd is not None:
        router = (pd.producer or pd.consumer).shards
    if router is not None:  # P/D on the processes holding the pages: where the followers' servers are
        for pid, info in channel.peer_info.items():
            if "transfer_address" not in info:
                raise RuntimeError(f"process {pid} has no P/D transfer server (was it started with the same "
                                   "--kv-transfer-config?)")
            router.addresses[pid] = info["transfer_address"]
        channel.on_event = router.on_event
        logger.info("P/D: each process stages and pulls its own replicas' KV (transfer servers: %s)",
                    ", ".join(f"process {p} {router.address(p)}" for p in sorted({0, *router.addresses})))
