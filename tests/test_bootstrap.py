"""scripts/bootstrap.sh finds a Python >= 3.12 by itself, including one `uv python install` put
in uv's directory layout, and says clearly when there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bootstrap.sh"


def which_python(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "PYENV_ROOT": str(tmp_path / "no-pyenv")}
    return subprocess.run(["bash", str(SCRIPT), "which-python"], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)


@pytest.fixture
def no_system_312():
    out = subprocess.run(["bash", "-c", "for p in /usr/bin/python3* /usr/local/bin/python3.1[2-9]; do "
                          "[ -x \"$p\" ] && \"$p\" -c 'import sys; print(sys.version_info >= (3, 12))'; done"],
                         capture_output=True, text=True)
    if "True" in out.stdout:
        pytest.skip("this machine has a system Python >= 3.12 that bootstrap.sh would find first")


def test_finds_a_uv_installed_python(tmp_path, no_system_312):
    uv = tmp_path / "uv-pythons" / "cpython-3.12.9-linux-x86_64-gnu" / "bin"
    uv.mkdir(parents=True)
    (uv / "python3").symlink_to(sys.executable)  # the running interpreter is >= 3.12
    r = which_python(tmp_path, UV_PYTHON_INSTALL_DIR=str(tmp_path / "uv-pythons"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(uv / "python3")
    # uv's default location, under $HOME
    default = tmp_path / "home" / ".local" / "share" / "uv" / "python" / "cpython-3.13.1-linux-x86_64-gnu" / "bin"
    default.mkdir(parents=True)
    (default / "python3").symlink_to(sys.executable)
    r = which_python(tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == str(default / "python3"), r.stderr


def test_says_clearly_when_there_is_none(tmp_path, no_system_312):
    r = which_python(tmp_path)
    if r.returncode == 0 and r.stdout.strip().startswith("/opt"):
        pytest.skip(f"an /opt Python >= 3.12 exists here: {r.stdout.strip()}")
    assert r.returncode == 1 and "no Python >= 3.12 found" in r.stderr


def test_python_env_var_wins(tmp_path):
    r = which_python(tmp_path, PYTHON=sys.executable)
    assert r.returncode == 0 and r.stdout.strip() == sys.executable

