"""Multi-process JAX (`jax.distributed`, JAX's multi-controller runtime): one Python process per
host (or per group of local devices), all of them running the same program over one global mesh.

    from sharding.distributed import DistributedConfig, initialize
    initialize(DistributedConfig("10.0.0.1:1234", num_processes=2, process_id=0))
    jax.devices()        # every process's devices; jax.local_devices() are this process's

`initialize` must run before anything touches a JAX backend (`jax.devices()`, the first array):
the backend is created with the distributed client. Flags of `python -m serving.run`:
`--coordinator-address HOST:PORT` (process 0 hosts the coordinator there), `--num-processes N`
(alias `--nnodes`), `--process-id I` (alias `--node-rank`), `--local-device-ids 0,1,..` and
`--distributed-timeout SECONDS`; JAX also reads `JAX_COORDINATOR_ADDRESS` / `JAX_LOCAL_DEVICE_IDS`.

CPU collectives across processes: jax 0.11.2 creates the CPU client with gloo TCP collectives when
the distributed client exists (`jax_cpu_collectives_implementation` defaults to "gloo" in that
version); `initialize` sets it explicitly so that an older default (none, which makes every
cross-process CPU collective fail) cannot bite. GPUs use NCCL and ignore the setting.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import jax

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in a multi-process run.

    coordinator_address: "host:port" of process 0's coordinator service (None: single process).
    num_processes: total processes (≥ 1). process_id: this process, in [0, num_processes).
    local_device_ids: the local accelerators this process drives (None: all).
    timeout_s: how long to wait for every process to join before failing.
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None
    timeout_s: int = 300

    @property
    def enabled(self) -> bool:
        return self.coordinator_address is not None or self.num_processes > 1

    def validate(self) -> None:
        """Raise ValueError naming the flag for an inconsistent setting."""
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("--coordinator-address HOST:PORT is required with --num-processes > 1")
        if self.coordinator_address is not None:
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--coordinator-address must be HOST:PORT, got {self.coordinator_address!r}")
        if self.timeout_s < 1:
            raise ValueError(f"--distributed-timeout must be >= 1 second, got {self.timeout_s}")


def initialize(config: DistributedConfig) -> bool:
    """Join the multi-process run described by `config` (no-op when it is not enabled).

    Returns True when `jax.distributed` was initialised. Raises ValueError for a bad config and
    RuntimeError when a JAX backend already exists (initialise earlier) or the coordinator cannot
    be reached within `timeout_s`.
    """
    config.validate()
    if not config.enabled:
        return False
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialised in this process")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=list(config.local_device_ids) if config.local_device_ids is not None else None,
            initialization_timeout=config.timeout_s,
        )
    except Exception as e:  # the runtime raises XlaRuntimeError / RuntimeError with terse text
        raise RuntimeError(
            f"process {config.process_id}/{config.num_processes} could not join the coordinator at "
            f"{config.coordinator_address} within {config.timeout_s}s: {e}") from e
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def shutdown() -> None:
    """Leave the multi-process run (no-op when not initialised)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for local multi-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P and P + 1 both free on `host` right now (a multi-process engine's step
    channel and its heartbeats; two adjacent per-replica endpoints). Raises RuntimeError when
    none is found."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind((host, 0))
            p = a.getsockname()[1]
            try:
                b.bind((host, p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two adjacent free ports")


def loopback_engine_flags(num_processes: int, host: str = "127.0.0.1") -> list[str]:
    """`serving.run` flags that make `num_processes` processes on this machine one engine: a free
    coordinator address and step-channel port pair on `host`, and the process count (each process
    adds its `--process-id`; the others `--headless`). For local runs, tests and benchmarks."""
    return ["--coordinator-address", f"{host}:{free_port_pair(host)}", "--master-port", str(free_port_pair(host)),
            "--num-processes", str(num_processes)]


def parse_device_ids(text: str | None) -> tuple[int, ...] | None:
    """"0,1,2,3" → (0, 1, 2, 3); None/"" → None. Raises ValueError naming the flag."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--local-device-ids must be comma-separated integers, got {text!r}") from None
