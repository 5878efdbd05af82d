"""Suite-wide settings: 8 simulated CPU devices and a persistent JAX compilation cache outside
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
# XLA:CPU's backend at optimisation level 2 (XLA's default is 3, not measured for the suite):
# level 0 without LLVM's expensive passes saves about 20 % of backend compile time but makes every
# step run about 1.5–2 times slower, and the suite runs many steps. Two cold runs of the whole
# suite back to back from fresh clones of one commit: 27 min 10 s (user 2,842 s) at level 0 and
# 24 min 33 s (user 2,559 s) at level 2 (docs/results/suite_time/optimisation_level_2026-12-04.txt).
# Set xla_backend_optimization_level in XLA_FLAGS yourself to test under other settings; servers
# and workers the tests start inherit the flags.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=2"

from pathlib import Path

import pytest  # noqa: E402

from glm53.compile_cache import enable_compilation_cache  # noqa: E402

# The server's own settings (bounded, so reads and writes are locked against the servers and
# workers the tests start, which share the cache), except that programs compiled in 0.5 s or more
# are stored (the server: 1 s): the suite builds many engines of one configuration (in other
# modules, and in the servers it starts, which inherit the variable), and their steps compile in
# about 1–3 s. Not lower: JAX's bounded cache scans every entry (a stat and an access-time read
# each) on every write, under the lock, and the suite leaves thousands of entries; storing the
# hundreds of eager single-op programs (tens of ms to compile) cost more than compiling them.
# Measured on test_training.py with a cache of 2,680 entries: threshold 0 → 86 s (740 files
# written), 0.5 s → 30 s (6 written) (docs/results/suite_time/cache_threshold_2026-12-04.txt).
os.environ.setdefault("GLM53_COMPILATION_CACHE_MIN_SECS", "0.5")
enable_compilation_cache()
# In-process engines compile each step program on its first use instead of every bucket (and,
# with HiSparse, both the plain and the hot program of each) at start-up: many test engines never
# run some of them (serving/engine_args.py `skip_precompile_requested`). Servers the tests start
# as processes compile at start-up as in production (tests/helpers/server_process.py).
os.environ.setdefault("SKIP_JAX_PRECOMPILE", "1")


# GLM53_SUITE_COMPILE_LOG=<file>: each test process appends one JSON line per test module — its
# compile requests, compilation-cache hits and seconds of backend compile (jax.monitoring events),
# and its wall seconds — so where the suite's time goes can be summed per module
# (scripts/suite_compile_report.py). Unset: nothing is recorded.
_COMPILE_LOG = os.environ.get("GLM53_SUITE_COMPILE_LOG")
_compile_stats: dict[str, float] = {}
if _COMPILE_LOG:
    import jax.monitoring

    def _count(event, value=1.0, **_):
        _compile_stats[event] = _compile_stats.get(event, 0.0) + value

    jax.monitoring.register_event_listener(lambda event, **kw: _count(event))
    jax.monitoring.register_event_duration_secs_listener(lambda event, secs, **kw: _count(event, secs))


@pytest.fixture(scope="module", autouse=True)
def _module_compile_log(request):
    if not _COMPILE_LOG:
        yield
        return
    import json
    import time

    _compile_stats.clear()
    start = time.perf_counter()
    yield
    s = _compile_stats
    row = {"module": request.module.__name__, "wall_s": round(time.perf_counter() - start, 2),
           "compile_requests": int(s.get("/jax/compilation_cache/compile_requests_use_cache", 0)),
           "cache_hits": int(s.get("/jax/compilation_cache/cache_hits", 0)),
           "backend_compile_s": round(s.get("/jax/core/compile/backend_compile_duration", 0.0), 2),
           "trace_lower_s": round(s.get("/jax/core/compile/jaxpr_trace_duration", 0.0)
                                  + s.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.0), 2),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(_COMPILE_LOG, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shallow_model: in this module, whatever falls back to the embedded tiny checkpoint (EngineArgs "
        "without a model, glm53.api.load(), LLM()) gets its 7-layer twin (tests/helpers/shallow_model.py)")


@pytest.fixture(scope="module", autouse=True)
def _shallow_model(request):
    """A module marked `shallow_model` runs on the tiny checkpoint's 7-layer twin: its in-process
    fallbacks to the tiny checkpoint (`glm53.tiny_checkpoint.default_model_dir()` without
    arguments, which `serving.engine_startup` and `glm53.api.load` call when no model is given)
    return the twin's directory while the module runs."""
    if request.node.get_closest_marker("shallow_model") is None:
        yield
        return
    from glm53 import tiny_checkpoint
    from tests.helpers.shallow_model import shallow_model_dir

    original = tiny_checkpoint.default_model_dir
    twin = Path(shallow_model_dir())

    def default_model_dir(name=tiny_checkpoint.CHECKPOINT_NAME, config_overrides=None):
        if name == tiny_checkpoint.CHECKPOINT_NAME and not config_overrides:
            return twin
        return original(name, config_overrides)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_checkpoint, "default_model_dir", default_model_dir)
        yield


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
    # The HiSparse engine's module before MTP's: its ample engine (compiled at its start) is
    # also the reference of MTP's HiSparse test, which then reads it from the compilation cache.
    "tests/serving/test_hisparse_engine.py",  # 312 s
    "tests/serving/test_spec_decode.py",  # 324 s
    "tests/sharding/test_hisparse_parallel.py",  # 301 s
    "tests/sharding/test_pd_parallel.py",  # 491 s in a 2-worker cold run (the times above: serial)
    "tests/serving/test_pd_engine.py",  # 388 s in a 2-worker cold run
    "tests/sharding/test_parallel_logits.py",  # 193 s
    "tests/serving/test_engine_kernels.py",  # 95 s alone, cold (Pallas interpret-mode step programs)
    # After test_hisparse_engine: its ample engine is the same (read from the compilation cache).
    "tests/serving/test_offload.py",  # 67 s in a 2-worker cold run on the twin (142 s on 14 layers)
    "tests/serving/test_cuda_export.py",  # 20 s alone (eight engines built, nothing compiled)
    "tests/scripts/test_gpu_check.py",  # 91 s alone (gpu_check.py --dry-run: four parts, subprocesses)
    "tests/glm53/test_fp8_weights.py",  # 107 s
    "tests/sharding/test_engine_parallel.py",  # 106 s
    "tests/glm53/test_hf_parity.py",  # 90 s
    "tests/serving/test_faults.py",  # 84 s
    "tests/serving/test_pd_router.py",  # 85 s in a 2-worker cold run
    "tests/serving/test_penalties.py",  # 89 s in a 2-worker cold run (before its MTP test compiled one variant less)
    "tests/sharding/test_fp8_parallel.py",  # 78 s
    "tests/serving/test_tiny_recall.py",  # 75 s
    "tests/glm53/test_kv_cache_dtypes.py",  # 70 s
    "tests/glm53/test_generate_batch.py",  # 66 s
    "tests/glm53/test_hot_cache.py",  # 61 s
    "tests/scripts/test_train_tiny.py",  # 58 s
    "tests/test_notebooks.py",  # 57 s
    "tests/glm53/test_training.py",  # 53 s
    "tests/sharding/test_engine_dp.py",  # 49 s
    # (alone on a warm compilation cache, a contended machine: 38 s and 28 s; more cold)
    "tests/sharding/test_spec_decode_async_parallel.py",
    "tests/serving/test_spec_decode_async.py",
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

