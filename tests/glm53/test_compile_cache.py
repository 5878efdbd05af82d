"""`glm53.api.load` and `serving.llm.LLM` use the server's persistent compilation cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_llm_and_api_load_use_the_persistent_compilation_cache(tmp_path):
    """A fresh process: `glm53.api.load` turns the cache on under $GLM53_HOME, and a jitted step
    lands there (so notebooks reuse compiles, as the server does). The cache is bounded, so JAX
    serialises reads and writes across processes with its lock file (no torn entries)."""
    from glm53.tiny_checkpoint import default_model_dir

    code = (f"import jax; from glm53 import api; lm = api.load({str(default_model_dir())!r}); "
            "import numpy as np; api.forward(lm, list(range(5, 40))); "
            "print(jax.config.jax_compilation_cache_max_size); print(jax.config.jax_compilation_cache_dir)")
    env = {**os.environ, "GLM53_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    cache = tmp_path / "jax-compilation-cache"
    assert r.stdout.strip().splitlines()[-1] == str(cache)
    assert any(cache.iterdir())  # compiled programs were written
    assert int(r.stdout.strip().splitlines()[-2]) == 10 * 2**30
    assert (cache / ".lockfile").exists()


def _num_memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_release_compiled_unmaps_the_programs_nothing_uses():
    """`api.release_compiled` unloads `api.forward`'s compiled step: the process's memory maps
    (what Linux bounds with vm.max_map_count) drop back to about what they were before it was compiled,
    and a later call compiles again to the same logits."""
    import numpy as np

    from glm53 import api
    from glm53.tiny_checkpoint import default_model_dir

    lm = api.load(str(default_model_dir()))
    api.release_compiled()
    before = _num_memory_maps()
    first = api.forward(lm, list(range(5, 40)))
    loaded = _num_memory_maps()
    assert loaded > before + 100, (before, loaded)  # the step's code, constants and data are mapped
    api.release_compiled()
    released = _num_memory_maps()
    # (a few maps stay: allocator arenas, buffers of the returned logits)
    assert released - before < (loaded - before) / 10, (before, loaded, released)
    np.testing.assert_allclose(api.forward(lm, list(range(5, 40))), first, rtol=1e-5, atol=1e-5)
