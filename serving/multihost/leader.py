"""Process 0 of a multi-process engine: the step channel's sending end, attached to the engine.

    channel = open_leader_channel(config, on_lost)     # before the engine is built
    engine = build_engine(..., before_compile=lambda e: handshake(e, channel, config))
    attach_leader(engine, channel)                      # the followers said HELLO before compiling

`attach_leader` sets the runner's `step_sink`: each device program's host inputs — `("step",
StepInputs)`, or `("stores", (src, dst, wait))` for HiSparse's write-through copies — are encoded
(`serving.multihost.codec`) and sent before the program is dispatched. `on_lost(reason)` runs on the
channel's monitor thread when a follower is lost (the server turns it into a dead engine).
"""

from __future__ import annotations

import logging
import time

from serving.multihost import MultiHostConfig, codec, engine_fingerprint
from serving.multihost.channel import LeaderChannel

logger = logging.getLogger(__name__)


def open_leader_channel(config: MultiHostConfig, on_lost=None) -> LeaderChannel:
    """Bind the step channel at `config.address` (raises ValueError when the ports are taken)."""
    return LeaderChannel(config.address, config.num_processes - 1, config.peer_timeout_s, on_lost=on_lost)


class StepSender:
    """The runner's `step_sink`: encode and send; keeps per-step encode and send times (seconds)
    and payload sizes (bytes) for the benchmark (`scripts/bench_multihost.py`)."""

    def __init__(self, channel: LeaderChannel):
        self.channel = channel
        self.encode_s: list[float] = []
        self.payload_bytes: list[int] = []

    def __call__(self, op: str, inputs) -> None:
        t = time.perf_counter()
        payload = codec.encode((op, inputs))
        self.encode_s.append(time.perf_counter() - t)
        self.payload_bytes.append(len(payload))
        self.channel.send_step(payload)


def handshake(engine, channel: LeaderChannel, config: MultiHostConfig) -> None:
    """Before the first collective (`build_engine(..., before_compile=...)`): wait for every
    follower's HELLO with the same engine fingerprint, within `config.join_timeout_s`. Raises
    RuntimeError naming a missing, different or failed follower."""
    channel.wait_for_followers(engine_fingerprint(engine), config.join_timeout_s)


def attach_leader(engine, channel: LeaderChannel) -> StepSender:
    """After the handshake and the compile: send every device program of `engine` to the
    followers from now on."""
    sender = StepSender(channel)
    engine.runner.step_sink = sender
    return sender
