"""Suite-wide settings: 8 simulated CPU devices, XLA:CPU compiling without LLVM optimisation, and a persistent JAX compilation cache outside
the repository (repeated runs on one machine skip recompiling the same steps); the order in which
the two pytest-xdist workers take the test modules.

The parallel layouts (tests/sharding) need 8 devices, and XLA reads the device count once, when
the backend starts. The suite runs in two pytest-xdist worker processes (`-n 2 --dist loadfile`
in pyproject.toml's addopts: each test module stays in one worker, with its module-scoped engines
and servers); every worker imports this file before any test touches JAX, so the flag and the
cache are set here, in each of them. Everything else keeps running on device 0 (`jax.devices()[0]`, the default
device), so single-device tests are unaffected. Subprocess tests that need another count set
XLA_FLAGS in the child's environment themselves.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Most of the suite's time is XLA:CPU compiling tiny programs that then run for milliseconds: the
# tests (and the servers and workers they start, which inherit XLA_FLAGS) compile with LLVM's
# optimisation off and without its expensive passes. Measured on the 2-core machine, with the
# compilation cache off, for tests/serving/test_fp8_engine.py + test_llm.py (34 programs):
# 22.8 s → 16.1 s of backend compile. Every comparison in the suite is between two runs under the
# same flags, or within a stated tolerance. Set XLA_FLAGS with xla_backend_optimization_level
# yourself to test under other settings.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

import pytest  # noqa: E402

from glm53.compile_cache import enable_compilation_cache  # noqa: E402

# The server's own settings (bounded, so reads and writes are locked against the servers and
# workers the tests start, which share the cache), except that every program is stored, however
# quickly it compiled: with LLVM optimisation off most of the tiny model's programs compile in
# under the server's 1 s threshold, and the suite builds many engines of one configuration (in
# other modules, and in the servers it starts, which inherit the variable). Measured with an empty
# cache for test_llm + test_fp8_engine + test_e2e_server: 246 s → 221 s, 18 programs read back.
os.environ.setdefault("GLM53_COMPILATION_CACHE_MIN_SECS", "0")
enable_compilation_cache()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module (its own fixtures are torn down first), unload the programs it
    compiled. Each test process (one, or one per xdist worker) runs many modules, and every XLA:CPU
    executable keeps memory maps in it: without this a single process passes 40,000 maps, near Linux's `vm.max_map_count` (65,530),
    where the next executable load segfaults (glm53.api.release_compiled)."""
    yield
    from glm53.api import release_compiled

    release_compiled()


# The slowest test modules, slowest first (seconds of setup + call + teardown in one cold serial run
# with `--durations=0` on the 2-core development machine, shared and busy at the time: the order
# matters, not the numbers). Under xdist (`--dist loadfile`, `--no-loadscope-reorder`) a worker
# takes the next module when it is nearly done with its last, so putting the long modules first
# and the many short ones last lets both workers finish at about the same time. A module not
# listed runs after these, in the usual order. Refresh the list when a module's time changes much
# (`pytest -n 0 --durations=0`, summed per file).
SLOW_MODULES = (
    "tests/sharding/test_multihost.py",  # 330 s in a serial cold run (subprocesses: 2 engines each)
    "tests/serving/test_spec_decode.py",  # 324 s
    "tests/serving/test_hisparse_engine.py",  # 312 s
    "tests/sharding/test_hisparse_parallel.py",  # 301 s
    "tests/sharding/test_pd_parallel.py",  # 491 s in a 2-worker cold run (the times above: serial)
    "tests/serving/test_pd_engine.py",  # 388 s in a 2-worker cold run
    "tests/sharding/test_parallel_logits.py",  # 193 s
    "tests/glm53/test_fp8_weights.py",  # 107 s
    "tests/sharding/test_engine_parallel.py",  # 106 s
    "tests/glm53/test_hf_parity.py",  # 90 s
    "tests/serving/test_faults.py",  # 84 s
    "tests/serving/test_pd_router.py",  # 85 s in a 2-worker cold run
    "tests/sharding/test_fp8_parallel.py",  # 78 s
    "tests/serving/test_tiny_recall.py",  # 75 s
    "tests/glm53/test_kv_cache_dtypes.py",  # 70 s
    "tests/glm53/test_generate_batch.py",  # 66 s
    "tests/serving/test_offload.py",  # 63 s
    "tests/glm53/test_hot_cache.py",  # 61 s
    "tests/scripts/test_train_tiny.py",  # 58 s
    "tests/test_notebooks.py",  # 57 s
    "tests/glm53/test_training.py",  # 53 s
    "tests/sharding/test_engine_dp.py",  # 49 s
    "tests/serving/test_hisparse_server.py",  # 38 s
    "tests/kernels/test_pallas_fp8.py",  # 33 s
    "tests/glm53/test_orbax_checkpoint.py",  # 32 s
    "tests/glm53/test_capacity.py",  # 31 s
    "tests/serving/test_fp8_engine.py",  # 30 s
    "tests/serving/test_e2e_server.py",  # 28 s
    "tests/sharding/test_distributed.py",  # 26 s
    "tests/serving/test_lifecycle.py",  # 25 s
    "tests/glm53/test_weight_bytes.py",  # 23 s
    "tests/glm53/test_compile_cache.py",  # 22 s
    "tests/kernels/test_hot_resolve.py",  # 22 s
    "tests/glm53/test_equality.py",  # 17 s
    "tests/glm53/test_hub.py",  # 17 s
    "tests/kernels/test_fp8_matmul.py",  # 16 s
    "tests/serving/test_fuzz_api.py",  # 16 s
    "tests/serving/test_llm.py",  # 15 s
)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker, order the modules slowest first (SLOW_MODULES), keeping the order of
    the tests inside each module. Without xdist (`-n 0`) the usual order is kept."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {path: i for i, path in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_MODULES)))

