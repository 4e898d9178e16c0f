#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One persistent compilation cache for this run's processes (both workers and the tests' subprocesses
# compile many identical programs), fresh each run and removed after it.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
    JAX_COMPILATION_CACHE_DIR="$(mktemp -d)"
    trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.2}"
# Two workers (QSPEC_TEST_WORKERS overrides; 0 runs in this process). worksteal hands each worker a
# contiguous half and rebalances at the end, so tests of one file mostly share a process.
.venv/bin/python -m pytest -q -n "${QSPEC_TEST_WORKERS:-2}" --dist worksteal tests "$@"
