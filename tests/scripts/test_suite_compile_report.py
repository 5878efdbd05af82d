"""scripts/suite_compile_report.py: the per-module table and totals of the compile log that
tests/conftest.py writes (GLM53_SUITE_COMPILE_LOG)."""

import json

import pytest

from scripts.suite_compile_report import load, main, report

ROWS = [
    {"module": "tests.a", "wall_s": 10.0, "compile_requests": 4, "cache_hits": 1, "backend_compile_s": 6.0,
     "trace_lower_s": 1.0, "worker": "gw0"},
    {"module": "tests.b", "wall_s": 30.0, "compile_requests": 2, "cache_hits": 2, "backend_compile_s": 0.0,
     "trace_lower_s": 0.5, "worker": "gw1"},
]


def test_modules_are_listed_slowest_first_with_totals(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "report.txt"
    assert main([str(log), "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[1].endswith("tests.b") and lines[2].endswith("tests.a")
    assert lines[3].split()[:5] == ["40.0", "6.0", "1.5", "6", "3"]
    assert "15%" in lines[4]  # 6 s of compile in 40 s of wall


def test_top_limits_the_listed_modules_but_not_the_totals():
    text = report(ROWS, top=1)
    assert "tests.a" not in text and "all 2 modules" in text


def test_a_malformed_line_names_its_number(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"log.jsonl:2"):
        load(str(log))
