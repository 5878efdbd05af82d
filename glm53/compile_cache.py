"""The persistent JAX compilation cache shared by the server, `serving.llm.LLM` and `glm53.api.load`.

Compiled programs (the engine's step buckets, `api.forward_step`, ...) are written under
`$GLM53_HOME/jax-compilation-cache` (default `~/.cache/glm53/jax-compilation-cache`) and read back
by later processes, so a notebook's second `LLM(...)` or a server restart skips most of the
compile time. `GLM53_COMPILATION_CACHE=off` disables it. A directory already configured by the
caller (`jax.config.jax_compilation_cache_dir`) is left alone.

The cache is bounded (`GLM53_COMPILATION_CACHE_GIB`, default 10 GiB, least recently used entries
evicted), which also makes JAX take an inter-process file lock around every read and write, so
processes sharing the directory (a server and a notebook, DP workers, a test and the server it
started) take turns: unbounded, JAX writes entries in place, and a reader can find one half
written (it then warns and compiles again). Bounded, every write scans the whole directory (a stat
and an access-time read per entry, ≈ 150 ms at 2,700 entries on the development machine,
docs/results/suite_time/cache_threshold_2026-12-04.txt) under
that lock: cheap for a server's tens of programs, costly for thousands of tiny ones, which is why
programs under the threshold below are not stored.
"""

from __future__ import annotations

import os

import jax


def compilation_cache_dir() -> str:
    """The directory the cache uses: `$GLM53_HOME/jax-compilation-cache`."""
    home = os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53"))
    return os.path.join(home, "jax-compilation-cache")


def enable_compilation_cache() -> str | None:
    """Turn the persistent cache on (idempotent). → the directory in use, or None when disabled by
    `GLM53_COMPILATION_CACHE=off`. Programs taking under `GLM53_COMPILATION_CACHE_MIN_SECS` (default
    1 s) to compile are not stored. Raises ValueError for a `GLM53_COMPILATION_CACHE_GIB` that is not
    a positive number or a `GLM53_COMPILATION_CACHE_MIN_SECS` that is not a number."""
    if os.environ.get("GLM53_COMPILATION_CACHE", "") == "off":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compilation_cache_dir()
    jax.config.update("jax_compilation_cache_dir", path)
    raw_min = os.environ.get("GLM53_COMPILATION_CACHE_MIN_SECS", "1")
    try:
        min_secs = float(raw_min)
    except ValueError:
        raise ValueError(f"GLM53_COMPILATION_CACHE_MIN_SECS={raw_min!r} is not a number of seconds") from None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
    raw = os.environ.get("GLM53_COMPILATION_CACHE_GIB", "10")
    try:
        gib = float(raw)
    except ValueError:
        raise ValueError(f"GLM53_COMPILATION_CACHE_GIB={raw!r} is not a number of GiB") from None
    if gib <= 0:
        raise ValueError(f"GLM53_COMPILATION_CACHE_GIB={raw!r} must be > 0 (GLM53_COMPILATION_CACHE=off disables "
                         "the cache)")
    jax.config.update("jax_compilation_cache_max_size", int(gib * 2**30))  # > 0: LRU + file lock (above)
    return path
