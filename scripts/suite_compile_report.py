"""Where the test suite's time goes, per test module: compile requests, compilation-cache hits,
seconds of XLA backend compile and of tracing + lowering, and wall seconds, from the JSON lines
that tests/conftest.py writes when GLM53_SUITE_COMPILE_LOG names a file.

    GLM53_SUITE_COMPILE_LOG=/tmp/compile.jsonl scripts/bootstrap.sh test
    python scripts/suite_compile_report.py /tmp/compile.jsonl [--top 30] [--out report.txt]

Only the pytest processes are counted: servers and worker processes that tests start compile in
their own processes (their time shows in the module's wall seconds, not in its compile columns).
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> list[dict]:
    """The log's rows, one per (test process, module); a missing or malformed line raises
    ValueError naming the line number."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e})") from None
    return rows


def report(rows: list[dict], top: int) -> str:
    """A table of the `top` modules by wall seconds, then totals."""
    rows = sorted(rows, key=lambda r: -r["wall_s"])
    keys = ("wall_s", "backend_compile_s", "trace_lower_s", "compile_requests", "cache_hits")
    total = {k: sum(r[k] for r in rows) for k in keys}
    out = [f"{'wall s':>8} {'compile s':>9} {'trace s':>8} {'requests':>8} {'hits':>5}  module"]
    for r in rows[:top]:
        out.append(f"{r['wall_s']:8.1f} {r['backend_compile_s']:9.1f} {r['trace_lower_s']:8.1f} "
                   f"{r['compile_requests']:8d} {r['cache_hits']:5d}  {r['module']}")
    out.append(f"{total['wall_s']:8.1f} {total['backend_compile_s']:9.1f} {total['trace_lower_s']:8.1f} "
               f"{total['compile_requests']:8d} {total['cache_hits']:5d}  all {len(rows)} modules")
    share = total["backend_compile_s"] / total["wall_s"] if total["wall_s"] else 0.0
    out.append(f"backend compile is {share:.0%} of the modules' wall seconds "
               f"(summed over the test processes)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="the GLM53_SUITE_COMPILE_LOG file")
    ap.add_argument("--top", type=int, default=30, help="modules listed (default 30)")
    ap.add_argument("--out", help="also write the report to this file")
    a = ap.parse_args(argv)
    text = report(load(a.log), a.top)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
