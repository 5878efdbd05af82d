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

import jax  # noqa: E402

_cache = os.path.join(os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53")), "jax-compilation-cache")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
