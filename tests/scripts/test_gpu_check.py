"""scripts/gpu_check.py --dry-run: the env, serve and kernels parts run on CPU at tiny sizes
(interpret-mode kernels; the serve part on its most involved configuration only, and the
host_gather part left to tests/scripts/test_probe_host_gather.py, to keep the suite short),
so the first GPU call cannot die on a typo; the summary has every part, the serve part compares
the Pallas-kernel engine with the reference engine on HiSparse with the callback mechanism under
pressure — the engine-through-the-kernels check of the HiSparse step, which
tests/serving/test_engine_kernels.py leaves to this test: the streams are equal and the hot step
calls the resolver's Pallas kernels; a part killed at its budget is reported as such. The serve part runs on the suite's 7-layer twin of
the tiny checkpoint (`--model`: the same structures, half the layers to compile and interpret;
tests/helpers/shallow_model.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.server_process import REPO
from tests.helpers.shallow_model import shallow_model_dir


def run(out, *args, timeout=600):
    return subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), *args], cwd=REPO,
                          env={**__import__("os").environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_runs_its_parts_and_the_kernel_engine_serves_the_reference_streams(tmp_path):
    # (The host_gather part runs scripts/probe_host_gather.py as the kernels part runs its script,
    # `_script_part`; tests/scripts/test_probe_host_gather.py runs that script with the same flags.)
    p = run(tmp_path, "--dry-run", "--budget-s", "240", "--parts", "env,serve,kernels",
            "--serve-configs", "hisparse_callback", "--model", shallow_model_dir())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["parts"]) == {"env", "serve", "kernels"}
    assert all(e["status"] == "ok" for e in s["parts"].values()), {k: e["status"] for k, e in s["parts"].items()}
    assert s["parts"]["env"]["result"]["jax"] and s["model"] == shallow_model_dir()
    serve = s["parts"]["serve"]["result"]
    assert set(serve) == {"hisparse_callback"}
    for name, r in serve.items():
        assert r["status"] == "ok" and r["streams_equal"] and r["divergences"] == [], (name, r)
        assert r["kernels"]["mode"] == "interpret" and r["reference"]["mode"] == "reference"
        assert r["kernels"]["audit"] == [] and r["reference"]["audit"] == []
    hs = serve["hisparse_callback"]["kernels"]
    assert hs["mechanism"] == "callback" and hs["hot_steps"] > 0 and hs["misses"] > 0
    # The hot step program calls the Pallas kernels (traced: a silent fallback to a reference
    # would leave a name out), the hot-buffer resolver's four included.
    assert {"sparse_mla", "indexer_scores", "hot_resolve_validate", "hot_resolve_lookup", "hot_resolve_rank",
            "hot_resolve_assign"} <= set(hs["pallas_kernels"]), hs["pallas_kernels"]
    assert "pallas_kernels" not in serve["hisparse_callback"]["reference"]
    assert "trace" not in hs  # (a dry run takes none: the next test checks the tracing)
    assert (tmp_path / "kernels" / "bench_kernels.json").exists()
    assert "summary.json" in p.stdout and "hisparse_callback: ok, equal" in p.stdout


def test_a_part_past_its_budget_is_reported_and_bad_names_are_refused(tmp_path):
    p = run(tmp_path, "--dry-run", "--budget-s", "8", "--parts", "serve", "--serve-configs", "default")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["parts"]) == {"serve"}
    # 8 s cannot build two engines: the serve part skips its configuration, or is killed at its budget
    serve = s["parts"]["serve"]
    assert serve["status"] == "timeout" or serve["result"]["default"]["status"] == "skipped", serve
    assert p.returncode == (1 if serve["status"] == "timeout" else 0)
    for budget in ("-5", "0"):
        p = run(tmp_path, "--dry-run", "--budget-s", budget, "--parts", "env", timeout=120)
        assert p.returncode == 2 and "--budget-s must be a positive number" in p.stderr, p.stderr
    bad = run(tmp_path, "--parts", "env,gpu")
    assert bad.returncode == 2 and "--parts: unknown ['gpu']" in bad.stderr
    bad = run(tmp_path, "--model", str(tmp_path), "--parts", "env")
    assert bad.returncode == 2 and "is not a checkpoint directory (no config.json in it)" in bad.stderr, bad.stderr
    bad = run(tmp_path, "--serve-configs", "nope")
    assert bad.returncode == 2 and "--serve-configs: unknown ['nope']" in bad.stderr


def test_the_serve_part_traces_the_steps_after_the_first(tmp_path):
    """`_traced_steps` on a stand-in engine whose step runs a jitted program: steps 2 … 1 + n are
    traced (their `engine_step` annotations summarised by scripts/trace_summary.py), the XSpace
    file removed, the Perfetto file kept."""
    import jax
    import jax.numpy as jnp

    from scripts.gpu_check import _traced_steps

    class Engine:
        left = 6
        matmul = staticmethod(jax.jit(lambda a: a @ a))

        def has_unfinished_requests(self):
            return self.left > 0

        def step(self):
            self.left -= 1
            self.matmul(jnp.ones((64, 64))).block_until_ready()
            return []

    steps, trace = _traced_steps(Engine(), {}, {}, str(tmp_path / "t"), trace_steps=3)
    assert steps == 6 and "error" not in trace, trace
    assert trace["steps"]["count"] == 3 and trace["by_process"]
    assert list((tmp_path / "t").rglob("perfetto_trace.json.gz")) and not list((tmp_path / "t").rglob("*.xplane.pb"))
