"""scripts/bootstrap.sh finds a Python >= 3.12 by itself, including one `uv python install` put
in uv's directory layout, and says clearly when there is none."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bootstrap.sh"


def which_python(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """`bootstrap.sh which-python` in an environment the test controls: a PATH holding only
    `dirname` (no Python), no pyenv, no uv, and the system install roots replaced by an empty
    directory — so only the Pythons the test puts in place can be found, on any machine."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    if not (tools / "dirname").exists():
        (tools / "dirname").symlink_to(shutil.which("dirname"))
    (tmp_path / "empty").mkdir(exist_ok=True)
    base = {"PATH": str(tools), "HOME": str(tmp_path / "home"), "PYENV_ROOT": str(tmp_path / "no-pyenv"),
            "BOOTSTRAP_SYSTEM_ROOTS": str(tmp_path / "empty")}
    return subprocess.run([shutil.which("bash"), str(SCRIPT), "which-python"], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)


def test_finds_a_uv_installed_python(tmp_path):
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


def test_says_clearly_when_there_is_none(tmp_path):
    r = which_python(tmp_path)
    assert r.returncode == 1 and "no Python >= 3.12 found" in r.stderr


def test_python_env_var_wins(tmp_path):
    r = which_python(tmp_path, PYTHON=sys.executable)
    assert r.returncode == 0 and r.stdout.strip() == sys.executable

