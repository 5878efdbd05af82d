"""A pytest plugin that records, after each test module (its fixtures torn down, its compiled
programs released by tests/conftest.py), what the suite's single process still holds: memory maps
(`/proc/self/maps`, which Linux bounds by `vm.max_map_count`), resident memory, live JAX arrays,
and live engines. It is how docs/reliability.md ("Compiled programs on CPU") was measured.

    GLM53_MEMORY_PROBE=/tmp/probe.tsv PYTHONPATH=scripts .venv/bin/python -m pytest -q \\
        -p suite_memory_probe [tests/serving ...]

Each line of the TSV: module, maps, RSS MiB, live arrays, live array MiB, live `LLMEngine`s. The
highest map count is printed at the end of the run. Linux only (reads /proc/self).
"""

from __future__ import annotations

import gc
import os

import pytest

_peak: list[tuple[int, str]] = []


def _sample() -> tuple[int, int]:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return maps, rss_kib // 1024


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    out = os.environ.get("GLM53_MEMORY_PROBE")
    if not out or (nextitem is not None and nextitem.module is item.module):
        return
    import jax

    gc.collect()
    maps, rss = _sample()
    arrays = jax.live_arrays()
    engines = sum(type(o).__name__ == "LLMEngine" for o in gc.get_objects())
    _peak.append((maps, item.module.__name__))
    with open(out, "a") as f:
        f.write(f"{item.module.__name__}\t{maps}\t{rss}\t{len(arrays)}\t"
                f"{sum(a.nbytes for a in arrays) / 2**20:.0f}\t{engines}\n")


def pytest_terminal_summary(terminalreporter):
    if _peak:
        maps, module = max(_peak)
        terminalreporter.write_line(f"memory probe: most maps after a module: {maps} ({module}); "
                                    f"table in {os.environ['GLM53_MEMORY_PROBE']}")
