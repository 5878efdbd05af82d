"""scripts/suite_memory_probe.py: after a test module, its TSV row counts what the module left
alive (here a module-level 4 MiB array) and the process's memory maps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self")
def test_probe_writes_one_row_per_module(tmp_path):
    (tmp_path / "test_keeps_an_array.py").write_text(
        "import jax.numpy as jnp\nKEEP = jnp.ones((1024, 1024), jnp.float32)  # 4 MiB, alive with the module\n"
        "def test_one():\n    assert float(KEEP[0, 0]) == 1.0\n"
        "def test_two():\n    assert KEEP.shape == (1024, 1024)\n")
    out = tmp_path / "probe.tsv"
    env = {**os.environ, "GLM53_MEMORY_PROBE": str(out), "PYTHONPATH": str(REPO / "scripts"),
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_memory_probe",
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert len(rows) == 1  # one module, two tests
    module, maps, rss, arrays, array_mib, engines = rows[0]
    assert module == "test_keeps_an_array"
    assert int(maps) > 100 and int(rss) > 50
    assert int(arrays) >= 1 and int(array_mib) >= 4 and int(engines) == 0
    assert f"most maps after a module: {maps} (test_keeps_an_array)" in r.stdout
