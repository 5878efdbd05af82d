"""Multi-process JAX: two local processes × 4 simulated CPU devices form one global mesh of 8,
restore the orbax checkpoint onto it and give the single-device run's logits."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from glm53 import api
from glm53.tiny_checkpoint import default_model_dir
from scripts.convert_checkpoint import main as convert
from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from sharding.distributed import DistributedConfig, free_port, parse_device_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = [5, 17, 99, 3, 250, 8, 41, 77, 130, 9]
TIMEOUT_S = 420


def _run_pair(ckpt: str, tmp_path) -> list[np.ndarray]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs, logs = [], []
    for pid in range(2):
        log = open(tmp_path / f"proc{pid}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.distributed_worker", f"127.0.0.1:{port}", str(pid), ckpt,
             str(tmp_path / f"logits{pid}.npy"), ",".join(map(str, PROMPT))],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = f"process {bad[0]} exited with {procs[bad[0]].returncode}" if bad else f"timeout {TIMEOUT_S}s"
            break
        time.sleep(0.2)
    for p in procs:  # never leave a peer waiting on a dead coordinator
        if p.poll() is None:
            p.kill()
            p.wait()
    if failed is None and any(p.returncode for p in procs):
        failed = f"exit codes {[p.returncode for p in procs]}"
    outputs = []
    for pid, log in enumerate(logs):
        log.seek(0)
        outputs.append(f"--- process {pid} ---\n{log.read()[-4000:]}")
        log.close()
    assert failed is None, failed + "\n" + "\n".join(outputs)
    return [np.load(tmp_path / f"logits{pid}.npy") for pid in range(2)]


def test_two_processes_match_single_device(tmp_path):
    """Tolerance 2e-5 absolute (fp32 logits of magnitude ~4; sharded matmuls reorder sums)."""
    ckpt = str(tmp_path / "ckpt")
    assert convert([str(default_model_dir()), ckpt, "--no-progress"]) == 0
    ref = api.forward(api.load(), PROMPT)
    got = _run_pair(ckpt, tmp_path)
    np.testing.assert_array_equal(got[0], got[1])  # one global program, replicated output
    np.testing.assert_allclose(got[0], ref, rtol=0, atol=2e-5)
    assert (got[0].argmax(-1) == ref.argmax(-1)).all()


def test_config_validation_names_the_flag():
    DistributedConfig().validate()
    assert not DistributedConfig().enabled
    for cfg, flag in [(DistributedConfig("h:1", num_processes=2, process_id=2), "--process-id"),
                      (DistributedConfig(None, num_processes=2), "--coordinator-address"),
                      (DistributedConfig("no-port", num_processes=2), "--coordinator-address"),
                      (DistributedConfig("h:1", num_processes=0), "--num-processes")]:
        with pytest.raises(ValueError, match=flag):
            cfg.validate()
    assert parse_device_ids("0,1,3") == (0, 1, 3) and parse_device_ids(None) is None
    with pytest.raises(ValueError, match="--local-device-ids"):
        parse_device_ids("0,x")


def test_serving_run_flags():
    args = make_arg_parser().parse_args(["--coordinator-address", "10.0.0.1:1234", "--nnodes", "1",
                                         "--node-rank", "0", "--local-device-ids", "0,1"])
    validate_args(args)
    assert (args.coordinator_address, args.num_processes, args.process_id) == ("10.0.0.1:1234", 1, 0)
    assert args.distributed_config.local_device_ids == (0, 1) and args.distributed_config.enabled
    args = make_arg_parser().parse_args(["--num-processes", "2", "--process-id", "1"])
    with pytest.raises(ArgumentError, match="--coordinator-address"):
        validate_args(args)
