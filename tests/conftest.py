"""Suite-wide settings: a persistent JAX compilation cache outside the repository (repeated runs
on one machine skip recompiling the same steps)."""

import os

import jax

_cache = os.path.join(os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53")), "jax-compilation-cache")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
