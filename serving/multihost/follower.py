"""A follower process (`--headless`, `--process-id` > 0) of a multi-process engine.

It builds the same engine as the leader (parameters, KV arena and compiled steps over the global
mesh; its scheduler stays idle), says HELLO before compiling, then runs every step the leader sends, in order,
until STOP (exit status 0) or ABORT / a lost leader / a bad message / a failed step (non-zero,
after one log line naming the cause and a FATAL notice to the leader).
"""

from __future__ import annotations

import logging

import jax

from serving import profiling
from serving.multihost import MultiHostConfig, codec, engine_fingerprint
from serving.multihost.channel import FollowerChannel
from serving.runner_transfers import untag

logger = logging.getLogger(__name__)


def hello(engine, channel: FollowerChannel, join_timeout_s: float) -> None:
    """Before the first collective (`build_engine(..., before_compile=...)`): tell the leader this
    engine's fingerprint, so that a different configuration stops start-up by name, and where
    its P/D transfer server listens when it stages and pulls its own pages (serving/pd/shards.py);
    then wait up to `join_timeout_s` for the leader to accept every process (`StartRefused`: it
    refused, with its reason)."""
    info = {}
    local = getattr(engine, "pd_process", None)
    if local is not None:
        from serving.pd.shards import advertised_host

        local.endpoint.host = advertised_host(local.endpoint.host, channel.leader_host)
        info["transfer_address"] = local.endpoint.address  # (starts the server)
        local.notify = channel.event
    channel.hello(engine_fingerprint(engine), info)
    channel.await_start(join_timeout_s)  # raises StartRefused with the leader's reason


def run_follower(engine, channel: FollowerChannel, config: MultiHostConfig) -> int:
    """Serve the leader's steps on `engine.runner` (built and compiled after `hello`) → the
    process's exit status."""
    pid = config.process_id
    logger.info("process %d: engine ready, running the leader's steps (headless)", pid)
    runner = engine.runner
    timeout = config.join_timeout_s  # the leader may still be compiling when this one is ready
    steps = 0
    # The outputs of the step dispatched last, waited for only after the next one is dispatched:
    # with the leader scheduling asynchronously (step n+1 sent while step n runs), the devices
    # never idle while this process reads and places the next step's inputs. A step that failed
    # is found one step later, or at STOP.
    pending = None
    try:
        while True:
            kind, body = channel.recv(timeout)
            timeout = None
            if kind == "stop":
                jax.block_until_ready(pending)
                logger.info("process %d: the leader stopped the engine after %d steps; exiting", pid, steps)
                return 0
            if kind == "abort":
                logger.error("process %d: the leader stopped the engine on an error (%s); exiting with status 1",
                             pid, body)
                return 1
            op, inputs = codec.decode(body)
            if op == "step":
                with jax.profiler.StepTraceAnnotation("engine_step", step_num=steps + 1):
                    out, _, _ = runner.run_inputs(inputs)
                jax.block_until_ready(pending)
                pending = out
                steps += 1
            elif op == "stores":
                src, dst, wait = inputs
                runner.run_store_lists(src, dst, bool(wait))
            elif op == "offload":
                stores, loads, wait = inputs  # (replica, a, b) rows
                nrep = runner.offload.transfer.num_replicas
                runner.run_offload_lists(untag(stores, nrep), untag(loads, nrep), bool(wait))
            elif op == profiling.PROFILE_OP:  # the leader started or stopped a trace (serving/profiling.py)
                profiling.follow(*inputs, pid, config.num_processes)
            elif op == "read_pages":  # P/D staging on the leader: the gather spans every process
                runner.read_pages(inputs)
            elif op == "write_pages":  # P/D landing: the rows the leader pulled, on every process
                runner.write_pages(*inputs)
            elif op.startswith("pd_") and engine.pd_process is not None:  # P/D on this process's own shards
                engine.pd_process.handle(op, inputs, pid)
            else:
                raise ValueError(f"unknown operation {op!r} from the leader")
    except Exception as e:  # noqa: BLE001 - any failure stops this process and the engine
        reason = f"{type(e).__name__}: {e}"
        logger.error("process %d: %s; exiting with status 1 (the whole engine stops)", pid, reason)
        channel.fatal(reason)
        return 1
