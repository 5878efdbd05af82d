"""scripts/probe_host_gather.py at --smoke sizes on the CPU: both host-row mechanisms are measured
(hot-row copies, page stores, the contiguous reference), every case's bytes are checked, and the
check itself catches a row or slot sent to the wrong place. The H200 numbers come from running the
script on a lent GPU; here only its plumbing is tested."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


probe = _load("probe_host_gather")


def test_smoke_measures_both_mechanisms_with_byte_exact_checks(tmp_path):
    # (the arguments scripts/gpu_check.py's host_gather part passes, and --repeats)
    out = probe.main(["--smoke", "--out", str(tmp_path), "--budget-s", "200", "--repeats", "2"])
    doc = json.loads((tmp_path / "probe_host_gather.json").read_text())
    assert out["all_correct"] and doc["all_correct"] and doc["failures"] == []
    meta = doc["meta"]
    assert meta["row_words_per_layer"] == 164 and meta["layer_row_bytes"] == 656  # fp8_ds_mla rows
    assert meta["host_row_bytes"] == 656 * meta["pool_layers"]
    assert meta["head_groups"] >= 1 and meta["stacked_groups"] >= 1  # the scanned path ran too
    res = doc["results"]
    assert all(r["status"] == "ok" for r in res), [r for r in res if r["status"] != "ok"]
    for mech in ("memory_kind", "callback"):
        copies = [r for r in res if r["kind"] == "copy" and r["mechanism"] == mech]
        moved = [r for r in copies if r["rows"] > 0]
        assert moved and all(r["check"] == "passed" for r in moved)
        assert all(r["step_ms"] > 0 and r["gb_per_s"] > 0 and r["rows_per_s"] > 0 for r in moved)
        assert any(r["rows"] == 0 and r["check"].startswith("passed") for r in copies)  # the miss-0 baseline
        # bytes = misses · copied layers · 656 B
        assert all(r["bytes"] == r["B"] * r["misses_per_request_per_group"] * meta["copied_layers"] * 656
                   for r in copies)
        stores = [r for r in res if r["kind"] == "store" and r["mechanism"] == mech]
        assert sorted(r["pages"] for r in stores) == [1, 4] and all(r["check"] == "passed" for r in stores)
        assert [r["check"] for r in res if r["kind"] == "h2d_ref" and r["mechanism"] == mech] == ["passed"]
    chunks = {r["chunk"] for r in res if r["kind"] == "copy" and r["mechanism"] == "callback"}
    assert len(chunks) == 2  # the module's chunk and the alternative
    assert doc["verdict"]["suggested_default"] in ("memory_kind", "callback")
    assert doc["verdict"]["ratios_memory_kind_over_callback"]


def test_copy_check_catches_misplaced_rows():
    args = probe.parse_args(["--smoke", "--out", "", "--mechanisms", "memory_kind"])
    su = probe.Setup(args, 0.0)
    rows, slots, nv = su.miss_lists(2, 0.5, np.random.default_rng(0))
    su.arena = su.build_copy("memory_kind")(su.arena, su.pool, rows, slots)
    assert su.check_copy(su.arena, rows, slots, nv) == "passed"
    wrong_row = rows.copy()
    wrong_row[3, 5] += 1  # one host row of a scanned group
    assert su.check_copy(su.arena, wrong_row, slots, nv).startswith("FAILED: group 3")
    swapped = slots.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]  # two slots of the first group exchanged
    assert su.check_copy(su.arena, rows, swapped, nv).startswith("FAILED: group 0")
