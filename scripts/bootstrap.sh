#!/usr/bin/env bash
# Set up the project in ./.venv and run it.
#
#   scripts/bootstrap.sh serve [serving.run flags…]   install, then start the OpenAI server
#   scripts/bootstrap.sh test  [pytest args…]         install, then run the whole test suite
#   scripts/bootstrap.sh which-python                 print the Python >= 3.12 it would build .venv with
#
# Finds a Python >= 3.12 by itself: $PYTHON, then python3.13/python3.12/python3/python on PATH,
# then pyenv's installed versions (~/.pyenv/versions/*), then the Pythons `uv python install`
# manages (`uv python find`, $UV_PYTHON_INSTALL_DIR or ~/.local/share/uv/python/*), then /usr/local
# and /opt installs.
# Set GLM53_EXTRAS=cuda12 to install the CUDA 12 build of JAX as well.
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  for c in python3.14 python3.13 python3.12 python3 python; do
    command -v "$c" >/dev/null 2>&1 && candidates+=("$(command -v "$c")")
  done
  if command -v uv >/dev/null 2>&1; then
    c="$(uv python find '>=3.12' 2>/dev/null || true)"
    [ -n "$c" ] && candidates+=("$c")
  fi
  local uv_root="${UV_PYTHON_INSTALL_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/uv/python}"
  local system_roots
  read -r -a system_roots <<< "${BOOTSTRAP_SYSTEM_ROOTS:-/usr/local/bin /opt/python /opt}"  # tests replace these
  local roots=("${PYENV_ROOT:-$HOME/.pyenv}/versions" "$uv_root" "${system_roots[@]}")
  for r in "${roots[@]}"; do
    for c in "$r"/3.1[2-9]*/bin/python3 "$r"/python3.1[2-9] "$r"/*/bin/python3.1[2-9] "$r"/cpython-3.1[2-9]*/bin/python3; do
      [ -x "$c" ] && candidates+=("$c")
    done
  done
  for c in "${candidates[@]}"; do
    if ok "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

action="${1:-}"
case "$action" in
  serve|test) shift ;;
  which-python)
    find_python || { echo "error: no Python >= 3.12 found" >&2; exit 1; }
    exit 0 ;;
  *) echo "usage: $0 {serve|test|which-python} [args…]" >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ] || ! ok .venv/bin/python; then
  if [ -n "${PYTHON:-}" ] && ! ok "$PYTHON"; then
    echo "note: PYTHON=$PYTHON is not a working Python >= 3.12; looking elsewhere" >&2
  fi
  if ! py="$(find_python)"; then
    echo "error: no Python >= 3.12 found (JAX 0.11 needs it); looked at \$PYTHON, PATH, pyenv versions, uv's Pythons, /usr/local, /opt." >&2
    echo "Install one (e.g. 'pyenv install 3.12' or 'uv python install 3.12') and rerun, or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "using $py ($("$py" -V 2>&1)) for .venv"
  rm -rf .venv
  "$py" -m venv .venv
fi

stamp=.venv/.installed
want="$(cat pyproject.toml; echo "${GLM53_EXTRAS:-}")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  extras="test${GLM53_EXTRAS:+,$GLM53_EXTRAS}"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
  printf '%s' "$want" > "$stamp"
fi

if [ "$action" = serve ]; then
  exec .venv/bin/python -m serving.run "$@"
else
  exec .venv/bin/python -m pytest "$@"
fi
