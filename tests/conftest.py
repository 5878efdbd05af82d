"""Suite-wide settings: 8 simulated CPU devices and a persistent JAX compilation cache outside
the repository (repeated runs on one machine skip recompiling the same steps).

The parallel layouts (tests/sharding) need 8 devices, and XLA reads the device count once, when
the backend starts; the whole suite runs in one pytest process, so the flag is set here, before
any test touches JAX. Everything else keeps running on device 0 (`jax.devices()[0]`, the default
device), so single-device tests are unaffected. Subprocess tests that need another count set
XLA_FLAGS in the child's environment themselves.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

from glm53.compile_cache import enable_compilation_cache  # noqa: E402

# The server's own settings (bounded, so reads and writes are locked against the servers and
# workers the tests start, which share the cache).
enable_compilation_cache()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module (its own fixtures are torn down first), unload the programs it
    compiled. The whole suite runs in one process, and every XLA:CPU executable keeps memory maps
    in it: without this the suite passes 40,000 maps, near Linux's `vm.max_map_count` (65,530),
    where the next executable load segfaults (glm53.api.release_compiled)."""
    yield
    from glm53.api import release_compiled

    release_compiled()

