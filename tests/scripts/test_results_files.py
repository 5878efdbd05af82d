"""Committed results files that a script regenerates in seconds equal what the script prints today,
so a number quoted from them in docs/ cannot drift from the code (regenerate with the command in
each test's docstring when the model of the numbers changes on purpose)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_script(name: str, argv: list[str]) -> str:
    spec = importlib.util.spec_from_file_location(f"{name}_results_script", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert mod.main(argv) == 0
    return buf.getvalue()


def test_capacity_results_match_the_script():
    """docs/results/capacity.txt == `python scripts/capacity.py` (default arguments)."""
    want = (ROOT / "docs" / "results" / "capacity.txt").read_text()
    got = _run_script("capacity", [])
    assert got == want, ("docs/results/capacity.txt is stale: regenerate it with "
                         "`PYTHONPATH=. .venv/bin/python scripts/capacity.py > docs/results/capacity.txt`")


def test_kv_layout_results_match_the_script():
    """docs/results/kv_layout/groups.txt == `python scripts/kv_layout_table.py`."""
    want = (ROOT / "docs" / "results" / "kv_layout" / "groups.txt").read_text()
    got = _run_script("kv_layout_table", [])
    assert got == want, ("docs/results/kv_layout/groups.txt is stale: regenerate it with "
                         "`PYTHONPATH=. .venv/bin/python scripts/kv_layout_table.py > docs/results/kv_layout/groups.txt`")
