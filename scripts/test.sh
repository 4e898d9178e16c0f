#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Most of the suite's time is XLA compiling. A persistent compilation cache, fresh for this run and
# removed after it, lets tests (and the two workers) that build the same program compile it once.
cache=$(mktemp -d "${TMPDIR:-/tmp}/qspec-jax-test-xla.XXXXXX")
trap 'rm -rf "$cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# Two workers (QSPEC_TEST_WORKERS overrides; 0 runs in this process). worksteal hands each worker a
# contiguous half and rebalances at the end, so tests of one file mostly share a process.
.venv/bin/python -m pytest -q -n "${QSPEC_TEST_WORKERS:-2}" --dist worksteal tests "$@"
